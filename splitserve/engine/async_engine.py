"""AsyncEngine: the LLMEngine loop in a background thread, fed by asyncio callers.

The thread sleeps on an Event while there is nothing to compute (no busy polling);
`generate` enqueues a request and wakes it. Outputs are handed to each caller's event
loop with call_soon_threadsafe, one batch per loop per step.

The same thread builds the engine (loads the model, prepacks its weights) before it runs
the loop, so all of torch's parallel work happens on that one thread. OpenMP keeps a team
of workers per thread that ever ran a parallel region, and libgomp stops its workers from
spinning between regions once it manages more threads than there are CPUs: a model loaded
on the caller's thread left a second team behind, and every parallel region of a decode
step then woke its workers from sleep (batch-1 steps ~1.5x slower on two cores).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

from splitserve.config import EngineConfig
from splitserve.encoder_cache.connector import ECConnector
from splitserve.engine.cpu_lending import IdleCpuLender
from splitserve.engine.kv_store_client import KVStoreClient
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model_runner import KVCacheAllocator
from splitserve.engine.multimodal import MultiModalInputs
from splitserve.engine.outputs import EngineStats, RequestOutput
from splitserve.kv.connector.base import KVConnector
from splitserve.protocol.errors import InvalidRequestError
from splitserve.protocol.generate_request import GenerateRequest

logger = logging.getLogger(__name__)

StepListener = Callable[[float, int], None]
# While only remote KV loads are pending, wake at least this often even if the
# connector forgets to call wakeup (a safety net, not the mechanism).
_REMOTE_WAIT_S = 0.05


class _Stream:
    """One generate call's channel. `started` turns True once the engine thread has
    added its request: outputs before that belong to an earlier request with this ID."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.started = False


class _AddCommand(NamedTuple):
    stream: _Stream
    request: GenerateRequest
    multimodal: MultiModalInputs | None
    arrival_time: float


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        connector: KVConnector | None = None,
        kv_cache_allocator: KVCacheAllocator | None = None,
        ec_connector: ECConnector | None = None,  # visual embeddings from encoder workers
        kv_store: KVStoreClient | None = None,  # the KV store tier (engine/kv_store_client.py)
    ) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._go = threading.Event()  # start() or shutdown(): the loop may run (or end)
        self._commands: list[_AddCommand | str] = []  # a str is a request ID to abort
        self._streams: dict[str, _Stream] = {}
        self._listeners: list[StepListener] = []
        self._stopping = False
        built = threading.Event()
        failure: list[BaseException] = []

        def build_then_run() -> None:
            try:
                self.engine = LLMEngine(config, connector, kv_cache_allocator, ec_connector, kv_store)
            except BaseException as exc:  # re-raised on the constructing thread
                failure.append(exc)
                return
            finally:
                built.set()
            self._go.wait()
            if not self._stopping:
                self._run()

        self._thread: threading.Thread | None = threading.Thread(
            target=build_then_run, name="splitserve-engine", daemon=True
        )
        self._thread.start()
        built.wait()
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]
        self.model_info = self.engine.model_info
        self._stats = self.engine.stats()
        if connector is not None:
            connector.set_wakeup(self._wake.set)
        if kv_store is not None:
            kv_store.set_wakeup(self._wake.set)
        lend_file = config.cpu_lending.lend_file
        # busy while the engine thread computes, idle (lent) while it waits
        self._lender = IdleCpuLender(lend_file) if lend_file else None

    # ---- lifecycle ----------------------------------------------------------------
    def start(self) -> AsyncEngine:
        if self._thread is None:
            raise RuntimeError("AsyncEngine was shut down; build a new one")
        self._go.set()
        return self

    def shutdown(self) -> None:
        self._stopping = True
        self._go.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self._lender is not None:
            self._lender.close()
        with self._lock:
            streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self._deliver(stream, [_aborted_output(request_id)])
        self.engine.shutdown()

    @property
    def is_running(self) -> bool:
        thread = self._thread
        return self._go.is_set() and not self._stopping and thread is not None and thread.is_alive()

    def __enter__(self) -> AsyncEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- API ----------------------------------------------------------------------
    def validate_request(self, request: GenerateRequest) -> MultiModalInputs | None:
        return self.engine.validate_request(request)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs (deltas) until one is finished. Invalid requests
        raise at the first `__anext__`, before any output. Closing or cancelling the
        iterator early aborts the request and frees its blocks."""
        if not self.is_running:
            raise RuntimeError("AsyncEngine is not running; call start()")
        multimodal = self.validate_request(request)
        request_id = request.request_id
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request_id {request_id!r} is already in use", param="request_id")
            self._streams[request_id] = stream
            # immutable from the API edge; the engine's Request copies its token IDs once
            self._commands.append(_AddCommand(stream, request, multimodal, time.monotonic()))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)
            with self._lock:
                if self._streams.get(request_id) is stream:
                    del self._streams[request_id]

    def abort(self, request_id: str) -> bool:
        """Abort a request; False if no such request is in flight."""
        with self._lock:
            if request_id not in self._streams:
                return False
            self._commands.append(request_id)
        self._wake.set()
        return True

    def stats(self) -> EngineStats:
        """The snapshot of the engine thread's last loop, plus the prompts accepted since
        (not yet added), so that a router polling the load sees every request it sent."""
        with self._lock:
            pending = sum(len(c.request.token_ids) for c in self._commands if isinstance(c, _AddCommand))
        stats = self._stats
        if not pending:
            return stats
        return stats._replace(num_waiting_prefill_tokens=stats.num_waiting_prefill_tokens + pending)

    def add_step_listener(self, listener: StepListener) -> None:
        """`listener(step_time_s, num_tokens)` is called on the engine thread after each
        step that ran the model; keep it cheap (e.g. a histogram observe)."""
        self._listeners.append(listener)

    # ---- the engine thread --------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            with self._lock:
                commands, self._commands = self._commands, []
            # in arrival order: a client may close a stream and reuse its ID at once
            for command in commands:
                if isinstance(command, str):
                    engine.abort_request([command])
                    # route the abort now, before a new request may take over the ID
                    self._route(engine.take_pending_outputs())
                    continue
                try:
                    engine.add_validated_request(
                        command.request, command.multimodal, arrival_time=command.arrival_time
                    )
                except Exception as exc:  # validated already; a race or an engine bug
                    self._deliver(command.stream, [exc])
                else:
                    command.stream.started = True
            if commands:  # the new requests count as load from now on, not after the step
                self._stats = engine.stats()
            engine.poll_connector()
            if not engine.has_runnable_work():
                self._stats = engine.stats()
                if self._lender is not None:
                    self._lender.idle()
                timeout = _REMOTE_WAIT_S if engine.has_unfinished_requests() else None
                self._wake.wait(timeout)
                self._wake.clear()
                continue
            steps_before = engine.num_steps
            try:
                outputs = engine.step()
            except Exception:
                logger.exception("engine step failed outside the model; failing all requests")
                outputs = engine.fail_all_requests()
            self._stats = engine.stats()
            if self._lender is not None:  # lent until a step computes (a reservation does not)
                self._lender.set_busy(engine.num_steps != steps_before)
            if engine.num_steps != steps_before:
                for listener in self._listeners:
                    try:
                        listener(engine.last_step_time_s, engine.last_step_tokens)
                    except Exception:
                        logger.exception("step listener failed")
            self._route(outputs)
            if engine.num_steps == steps_before and not outputs:
                # Waiting requests but no free blocks (held by remote loads or delayed
                # frees): sleep until a command or the connector wakes us.
                self._wake.wait(_REMOTE_WAIT_S)
                self._wake.clear()

    def _route(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their callers' loops, one call per loop."""
        batches: dict[int, tuple[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]]] = {}
        with self._lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None and stream.started:
                    batches.setdefault(id(stream.loop), (stream.loop, []))[1].append((stream.queue, output))
        for loop, items in batches.values():
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed
                loop.call_soon_threadsafe(_put_all, items)

    @staticmethod
    def _deliver(stream: _Stream, payloads: list[RequestOutput | Exception]) -> None:
        with contextlib.suppress(RuntimeError):
            stream.loop.call_soon_threadsafe(_put_all, [(stream.queue, p) for p in payloads])


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, payload in items:
        queue.put_nowait(payload)


def _aborted_output(request_id: str) -> RequestOutput:
    return RequestOutput(request_id, [], None, True, "abort", 0, 0, None, {})
