"""The KV store's tiers and server, through their public surface: StoreClient against a
KVStoreServer over 127.0.0.1, the CLI process for /metrics and authentication."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from splitserve.config import KVEventsConfig
from splitserve.kv_store.entry import ENTRY_OVERHEAD_BYTES, StoreEntry
from splitserve.kv_store.server import KVStoreServer
from splitserve.kv_store.tiers import TieredStore
from splitserve.kv_store.wire import BlockKey, StoreClient, StoreError
from splitserve.protocol.block_hash import compute_block_hashes
from splitserve.protocol.kv_events import AllBlocksCleared, BlockStored
from splitserve.runtime.kv_events import KVEventPublisher, KVEventSubscriber
from tests.conftest import free_port, running_server, wait_until

BLOCK = 4
TOKEN = "store-test-token"
PAYLOAD = 1000  # bytes of KV per test block


def chain(tokens: list[int], salt: str | None = None) -> list[BlockKey]:
    """The keys of every full block of `tokens`, hashed as the engine hashes them."""
    hashes = compute_block_hashes(tokens, BLOCK, cache_salt=salt)
    return [
        BlockKey(h, hashes[i - 1] if i else None, tuple(tokens[i * BLOCK : (i + 1) * BLOCK]))
        for i, h in enumerate(hashes)
    ]


def payload(key: BlockKey) -> bytes:
    """A block's bytes, different for every block (so a wrong block shows)."""
    return (key.block_hash * (PAYLOAD // len(key.block_hash) + 1))[:PAYLOAD]


def entry_cost() -> int:
    return PAYLOAD + 8 * BLOCK + ENTRY_OVERHEAD_BYTES


@pytest.fixture
def served(tmp_path):
    """A store of 3 blocks of RAM over 4 blocks of disk, served with a token; its client."""
    disk_file_bytes = PAYLOAD + 400  # a block's file: payload, header, digest
    store = TieredStore(3 * entry_cost(), tmp_path / "disk", 4 * disk_file_bytes)
    server = KVStoreServer(store, port=free_port(), token=TOKEN)
    client = StoreClient("127.0.0.1", server.port, TOKEN, timeout_s=5)
    try:
        yield store, server, client
    finally:
        client.close()
        server.close()


def put(client: StoreClient, keys: list[BlockKey]) -> int:
    return client.put([(key, {"dtype": "uint8", "n": i}, payload(key)) for i, key in enumerate(keys)])


def test_put_get_round_trip(served):
    _, _, client = served
    keys = chain(list(range(100, 112)))  # 3 blocks
    assert put(client, keys) == 3
    assert client.has(keys) == 3
    got = client.get(keys)
    assert [b.payload for b in got] == [payload(k) for k in keys]
    assert [b.key for b in got] == keys  # what the store holds, for the engine to check again
    assert [b.meta["n"] for b in got] == [0, 1, 2]
    assert {b.tier for b in got} == {"ram"}
    # a prompt that shares two blocks and then differs finds the two leading ones only
    other = chain([*range(100, 108), 7, 7, 7, 7])
    assert client.has(other) == 2
    assert len(client.get(other)) == 2
    # the same tokens under another cache_salt are other hashes: nothing found
    assert client.get(chain(list(range(100, 112)), salt="tenant-b")) == []


def test_lru_order_and_ram_to_disk_demotion(served):
    store, _, client = served
    keys = chain(list(range(24)))  # 6 blocks; RAM holds 3
    put(client, keys[:3])
    assert client.get(keys[:1])  # block 0 is now the most recently used
    put(client, keys[3:4])  # pushes out the least recent: block 1
    assert [store.tier_of(k.block_hash) for k in keys[:4]] == ["ram", "disk", "ram", "ram"]
    put(client, keys[4:6])  # pushes out block 2, then block 0
    assert [store.tier_of(k.block_hash) for k in keys] == ["disk", "disk", "disk", "ram", "ram", "ram"]
    # a disk hit comes back whole and moves up to RAM (pushing the least recent RAM block down)
    (_, meta, data, tier), *_ = client.get(keys[1:2])
    assert (data, tier, meta["n"]) == (payload(keys[1]), "disk", 1)
    assert store.tier_of(keys[1].block_hash) == "ram"
    assert store.tier_of(keys[3].block_hash) == "disk"
    stats = store.snapshot()
    assert stats.tiers["disk"].hits == 1 and stats.tiers["ram"].evictions == 4
    assert stats.tiers["ram"].blocks == 3 and stats.tiers["disk"].blocks == 3
    # the disk budget (4 files) pushes out its least recent file
    put(client, chain(list(range(1000, 1008))))
    assert store.snapshot().tiers["disk"].blocks == 4
    put(client, chain(list(range(2000, 2008))))
    assert store.snapshot().tiers["disk"].blocks == 4
    assert store.tier_of(keys[0].block_hash) is None  # the least recent disk entry went


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_or_truncated_disk_entry_is_a_miss(served, damage):
    store, _, client = served
    keys = chain(list(range(16)))  # 4 blocks: block 0 goes to disk
    put(client, keys)
    assert store.tier_of(keys[0].block_hash) == "disk"
    path = store.disk.path(keys[0].block_hash)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01  # one bit of the payload
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(bytes(data[: len(data) - 10]))
    assert client.get(keys) == []  # the leading block is gone: nothing after it is of use
    assert not path.exists()
    assert store.snapshot().corrupt == 1
    assert client.get(keys[1:2])[0].payload == payload(keys[1])  # the rest still serves


def test_disk_tier_survives_a_restart(tmp_path):
    keys = chain(list(range(12)))
    store = TieredStore(entry_cost(), tmp_path / "disk", 10 * (PAYLOAD + 400))
    for key in keys:
        store.put(StoreEntry(*key, {}, payload(key)))
    assert [store.tier_of(k.block_hash) for k in keys] == ["disk", "disk", "ram"]
    (tmp_path / "disk" / "half-written.tmp").write_bytes(b"x")
    again = TieredStore(entry_cost(), tmp_path / "disk", 10 * (PAYLOAD + 400))
    assert [again.tier_of(k.block_hash) for k in keys] == ["disk", "disk", None]
    assert again.get(*keys[0]).payload == payload(keys[0])
    assert not (tmp_path / "disk" / "half-written.tmp").exists()


def test_wrong_token_ids_or_parent_for_a_hash_is_a_miss(served):
    store, _, client = served
    key = chain(list(range(50, 54)))[0]
    assert put(client, [key]) == 1
    wrong_tokens = BlockKey(key.block_hash, None, (50, 51, 52, 99))
    wrong_parent = BlockKey(key.block_hash, b"\x01" * 16, key.token_ids)
    assert client.has([wrong_tokens]) == 0 and client.get([wrong_tokens]) == []
    assert client.get([wrong_parent]) == []
    assert store.snapshot().mismatches == 2
    assert client.get([key])[0].payload == payload(key)


def test_unauthenticated_client_is_refused(served):
    store, server, client = served
    key = chain(list(range(4)))[0]
    for token in (None, "another-deployment"):
        stranger = StoreClient("127.0.0.1", server.port, token, timeout_s=5)
        try:
            with pytest.raises(StoreError, match="unauthorized"):
                put(stranger, [key])
            with pytest.raises(StoreError, match="unauthorized"):
                stranger.get([key])
        finally:
            stranger.close()
    assert store.tier_of(key.block_hash) is None and server.refused >= 4
    assert put(client, [key]) == 1  # the deployment's own client still works


def test_a_restarted_store_costs_only_hits(tmp_path):
    port = free_port()
    key = chain(list(range(4)))[0]
    server = KVStoreServer(TieredStore(10 * entry_cost()), port=port, token=TOKEN)
    client = StoreClient("127.0.0.1", port, TOKEN, timeout_s=5)
    try:
        assert put(client, [key]) == 1
        server.close()
        server = KVStoreServer(TieredStore(10 * entry_cost()), port=port, token=TOKEN)
        assert client.get([key]) == []  # a new session, said again once: a miss, no error
        assert put(client, [key]) == 1 and client.has([key]) == 1
    finally:
        client.close()
        server.close()


def test_store_down_is_an_error_within_the_timeout():
    client = StoreClient("127.0.0.1", free_port(), TOKEN, timeout_s=0.3)
    try:
        with pytest.raises(StoreError, match="did not answer"):
            client.has(chain(list(range(4))))
    finally:
        client.close()


def test_bad_requests_get_a_clear_error(served):
    _, server, client = served
    with pytest.raises(StoreError, match="bad request"):
        client.request(b"GET", {"blocks": [{"hash": "zz", "parent": None, "tokens": [1]}]})
    with pytest.raises(StoreError, match="bad request"):
        client.request(b"PUT", {"blocks": [chain([1, 2, 3, 4])[0].to_wire()]}, [])
    with pytest.raises(StoreError, match="bad request"):
        client.request(b"NOPE", {"blocks": []})
    assert server.bad_requests == 3
    assert client.has(chain([1, 2, 3, 4])) == 0  # still serving


def test_kvstore_process_metrics_per_tier(tmp_path):
    """`splitserve kvstore` end to end (an open loopback store: no token, as the shared
    AccessGuard tested elsewhere would want one for /health too): blocks over its port,
    bytes and hits per tier on /metrics."""
    http_port, kv_port = free_port(), free_port()
    args = [
        "kvstore",
        "--port", str(http_port),
        "--kv-port", str(kv_port),
        "--kv-store-ram-gb", str(2 * entry_cost() / 2**30),
        "--kv-store-disk", str(tmp_path / "disk"),
        "--kv-store-disk-gb", "0.001",
        "--log-level", "warning",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "SPLITSERVE_INTERNAL_TOKEN"}
    with running_server(args, http_port, env=env) as base:
        client = StoreClient("127.0.0.1", kv_port, None, timeout_s=5)
        try:
            keys = chain(list(range(12)))
            assert put(client, keys) == 3  # one block demoted to disk
            assert len(client.get(keys)) == 3  # two RAM hits, then the disk one
        finally:
            client.close()
        text = httpx.get(base + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values['splitserve_kv_store_hits_total{tier="ram"}'] == 2
    assert values['splitserve_kv_store_hits_total{tier="disk"}'] == 1
    assert values['splitserve_kv_store_hit_bytes_total{tier="disk"}'] == PAYLOAD
    assert values['splitserve_kv_store_blocks{tier="disk"}'] == 1
    assert values['splitserve_kv_store_bytes{tier="ram"}'] == 2 * entry_cost()
    assert values["splitserve_kv_store_puts_total"] == 3


def test_kvstore_cli_refuses_bad_flags(tmp_path):
    for flags in (["--kv-store-ram-gb", "-1"], ["--kv-store-disk", str(tmp_path)]):
        finished = subprocess.run(
            [sys.executable, "-m", "splitserve.cli", "kvstore", *flags], capture_output=True, text=True
        )
        assert finished.returncode != 0
        assert "kv-store" in finished.stderr


def test_kv_events_name_the_tier_that_holds_a_block(tmp_path):
    """With events, the store says which tier holds what (vLLM's `medium`): CPU for RAM,
    DISK for disk; a demotion is a removal from one and a store into the other."""
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    store = TieredStore(2 * entry_cost(), tmp_path / "disk", 10 * (PAYLOAD + 400), record_events=True)
    publisher = KVEventPublisher(KVEventsConfig(endpoint=events, replay_endpoint=replay))
    server = KVStoreServer(store, port=free_port(), token=TOKEN, publisher=publisher)
    client = StoreClient("127.0.0.1", server.port, TOKEN, timeout_s=5)
    subscriber = KVEventSubscriber(events, replay)
    keys = chain(list(range(12)))  # 3 blocks, RAM holds 2
    index = {key.block_hash: i for i, key in enumerate(keys)}
    try:
        put(client, keys)
        client.get(keys[:1])  # block 0 comes back up from disk, block 1 goes down
        seen: list = []

        def moves() -> list:
            seen.extend(e for _, batch in subscriber.poll(100) for e in batch.events)
            return [
                (
                    type(e).__name__,
                    e.medium,
                    [index[h] for h in e.block_hashes],
                )
                for e in seen
                if not isinstance(e, AllBlocksCleared)
            ]

        expected = [
            ("BlockStored", "CPU", [0]),
            ("BlockStored", "CPU", [1]),
            ("BlockStored", "CPU", [2]),
            ("BlockRemoved", "CPU", [0]),
            ("BlockStored", "DISK", [0]),
            ("BlockRemoved", "DISK", [0]),
            ("BlockStored", "CPU", [0]),
            ("BlockRemoved", "CPU", [1]),
            ("BlockStored", "DISK", [1]),
        ]
        assert wait_until(lambda: moves() == expected), moves()
        stored = [e for e in seen if isinstance(e, BlockStored)]
        assert stored[0].token_ids == list(keys[0].token_ids) and stored[0].parent_block_hash is None
        assert stored[1].parent_block_hash == keys[0].block_hash and stored[1].block_size == BLOCK
    finally:
        subscriber.close()
        client.close()
        server.close()


def test_the_store_needs_neither_torch_nor_the_engine():
    """`splitserve kvstore` runs on a CPU-only host: its package imports no torch, engine
    or model (a block's KV is opaque bytes to it)."""
    code = (
        "import sys, pkgutil, importlib, splitserve.kv_store as pkg\n"
        "for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "    importlib.import_module(m.name)\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.split('.')[:2] in "
        "(['splitserve', 'engine'], ['splitserve', 'model']))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
