"""splitserve's tiers as a Ray Serve application (`splitserve up --ray`, docs/ray.md).

One Serve deployment per tier (render, prefill, decode); each replica runs the tier's own
server (`splitserve render` / `splitserve engine`) as a child process on its node and
registers it with the ingress, which hosts the P/D proxy in process. Nothing here imports
ray at module level: `ray` is the optional `splitserve[ray]` extra.
"""
