"""A tier's Serve replica: the tier's own server (`splitserve render`, `splitserve engine
--role ROLE` or `splitserve kvstore`) as a child process on the replica's node, on a free
port, supervised by the replica and registered with the ingress.

- Up: the replica starts the server, waits for its /health, and Serve's first health
  check registers its URL with the ingress (`ProxyIngress.register`); every later check
  registers again (a heartbeat, so a restarted ingress learns every worker within one
  period) and fails once the server has exited, so Serve replaces the replica.
- Down (scale-down, redeploy, `splitserve down --ray`): Serve calls `__del__`, which
  deregisters first (the router sends nothing new) and then stops the server, which
  drains what it still serves.
- A replica that dies outright takes its server with it: the server is started through
  `runtime/process_lifetime.py`'s launcher, so the kernel sends it SIGKILL when the
  replica goes (Linux PR_SET_PDEATHSIG; it follows the thread that started it, the
  replica's event-loop thread, which lives as long as the replica); the router's health
  check takes the URL out of rotation at once and the ingress drops it once its
  heartbeats stop. Its server's log (splitserve-ray-ROLE-*.log in the node's temp
  directory) stays for the post-mortem; a replica that stops normally, or never came up,
  removes its log.
- Placement-aware wiring: an engine gets `--kv-transport auto --kv-node-id NODE` (shm
  with engines on its node, tcp with the others); with an encoder tier, every engine and
  encoder asks the ingress where the encoder cache is before starting its server and gets
  its directory on that node (shm) or its server's address elsewhere (tcp). A heartbeat
  answered with another cache (the ingress was replaced) fails the health check, so Serve
  restarts the replica against the new one.
- `--afd A:F` (an `ffn` tier): an ffn replica runs the FFN daemon (`engine --role ffn`,
  no HTTP: it is ready, and healthy, while it answers PING) and registers with nobody;
  each decode replica asks the ffn deployment (a handle bound into it) for a daemon's
  address before it starts its engine (`--ffn-address`; Serve picks the replica), and
  fails its health check once that daemon has not answered PING for FFN_GONE_S (dead, or
  replaced on another address), so Serve restarts it against a live one.
- The KV store tier (`kvstore`, one replica): `splitserve kvstore` on the node's address,
  its block port and KV-event endpoints registered with the ingress, which follows its
  events. Every prefill and decode replica waits for the store's registration before
  starting its server (`--kv-store HOST:PORT`); a heartbeat answered with another address
  (Serve replaced the store replica) re-points the running server at it, so a store that
  dies costs only the hits it held.

The internal token (and the render tier's state key) reach the server through the
environment the deployment gives the replica, never its command line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import tempfile
import time
from typing import Any

import httpx
import zmq

from splitserve.deploy.liveness import ffn_answers
from splitserve.deploy.plan import FFN_ROLE, STORE_ROLE, kv_event_flags
from splitserve.ray_serve.config import ServerConfig
from splitserve.runtime.access import internal_headers
from splitserve.runtime.ports import pick_free_port
from splitserve.runtime.process_lifetime import child_command

logger = logging.getLogger(__name__)

INGRESS_NAME = "ProxyIngress"
LOAD_METRIC = "tier_load"  # the custom autoscaling metric every tier replica reports
PLANNED_METRIC = "planned_replicas"  # --ray-planner's target for the tier, from the ingress
REGISTER_TIMEOUT_S = 5.0
# A live ingress deregisters a replica in milliseconds; when the whole application goes
# down the ingress is stopping too and never answers, and waiting REGISTER_TIMEOUT_S for it
# made every `down` 5 s longer. A missed deregistration costs nothing: the ingress drops a
# worker whose heartbeats stop.
DEREGISTER_TIMEOUT_S = 1.0
STORE_WAIT_S = 0.5  # how often an engine replica asks whether the KV store has registered
STARTUP_TIMEOUT_S = 300.0
PORT_ATTEMPTS = 3  # a server whose port was taken before it bound it starts again on new ones
FFN_GONE_S = 30.0  # a decode replica's daemon silent this long: the engine's --ffn-timeout


def encoder_cache_flags(node_id: str, home: dict[str, Any] | None) -> list[str]:
    """How a replica on `node_id` reaches the deployment's encoder cache (the ingress's,
    `home`): its directory when both sit on one node (shm), else its server (tcp)."""
    if home is None:
        return []
    if home["node_id"] == node_id:
        return ["--ec-shm-dir", home["shm_dir"]]
    return ["--ec-remote", f"{home['host']}:{home['port']}"]


def encoder_cache_path(flags: list[str]) -> str | None:
    """How `encoder_cache_flags` reach the cache: "shm", "tcp", or None (no encoder tier)."""
    if not flags:
        return None
    return "shm" if flags[0] == "--ec-shm-dir" else "tcp"


def ports_needed(role: str) -> int:
    """A replica's server ports: HTTP; an engine's KV events and replay too; the KV
    store's block port, events and replay."""
    return 4 if role == STORE_ROLE else 3


def server_command(
    config: ServerConfig,
    role: str,
    host: str,
    ports: list[int],
    node_id: str,
    ec_flags: list[str],
    ffn_address: str | None = None,
    store_address: str | None = None,
) -> list[str]:
    """The `splitserve` command line a replica of `role` runs on node `node_id`: the tier's
    plan, then where this replica is (no secrets on it), for an attention engine (decode
    with an ffn tier) the FFN daemon it calls, and for an engine where the KV store is."""
    tier = config.tier(role)
    command = [*tier.argv, "--host", host, "--port", str(ports[0])]
    if role in ("render", FFN_ROLE):
        return command
    if role == STORE_ROLE:
        return [*command, "--kv-port", str(ports[1]), *kv_event_flags(host, ports[2], ports[3])]
    if ffn_address is not None:
        command += ["--ffn-address", ffn_address]
    command += ec_flags
    if tier.moves_kv:
        if config.transport == "auto":  # shm with the engines on this node, tcp with the others
            command += ["--kv-node-id", node_id]
        command += kv_event_flags(host, ports[1], ports[2])
        if store_address is not None:
            command += ["--kv-store", store_address]
    return command


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) the process has used so far."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat_file:
        fields = stat_file.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class TierReplica:
    """One replica of `role` (render, prefill, decode, encoder, ffn or kvstore); see the
    module docstring. `ffn`: the ffn deployment's handle, bound into the decode tier of `--afd`."""

    async def __init__(self, role: str, config: ServerConfig, ffn: Any = None) -> None:
        import ray

        self.role = role
        self.config = config
        context = ray.get_runtime_context()
        self.node_id = context.get_node_id()
        self.replica = context.get_actor_name() or ""
        host = ray.util.get_node_ip_address()
        self.url = ""
        self.ffn_address: str | None = None  # the daemon this attention engine calls
        self.ffn_silent_since: float | None = None
        # the store's block address (a store replica), or the one this engine's server uses
        self.store_address: str | None = None
        self.ec_home: dict[str, Any] | None = None
        self.planned_replicas: int | None = None  # the planner's target, with each heartbeat
        if config.encoder_cache and role != "render":  # where the ingress keeps the encoder cache
            self.ec_home = await asyncio.wait_for(self.ingress().encoder_cache.remote(), STARTUP_TIMEOUT_S)
        ec_flags = encoder_cache_flags(self.node_id, self.ec_home)
        self.ec_path = encoder_cache_path(ec_flags)
        if ffn is not None:  # one of the ffn tier's daemons (Serve picks the replica)
            self.ffn_address = await asyncio.wait_for(ffn.address.remote(), STARTUP_TIMEOUT_S)
        if config.kv_store and config.tier(role).moves_kv:
            self.store_address = await asyncio.wait_for(self.registered_store(), STARTUP_TIMEOUT_S)
        for attempt in range(1, PORT_ATTEMPTS + 1):
            # A port found free may be taken before the server binds it (another replica
            # on this node picking at the same moment): then new ports, up to PORT_ATTEMPTS.
            ports: list[int] = []
            for _ in range(ports_needed(role)):
                ports.append(pick_free_port(host, avoid=ports))
            self.url = f"tcp://{host}:{ports[0]}" if role == FFN_ROLE else f"http://{host}:{ports[0]}"
            if role == STORE_ROLE:
                self.store_address = f"{host}:{ports[1]}"
            command = server_command(
                config, role, host, ports, self.node_id, ec_flags, self.ffn_address, self.store_address
            )
            self.start_server(command)
            try:
                await self.wait_healthy()
                break
            except BaseException:  # Serve retries with a new replica: leave nothing behind
                self.process.kill()
                self.process.wait()
                taken = "Address already in use" in self.exited()
                with contextlib.suppress(OSError):
                    os.unlink(self.log_path)
                if not taken or attempt == PORT_ATTEMPTS:
                    raise
                logger.warning("%s server: a port was taken before it bound it; new ports", role)
        self.deregistered = False

    def start_server(self, command: list[str]) -> None:
        log_fd, self.log_path = tempfile.mkstemp(prefix=f"splitserve-ray-{self.role}-", suffix=".log")
        with os.fdopen(log_fd, "wb") as log_file:
            # No preexec_fn: a replica has many threads, and a child forked from them could
            # hang before its exec (process_lifetime.py says why); the launcher does the prctl.
            self.process = subprocess.Popen(
                child_command(command),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=dict(os.environ),  # the deployment's token (and state key) are in here
            )
        self.cpu_mark = (time.monotonic(), 0.0)

    def address(self) -> str:
        """An ffn replica's daemon, as an attention engine's --ffn-address (HOST:PORT)."""
        return self.url.removeprefix("tcp://")

    async def wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        if self.role == FFN_ROLE:  # no HTTP: ready once its loop answers PING
            while not await asyncio.to_thread(self.daemon_answers, self.url):
                if self.process.poll() is not None:
                    raise RuntimeError(self.exited())
                if time.monotonic() > deadline:
                    raise RuntimeError(f"FFN daemon not answering PING after {STARTUP_TIMEOUT_S:.0f}s")
            return
        async with httpx.AsyncClient(timeout=2.0, headers=internal_headers()) as client:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(self.exited())
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}/health")).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.role} server not healthy after {STARTUP_TIMEOUT_S:.0f}s")
                await asyncio.sleep(0.2)

    def exited(self, limit: int = 3000) -> str:
        """Why the server is gone: its exit code and the end of its log."""
        with open(self.log_path, encoding="utf-8", errors="replace") as log_file:
            tail = log_file.read()[-limit:]
        return f"{self.role} server exited ({self.process.returncode}):\n{tail}"

    @staticmethod
    def daemon_answers(url: str) -> bool:
        with zmq.Context() as context:
            return ffn_answers(context, url)

    async def registered_store(self) -> str:
        """The KV store's block address, once its replica has registered with the ingress
        (it may start after this one)."""
        while True:
            address = await self.ingress().kv_store.remote()
            if address is not None:
                return address
            await asyncio.sleep(STORE_WAIT_S)

    def ingress(self):
        from ray import serve

        return serve.get_deployment_handle(INGRESS_NAME, app_name=self.config.app_name)

    async def check_health(self) -> None:
        """Serve's health check: the server runs (else Serve replaces this replica), and
        the ingress knows it (a heartbeat)."""
        if self.process.poll() is not None:
            raise RuntimeError(self.exited())
        if self.role == FFN_ROLE:
            return  # the router has no FFN pool: its attention engines find it
        if self.ffn_address is not None:
            await self.check_daemon(self.ffn_address)
        try:
            answer = await asyncio.wait_for(
                self.ingress().register.remote(
                    self.role, self.url, self.node_id, self.replica, self.ec_path, self.store_address
                ),
                REGISTER_TIMEOUT_S,
            )
        except Exception as exc:  # the ingress restarting: the next heartbeat registers again
            logger.warning("%s %s: registering with the ingress failed: %r", self.role, self.url, exc)
            return
        self.planned_replicas = answer["planned_replicas"]
        home = answer["encoder_cache"]
        if self.ec_home is not None and home != self.ec_home:  # a new ingress keeps a new cache
            raise RuntimeError("the encoder cache moved (the ingress was replaced): restarting against it")
        store = answer["kv_store"]
        engine_with_store = self.role != STORE_ROLE and self.store_address is not None
        if engine_with_store and store not in (None, self.store_address):
            await self.follow_store(store)

    async def follow_store(self, address: str) -> None:
        """Serve replaced the KV store replica: point the running server at the new one
        (its prefix cache and requests stay; only the old store's hits are gone)."""
        try:
            async with httpx.AsyncClient(timeout=REGISTER_TIMEOUT_S, headers=internal_headers()) as client:
                response = await client.post(f"{self.url}/inference/v1/kv/store", json={"address": address})
        except httpx.HTTPError as exc:  # a busy server: the next heartbeat tries again
            logger.warning("%s %s: telling it the KV store moved failed: %r", self.role, self.url, exc)
            return
        if response.status_code != 200:
            raise RuntimeError(f"{self.role} server refused the KV store's new address: {response.text}")
        logger.warning("%s %s: the KV store moved to %s", self.role, self.url, address)
        self.store_address = address

    async def check_daemon(self, address: str) -> None:
        """An attention engine's daemon answers PING, or has not for under FFN_GONE_S."""
        if await asyncio.to_thread(self.daemon_answers, f"tcp://{address}"):
            self.ffn_silent_since = None
            return
        now = time.monotonic()
        self.ffn_silent_since = self.ffn_silent_since or now
        if now - self.ffn_silent_since > FFN_GONE_S:
            raise RuntimeError(
                f"the FFN daemon at {address} has not answered PING for {FFN_GONE_S:.0f}s: "
                "restarting against a live one"
            )

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The tier's own load signal (docs/ray.md): decode, the fraction of KV blocks in
        use; prefill, requests running or queued; render and encoder, CPU seconds per second."""
        if self.role in ("render", "encoder", STORE_ROLE):
            now, used = time.monotonic(), cpu_seconds(self.process.pid)
            then, used_before = self.cpu_mark
            self.cpu_mark = (now, used)
            return {LOAD_METRIC: (used - used_before) / max(now - then, 1e-3)}
        async with httpx.AsyncClient(timeout=2.0, headers=internal_headers()) as client:
            stats = (await client.get(f"{self.url}/inference/v1/stats")).json()
        load = stats["kv_usage"] if self.role == "decode" else stats["num_running"] + stats["num_waiting"]
        planned = {} if self.planned_replicas is None else {PLANNED_METRIC: float(self.planned_replicas)}
        return {LOAD_METRIC: float(load), **planned}

    def info(self) -> dict[str, Any]:
        """Where this replica's server is, and how it reaches the encoder cache."""
        return {
            "role": self.role,
            "url": self.url,
            "node_id": self.node_id,
            "replica": self.replica,
            "encoder_cache": self.ec_path,
            "kv_store": self.store_address,
        }

    async def __del__(self) -> None:
        """Serve's graceful shutdown: leave the router, then stop the server (draining)."""
        if getattr(self, "deregistered", True):
            return
        self.deregistered = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ingress().deregister.remote(self.url), DEREGISTER_TIMEOUT_S)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15.0
        while self.process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.process.poll() is None:
            self.process.kill()
        with contextlib.suppress(OSError):
            os.unlink(self.log_path)
