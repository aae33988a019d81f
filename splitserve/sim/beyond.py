"""What the seed's simulator leaves out, one thing at a time (`splitserve sim beyond`, and the
realistic preset `reproduce` checks against the guide)."""

from __future__ import annotations

from dataclasses import replace

from splitserve.sim.cmd_common import REALISTIC_EFFICIENCY
from splitserve.sim.deployment import Deployment


def beyond_variants(base: Deployment) -> list[tuple[str, Deployment]]:
    """The seed's simulator, then each thing it leaves out, then all of them together: the
    realistic preset, with its efficiencies re-anchored on the guide (cmd_common)."""
    multi = replace(base.sched, prompts_per_step=None)
    small = replace(base.eff, small_chunk_tokens=REALISTIC_EFFICIENCY.small_chunk_tokens)
    slow_kv = replace(base.eff, kv_bandwidth=REALISTIC_EFFICIENCY.kv_bandwidth)
    return [
        ("seed's model", base),
        ("+ per-kernel step time", replace(base, combine="sum")),
        ("+ several prompts per step", replace(base, sched=multi)),
        ("+ KV memory limit", replace(base, kv_limit=True)),
        ("+ least-loaded routing", replace(base, routing="least_loaded")),
        ("+ small-chunk efficiency", replace(base, eff=small)),
        (f"+ KV reads at {REALISTIC_EFFICIENCY.kv_bandwidth:.0%} of bandwidth", replace(base, eff=slow_kv)),
        (
            "all of the above (realistic preset)",
            replace(
                base,
                combine="sum",
                sched=multi,
                kv_limit=True,
                routing="least_loaded",
                eff=replace(REALISTIC_EFFICIENCY, compute=base.eff.compute),
            ),
        ),
    ]
