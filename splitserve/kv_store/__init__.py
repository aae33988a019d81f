"""The KV store tier (`splitserve kvstore`): a process of its own holding KV blocks by
chained block hash, in RAM with a disk tier below, for engines to offload evicted blocks
to and load a prompt's missing leading blocks from (docs/kv-store.md). Torch-free: a
block's KV is opaque bytes here; the engine side (engine/kv_store_client.py) packs it."""
