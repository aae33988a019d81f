"""`up`'s stack of local processes: the plan's parts started on free loopback ports (the
proxy last, on `--host:--port`, once the others are healthy), supervised while they run
(restarted when they die, killed and restarted when wedged) and stopped draining."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

import httpx

from splitserve.deploy.cpu_affinity import idle_cpu_lenders
from splitserve.deploy.liveness import LivenessWatch
from splitserve.deploy.plan import FFN_ROLE, STORE_ROLE, DeploymentPlan, TierPlan, kv_event_flags, tier_env
from splitserve.deploy.supervisor import Part, Supervisor, kill_part, start_part
from splitserve.deploy.up_afd import ffn_addresses
from splitserve.runtime.access import API_KEY_ENV, INTERNAL_TOKEN_ENV, api_keys
from splitserve.runtime.ports import pick_free_port
from splitserve.runtime.process_lifetime import owned_directory, remove_dead_owners

POLL_S = 0.05  # start-up, stop and supervision: a part is seen healthy or gone within this
INTERNAL_HOST = "127.0.0.1"  # internal parts: only the proxy is exposed (--host)

EC_DIRECTORY_PREFIX = "splitserve-ec-up-"
LEND_DIRECTORY_PREFIX = "splitserve-lend-up-"


def _tmpfs_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def ec_directory() -> str:
    """A fresh encoder-cache directory on tmpfs (where there is one), named after this `up`."""
    return owned_directory(EC_DIRECTORY_PREFIX, _tmpfs_root())


def remove_stale_directories() -> None:
    """The encoder caches and CPU-lending files of `up`s that are gone (SIGKILLed: their
    clean-up never ran)."""
    for prefix in (EC_DIRECTORY_PREFIX, LEND_DIRECTORY_PREFIX):
        for path in remove_dead_owners(prefix, _tmpfs_root()):
            print(f"splitserve up: removed {path}, left by an up that is gone", file=sys.stderr)


def wait_healthy(parts: list[Part], timeout_s: float) -> str | None:
    """None when every part answers /health (an FFN daemon, which has no HTTP: accepts a
    connection on its port; the decode engines it serves are healthy only once it has
    answered their HELLO); else why not."""
    deadline = time.monotonic() + timeout_s
    pending = list(parts)
    with httpx.Client(timeout=2.0) as client:
        while pending:
            for part in list(pending):
                if part.process.poll() is not None:
                    return f"{part.name} exited with code {part.process.returncode} while starting"
                if part.url.startswith("tcp://"):
                    if port_accepts(part.url):
                        pending.remove(part)
                    continue
                headers = {"Authorization": f"Bearer {part.credential}"} if part.credential else {}
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{part.url}/health", headers=headers).status_code == 200:
                        pending.remove(part)
            if time.monotonic() > deadline:
                return f"not healthy after {timeout_s:.0f}s: {', '.join(p.name for p in pending)}"
            if pending:
                time.sleep(POLL_S)
    return None


def port_accepts(url: str) -> bool:
    """Whether something listens at `tcp://HOST:PORT`."""
    host, _, port = url.removeprefix("tcp://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except OSError:
        return False


def stop_parts(parts: list[Part], timeout_s: float, at_once: list[int]) -> None:
    """SIGTERM each part and wait for it to drain and exit, or kill it past `timeout_s`
    or once `at_once` holds a signal (the second Ctrl-C)."""
    for part in parts:
        if part.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                part.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for part in parts:
        while part.process.poll() is None and time.monotonic() < deadline and not at_once:
            time.sleep(POLL_S)
        kill_part(part)


def stop_draining(parts: list[Part], drain_timeout_s: float, at_once: list[int]) -> None:
    """The proxy first: it drains its streams while the parts behind it still serve
    them; then the others, which have nothing left in flight."""
    front = [p for p in parts if p.name == "proxy"]
    stop_parts(front, drain_timeout_s + 15, at_once)
    stop_parts([p for p in parts if p.name != "proxy"], drain_timeout_s + 15, at_once)


ENGINE_ROLES = ("prefill", "decode", "encoder")
SHARED_CORES_SERIAL_STEP_TOKENS = 8  # steps of at most this many tokens on one thread


class LocalStack:
    """The parts of one `up`, started from `plan` (`start`), watched (`supervise`) and
    stopped (`stop`); `request_stop` is its signal handler (Ctrl-C twice: at once)."""

    def __init__(
        self,
        plan: DeploymentPlan,
        secrets: dict[str, str],
        pinned: dict[str, frozenset[int]],
        proxy_host: str,
        proxy_port: int,
        lend_idle_cpus: bool = True,
    ) -> None:
        self.plan = plan
        self.secrets = secrets
        self.pinned = pinned
        # pinned prefill part -> the pinned decode parts whose idle CPUs it borrows
        self.lenders = idle_cpu_lenders(pinned) if lend_idle_cpus else {}
        self.proxy_host = proxy_host
        self.proxy_port = proxy_port
        self.parts: list[Part] = []
        self.cleanup: list[str] = []  # directories of this run
        self.picked = {proxy_port}  # the proxy binds last: every part's port differs from it and each other
        self.stop_requested: list[int] = []
        self.stop_at_once: list[int] = []
        self.liveness: LivenessWatch | None = None

    def request_stop(self, signum: int, _frame: object) -> None:
        (self.stop_at_once if self.stop_requested else self.stop_requested).append(signum)

    def free_port(self) -> int:
        port = pick_free_port(INTERNAL_HOST, avoid=self.picked)
        self.picked.add(port)
        return port

    def start_part(
        self, name: str, tier: TierPlan, argv: list[str], url: str, credential: str | None
    ) -> None:
        """Start one part: the tier's command line, then this part's own arguments."""
        env = {**os.environ, **tier_env(tier, self.secrets)}
        self.parts.append(start_part(name, [*tier.argv, *argv], url, env, credential, self.pinned.get(name)))

    def start(self, timeout_s: float) -> str | None:
        """Start every part, the proxy once the others serve; None when all are healthy
        (or a stop came meanwhile), else why not."""
        token = self.secrets[INTERNAL_TOKEN_ENV]
        names = iter(self.plan.part_names())
        host = INTERNAL_HOST
        render = self.plan.tier("render")
        for _ in range(self.plan.count("render")):
            port = self.free_port()
            argv = ["--host", host, "--port", str(port)]
            self.start_part(next(names), render, argv, f"http://{host}:{port}", token)
        store_flags: list[str] = []  # the engines': where the KV store's blocks are
        store_url: str | None = None  # the proxy's: where it learns what the store holds
        if self.plan.count(STORE_ROLE):
            port, kv_port = self.free_port(), self.free_port()
            argv = ["--host", host, "--port", str(port), "--kv-port", str(kv_port)]
            argv += kv_event_flags(host, self.free_port(), self.free_port())
            store_url = f"http://{host}:{port}"
            self.start_part(next(names), self.plan.tier(STORE_ROLE), argv, store_url, token)
            store_flags = ["--kv-store", f"{host}:{kv_port}"]
        ffn_ports = [self.free_port() for _ in range(self.plan.count(FFN_ROLE))]
        for port in ffn_ports:  # no HTTP: the url says where its ZeroMQ socket listens
            argv = ["--host", host, "--port", str(port)]
            self.start_part(next(names), self.plan.tier(FFN_ROLE), argv, f"tcp://{host}:{port}", token)
        ffn_flags = [["--ffn-address", a] for a in ffn_addresses(host, ffn_ports, self.plan.count("decode"))]
        ec_flags: list[str] = []
        if self.plan.count("encoder"):  # one encoder cache for the stack's engines, on this host's tmpfs
            ec_dir = ec_directory()
            self.cleanup.append(ec_dir)
            ec_flags = ["--ec-shm-dir", ec_dir]
        lending = self.lending_flags()
        threads = self.thread_flags()
        engines = [self.plan.tier(role) for role in ENGINE_ROLES]
        # Every P/D engine's KV socket is known up front, and each engine may dial only
        # those: a request naming any other host or port is refused (egress allow-list).
        kv_ports = [
            [self.free_port() for _ in range(self.plan.count(tier.role))] if tier.moves_kv else []
            for tier in engines
        ]
        kv_peers = [f"{host}:{port}" for ports in kv_ports for port in ports]
        for tier, ports in zip(engines, kv_ports, strict=True):
            for index in range(self.plan.count(tier.role)):
                port = self.free_port()
                name = next(names)
                argv = ["--host", host, "--port", str(port), *ec_flags, *lending.get(name, [])]
                argv += threads.get(name, [])
                if tier.moves_kv:
                    argv += ["--kv-port", str(ports[index]), "--kv-peers", *kv_peers, *store_flags]
                    argv += kv_event_flags(host, self.free_port(), self.free_port())
                if tier.role == "decode" and ffn_flags:
                    argv += ffn_flags[index]
                self.start_part(name, tier, argv, f"http://{host}:{port}", token)
        error = wait_healthy(self.parts, timeout_s)
        if error is not None or self.stop_requested:
            return error
        proxy = ["--host", self.proxy_host, "--port", str(self.proxy_port)]
        for role in ("render", "prefill", "decode", "encoder"):
            proxy += [f"--{role}", *[p.url for p in self.parts if p.name.startswith(role)]]
        if store_url is not None:
            proxy += ["--kv-store", store_url]
        # several keys (comma-separated, the proxy's form): up checks health with the first
        health_key = next(iter(api_keys(self.secrets.get(API_KEY_ENV))), None)
        url = f"http://{self.proxy_host}:{self.proxy_port}"
        self.start_part(next(names), self.plan.tier("proxy"), proxy, url, health_key)
        return wait_healthy(self.parts[-1:], timeout_s)

    def thread_flags(self) -> dict[str, list[str]]:
        """Engines that share the host's cores (more than one engine, not pinned) run small
        steps on one thread: each engine's OpenMP workers on every core would stall on
        each other's barriers whenever another engine computes (a migration test's stack
        took 2-4x as long). A lone or pinned engine keeps every step on all its threads."""
        engines = [name for name in self.plan.part_names() if name.split("-")[0] in ENGINE_ROLES]
        if len(engines) < 2:
            return {}
        return {name: ["--serial-step-tokens", str(SHARED_CORES_SERIAL_STEP_TOKENS)]
                for name in engines if name not in self.pinned}  # fmt: skip

    def lending_flags(self) -> dict[str, list[str]]:
        """Each lending decode part's and borrowing prefill part's flags: one lock file per
        lender, in a directory of this run (engine/cpu_lending.py)."""
        if not self.lenders:
            return {}
        directory = owned_directory(LEND_DIRECTORY_PREFIX, _tmpfs_root())
        self.cleanup.append(directory)
        flags: dict[str, list[str]] = {}
        for borrower, lenders in self.lenders.items():
            for lender in lenders:
                flags[lender] = ["--lend-idle-cpus", os.path.join(directory, lender)]
            flags[borrower] = ["--borrow-idle-cpus", *(os.path.join(directory, d) for d in lenders)]
        return flags

    def supervise(self, liveness_timeout_s: float) -> int:
        """Restart what dies (or wedges) until a stop is asked for (0) or a part cannot
        start again (1)."""
        supervisor = Supervisor(self.parts)
        self.liveness = LivenessWatch(lambda: self.parts, liveness_timeout_s)
        self.liveness.start()
        while not self.stop_requested:
            error = supervisor.poll()
            if error is not None:
                print(f"splitserve up: {error}; stopping", file=sys.stderr)
                return 1
            time.sleep(POLL_S)
        return 0

    def stop(self, drain_timeout_s: float) -> None:
        if self.liveness is not None:
            self.liveness.stop()  # a draining part is slow to answer: it is not to be killed
        stop_draining(self.parts, drain_timeout_s, self.stop_at_once)
        for directory in self.cleanup:
            shutil.rmtree(directory, ignore_errors=True)
