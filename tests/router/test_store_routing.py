"""Cache-aware routing with a KV store tier: the router follows the store's KV events
(which tier holds which block) beside the workers' own, and credits a block the store
holds below one in a worker's pool: 0.75 in RAM, 0.25 on disk (Dynamo's weights). A real
store (its server, tiers and event publisher) and a worker's real event publisher, the
router's own event feed, and `Router.pick`."""

from __future__ import annotations

from splitserve.config import KVEventsConfig
from splitserve.kv_store.server import KVStoreServer
from splitserve.kv_store.tiers import TieredStore
from splitserve.kv_store.wire import StoreClient
from splitserve.protocol.generate_request import GenerateRequest
from splitserve.protocol.kv_events import BlockStored
from splitserve.protocol.sampling_params import SamplingParams
from splitserve.router.kv_index import KVBlockIndex, KVEventFeed, KVRoutingWeights
from splitserve.router.load import WorkerLoad
from splitserve.router.routing import Router, RoutingPolicy
from splitserve.router.workers import WorkerPool
from splitserve.runtime.kv_events import KVEventPublisher
from tests.conftest import free_port, wait_until
from tests.kv_store.test_store import BLOCK, PAYLOAD, chain, entry_cost, put

TOKEN = "store-routing-token"
WARM, IDLE = "http://127.0.0.1:1", "http://127.0.0.1:2"  # workers: only their names are used here


def events_config() -> KVEventsConfig:
    return KVEventsConfig(
        endpoint=f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}"
    )


def test_store_held_blocks_are_credited_below_local_ones_by_tier(tmp_path):
    keys = chain(list(range(8 * BLOCK)))  # the prompt's 8 full blocks
    others = chain(list(range(1000, 1000 + 8 * BLOCK)))
    request = GenerateRequest(
        "r",
        tuple(range(8 * BLOCK + 1)),
        SamplingParams(max_tokens=1),
        block_hashes=tuple(k.block_hash.hex() for k in keys),
    )
    store_events, worker_events = events_config(), events_config()
    # RAM holds one chain: a second one demotes the first to disk
    store = TieredStore(8 * entry_cost(), tmp_path / "disk", 32 * (PAYLOAD + 400), record_events=True)
    server = KVStoreServer(store, port=free_port(), token=TOKEN, publisher=KVEventPublisher(store_events))
    writer = StoreClient("127.0.0.1", server.port, TOKEN, timeout_s=5)
    worker = KVEventPublisher(worker_events)
    index = KVBlockIndex()
    feed = KVEventFeed(index, poll_ms=20)
    router = Router(RoutingPolicy.CACHE_AWARE, index, KVRoutingWeights(decode_load_weight=0))
    router.block_sizes.update({WARM: BLOCK, IDLE: BLOCK})
    pool = WorkerPool([], [WARM, IDLE])
    try:
        index.add_store("store")
        feed.watch("store", store_events.endpoint, store_events.replay_endpoint)
        feed.watch(WARM, worker_events.endpoint, worker_events.replay_endpoint)
        # WARM holds the whole prompt, but 4 blocks of prompts are queued for prefill there
        tokens = [t for k in keys for t in k.token_ids]
        worker.publish([BlockStored([k.block_hash for k in keys], None, tokens, BLOCK, medium="CPU")])
        router.loads.report(WARM, WorkerLoad(4 * BLOCK, 0), router.loads.clock())
        assert wait_until(lambda: index.matched_blocks(WARM, [k.block_hash for k in keys]) == 8)
        # no store: IDLE would compute 8 blocks (cost 8), WARM waits for 4 (cost 4)
        assert router.pick(pool, "decode", request).url == WARM

        put(writer, keys)  # the store holds the prompt in RAM: IDLE loads it (8 - 8 x 0.75 = 2)
        assert wait_until(lambda: index.store_blocks() == {"CPU": 8})
        assert router.pick(pool, "decode", request).url == IDLE

        put(writer, others)  # demoted to disk: loading it is worth less (8 - 8 x 0.25 = 6)
        assert wait_until(lambda: index.store_blocks() == {"CPU": 8, "DISK": 8})
        assert router.pick(pool, "decode", request).url == WARM

        # the store's blocks count only past a worker's own run, and only as a leading run:
        # another tenant's hashes (cache_salt) find nothing of it
        salted = chain(list(range(8 * BLOCK)), salt="tenant-b")
        other_tenant = GenerateRequest(
            "s",
            request.token_ids,
            request.sampling_params,
            block_hashes=tuple(k.block_hash.hex() for k in salted),
        )
        weights = router.weights.store_credits
        assert index.store_credit([k.block_hash for k in salted], 0, weights) == 0
        assert index.store_credit([k.block_hash for k in keys], 2, weights) == 6 * 0.25
        assert router.pick(pool, "decode", other_tenant).url == IDLE  # nobody holds it: the idle one
    finally:
        feed.close()
        worker.shutdown()
        writer.close()
        server.close()
