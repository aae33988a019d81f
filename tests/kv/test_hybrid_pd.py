"""P/D for a hybrid (attention + Mamba2) model on the engine's seam: a prefill and a decode
AsyncEngine (threads of this process, over real shm and tcp transports) hand over the
attention KV layer by layer and each Mamba layer's state as of position n - 1, whole; the
tokens are the collocated engine's. A state that arrives short, or never, makes decode
recompute the prompt (the tokens stay the collocated ones). A hybrid with MoE layers needs
nothing more: its experts carry no per-request state."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from splitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, TransferConfig
from splitserve.engine.async_engine import AsyncEngine
from splitserve.kv.connector.pd_connector import make_pd_connector
from splitserve.kv.connector.prefill_side import PrefillConnector
from splitserve.kv.transport.arrivals import ArrivalTracker, TransferResult
from splitserve.kv.transport.base import KVTransport
from splitserve.kv.transport.nixl import NixlTransport
from splitserve.kv.transport.shm import ShmTransport
from splitserve.kv.transport.tcp import TcpTransport
from splitserve.kv.transport.types import PeerInfo
from tests.engine.test_hybrid_oracle import PATTERNS
from tests.generate_requests import generate_request
from tests.kv.test_pd_connector import GREEDY, collect, pd_generate, prompt

BLOCK = 16
PROMPTS = {
    "odd": prompt(1, 37),
    "exact-plus-one": prompt(2, 49),
    "short": prompt(4, 5),
    "long": prompt(5, 150),
}
SHARED = prompt(6, 40)  # decode computes it itself: its snapshot at 32 makes a prefix hit
FOLLOW_UP = SHARED + prompt(7, 30)
TRANSPORT_CLASSES: dict[str, type[KVTransport]] = {
    "shm": ShmTransport,
    "tcp": TcpTransport,
    "nixl": NixlTransport,
}


def make_engine(model: str, role: str, connector=None, budget: int = 2048) -> AsyncEngine:
    config = EngineConfig(
        model=ModelConfig(model=model),
        cache=CacheConfig(num_blocks=64, block_size=BLOCK),
        scheduler=SchedulerConfig(max_model_len=1024, max_num_batched_tokens=budget),
        role=role,
    )
    return AsyncEngine(config, connector=connector).start()


@pytest.fixture(scope="module")
def hybrid_model(request, tiny_model_factory) -> str:
    """The tiny Nemotron-H; a test may name another of PATTERNS (indirect parameter)."""
    return tiny_model_factory(arch="nemotron_h", pattern=PATTERNS[getattr(request, "param", "dense")])


@pytest.fixture(scope="module")
def expected(hybrid_model) -> Iterator[dict[str, list[int]]]:
    """The collocated engine's greedy tokens for every prompt here."""
    engine = make_engine(hybrid_model, "both")

    async def run() -> dict[str, list[int]]:
        prompts = {**PROMPTS, "shared": SHARED, "follow-up": FOLLOW_UP}
        return {name: (await collect(engine.generate(generate_request(f"ref-{name}", p, GREEDY))))[0]
                for name, p in prompts.items()}  # fmt: skip

    try:
        yield asyncio.run(run())
    finally:
        engine.shutdown()


def truncating(base: type[KVTransport]) -> type[KVTransport]:
    """A sender of the deployment (it holds the token) whose state frames lack their tail."""

    class Truncating(base):  # type: ignore[valid-type, misc]
        def push_state(
            self, peer: PeerInfo, transfer_id: str, state: bytes, state_hash: str, ready_at: float
        ):
            super().push_state(peer, transfer_id, state[: len(state) // 2], state_hash, ready_at)

    return Truncating


class StatelessPrefill(PrefillConnector):
    """A prefill worker that computes the state but never hands it over."""

    def save_state(self, request_id: str, state: bytes) -> None:
        return None


def sample(connector, name: str, labels: dict[str, str] | None = None) -> float:
    return connector.metrics.registry.get_sample_value(name, labels or {}) or 0.0


@pytest.mark.parametrize(
    ("hybrid_model", "kind"),
    [("dense", "shm"), ("dense", "tcp"), ("dense", "nixl"), ("moe", "shm")],
    indirect=["hybrid_model"],
)
def test_hybrid_pd_hands_over_the_state_whole_and_equals_collocated(hybrid_model, expected, kind):
    transfer = TransferConfig(transport=kind, timeout_s=10, reservation_ttl_s=30)
    prefill_connector = make_pd_connector("prefill", transfer)
    decode_connector = make_pd_connector("decode", transfer)
    # prefill in chunks of 24: n - 1 falls inside a chunk or at a chunk's end
    prefill = (make_engine(hybrid_model, "prefill", prefill_connector, budget=24), prefill_connector)
    decode = (make_engine(hybrid_model, "decode", decode_connector), decode_connector)
    state_bytes = decode[0].engine.runner.state_pool.slot_bytes

    async def run() -> None:
        block_bytes = 0
        for name, tokens in PROMPTS.items():
            out, final, prefill_out = await pd_generate(prefill, decode, f"{kind}-{name}", tokens, "push")
            assert out == expected[name], name
            handoff = final.kv_transfer_params["handoff"]
            assert handoff["transferred"] and handoff["state_bytes"] == state_bytes, handoff
            kv_blocks = -(-(len(tokens) - 1) // BLOCK)
            block_bytes = block_bytes or handoff["bytes"] // kv_blocks
            assert handoff["bytes"] == kv_blocks * block_bytes > 0  # KV only
            assert prefill_out.kv_transfer_params["state_bytes"] == state_bytes
            assert prefill_out.kv_transfer_params["kv_bytes"] == handoff["bytes"]
        # decode computes SHARED itself (a snapshot at 32); the follow-up's hit resumes there
        # and decode receives the rest, and the state, from prefill
        shared, _ = await collect(decode[0].generate(generate_request(f"{kind}-shared", SHARED, GREEDY)))
        assert shared == expected["shared"]
        out, final, _ = await pd_generate(prefill, decode, f"{kind}-follow-up", FOLLOW_UP, "push")
        assert out == expected["follow-up"]
        assert final.num_cached_tokens == len(FOLLOW_UP) - 1
        # blocks [2, 5) travelled: decode resumed from its own snapshot at 32
        assert final.kv_transfer_params["handoff"]["bytes"] == 3 * block_bytes

    try:
        asyncio.run(run())
        sent = sample(prefill_connector, "splitserve_kv_state_bytes_total", {"direction": "sent"})
        received = sample(decode_connector, "splitserve_kv_state_bytes_total", {"direction": "received"})
        assert sent == received == state_bytes * (len(PROMPTS) + 1)
        kv_received = sample(
            decode_connector, "splitserve_kv_transfer_bytes_total", {"direction": "received"}
        )
        assert kv_received == sample(
            prefill_connector, "splitserve_kv_transfer_bytes_total", {"direction": "sent"}
        )
        assert decode_connector.transport.arrivals.state_bytes_received == received
        decode[0].engine.check_integrity()
    finally:
        prefill[0].shutdown()
        decode[0].shutdown()


@pytest.mark.parametrize(
    "failure", ["short-state-shm", "short-state-tcp", "short-state-nixl", "no-state-tcp"]
)
def test_a_failed_state_transfer_recomputes_with_nothing_lost(hybrid_model, expected, failure):
    kind = failure.rsplit("-", 1)[1]
    transfer = TransferConfig(transport=kind, timeout_s=10, reservation_ttl_s=30)
    if failure.startswith("short"):
        sender = truncating(TRANSPORT_CLASSES[kind])("prefill-truncating", transfer)
        prefill_connector = make_pd_connector("prefill", transfer, transport=sender)
    else:
        prefill_connector = StatelessPrefill(transfer)
    decode_connector = make_pd_connector("decode", transfer)
    prefill = (make_engine(hybrid_model, "prefill", prefill_connector), prefill_connector)
    decode = (make_engine(hybrid_model, "decode", decode_connector), decode_connector)

    async def run() -> None:
        for name in ("odd", "long"):
            out, final, prefill_out = await pd_generate(
                prefill, decode, f"{failure}-{name}", PROMPTS[name], "push"
            )
            assert out == expected[name], name
            handoff = final.kv_transfer_params["handoff"]
            assert handoff["transferred"] is False and handoff["state_bytes"] == 0, handoff
            assert "Mamba state" in handoff["error"], handoff
            if failure.startswith("no-state"):
                assert (
                    "before its Mamba state was sent" in prefill_out.kv_transfer_params["kv_transfer_error"]
                )

    try:
        asyncio.run(run())
        assert sample(decode_connector, "splitserve_kv_fallbacks_total", {"action": "recompute"}) == 2
        assert sample(decode_connector, "splitserve_kv_transfer_failures_total", {"side": "decode"}) == 2
        assert sample(decode_connector, "splitserve_kv_state_bytes_total", {"direction": "received"}) == 0
        decode[0].engine.check_integrity()
    finally:
        prefill[0].shutdown()
        decode[0].shutdown()


def test_a_state_frame_lands_only_whole_once_and_for_its_tokens():
    results: list[TransferResult] = []
    tracker = ArrivalTracker(timeout_s=10, default_ttl_s=10)
    tracker.expect("t1", 2, [4, 5], results.append, block_hashes=["a", "b"], state_bytes=8, state_hash="b")
    tracker.expect("t2", 1, [6], results.append, block_hashes=["c"])
    for layer in (0, 1):
        tracker.record("t1", layer, [4, 5], 64, None)
    assert results == []  # every KV layer is in: the state is still missing
    assert tracker.land_state("t2", bytes(8), "c", None) == "no state is expected for this transfer"
    assert tracker.land_state("t1", bytes(8), "a", None) == "the state is bound to other tokens"
    assert tracker.land_state("t1", bytes(range(8)), "b", 1.0) is None
    assert [r.transfer_id for r in results] == ["t1"] and results[0].ok
    assert results[0].state == bytes(range(8)) and results[0].state_bytes == 8 and results[0].num_bytes == 128
    assert tracker.state_bytes_received == 8

    tracker.expect("t3", 1, [7], results.append, block_hashes=["d"], state_bytes=8, state_hash="d")
    assert "not whole" in (tracker.land_state("t3", bytes(7), "d", None) or "")
    assert results[-1].transfer_id == "t3" and not results[-1].ok and results[-1].state is None
    assert "not whole" in (results[-1].error or "")
    with pytest.raises(ValueError, match="hash it is bound to"):
        tracker.expect("t4", 1, [8], results.append, state_bytes=8)
