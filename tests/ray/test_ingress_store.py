"""The Ray ingress and the KV store tier, without a cluster: the ingress hands the store's
block address to the engine replicas (with every heartbeat's answer), follows its KV
events into the routing index, and when Serve replaces the store replica (a new URL and
address) forgets the old one's blocks and follows the new one's. Two real `splitserve
kvstore` processes (open loopback: no token) and the ingress's own router."""

from __future__ import annotations

import asyncio

from splitserve.kv_store.wire import StoreClient
from splitserve.ray_serve.ingress import ProxyIngress
from tests.conftest import free_port, running_servers, wait_until
from tests.kv_store.test_kv_store_cli import open_env
from tests.kv_store.test_store import chain, put

DECODE = "http://127.0.0.1:1"  # an engine replica: only its heartbeat's answer is used here


def store_command(port: int, kv_port: int) -> list[str]:
    events = ["--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}"]
    events += ["--kv-events-replay-endpoint", f"tcp://127.0.0.1:{free_port()}"]
    return ["kvstore", "--port", str(port), "--kv-port", str(kv_port), "--kv-store-ram-gb", "0.01", *events]


def test_the_ingress_follows_the_store_and_its_replacement():
    ports = [(free_port(), free_port()) for _ in range(2)]
    servers = [(store_command(port, kv_port), port) for port, kv_port in ports]
    (_, kv_old), (_, kv_new) = ports
    old_address, new_address = f"127.0.0.1:{kv_old}", f"127.0.0.1:{kv_new}"
    with running_servers(servers, env=open_env()) as (old_url, new_url):
        asyncio.run(follow_a_replaced_store(old_url, new_url, old_address, new_address))


async def follow_a_replaced_store(old_url: str, new_url: str, old_address: str, new_address: str) -> None:
    ingress = ProxyIngress(16, "push", False)
    index = ingress.engine.kv_index
    try:
        answer = await ingress.register("decode", DECODE, "node-a", "d", None, None)
        assert answer["kv_store"] is None and ingress.kv_store() is None  # an engine waits for it

        await ingress.register("kvstore", old_url, "node-a", "s1", None, old_address)
        assert ingress.kv_store() == old_address
        answer = await ingress.register("decode", DECODE, "node-a", "d", None, old_address)
        assert answer["kv_store"] == old_address
        writer = StoreClient("127.0.0.1", int(old_address.rpartition(":")[2]), None, timeout_s=5)
        assert put(writer, chain(list(range(12)))) == 3
        writer.close()
        assert wait_until(lambda: index.store_blocks() == {"CPU": 3}), index.store_blocks()

        # Serve replaced the store replica: the engines' next heartbeats learn the new
        # address, and the router credits none of the old store's blocks
        await ingress.register("kvstore", new_url, "node-b", "s2", None, new_address)
        answer = await ingress.register("decode", DECODE, "node-a", "d", None, old_address)
        assert answer["kv_store"] == new_address and index.store_blocks() == {}
        writer = StoreClient("127.0.0.1", int(new_address.rpartition(":")[2]), None, timeout_s=5)
        assert put(writer, chain(list(range(100, 108)))) == 2
        writer.close()
        assert wait_until(lambda: index.store_blocks() == {"CPU": 2}), index.store_blocks()

        # the old replica's heartbeats stopped: dropping it leaves the new one in place
        await ingress.deregister(old_url)
        assert ingress.kv_store() == new_address and index.store_blocks() == {"CPU": 2}
        store_members = [m for m in await ingress.workers() if m["role"] == "kvstore"]
        assert [(m["url"], m["kv_store"]) for m in store_members] == [(new_url, new_address)]
        await ingress.deregister(new_url)
        assert ingress.kv_store() is None and index.store_blocks() == {}
    finally:
        await ingress.engine.close()
