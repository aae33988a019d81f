"""The fixed latency of an MoE dispatch (tokens out to their experts' ranks) and combine (the
experts' outputs back) among N ranks, from published low-latency kernel benchmarks: what each
measured time holds beyond its bytes at the link's bandwidth, the part a faster link does not
shrink. `sim afd` charges it per dispatch and combine (EP) and per send and receive (AFD)."""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

TRANSFER_LATENCY_S = 20e-6  # fixed cost of one transfer between chips (launch, sync)


class AllToAllPoint(NamedTuple):
    """One row of a published dispatch/combine benchmark: ranks and the time of each."""

    ranks: int
    dispatch_s: float
    combine_s: float


class AllToAllLatency(NamedTuple):
    dispatch_s: float
    combine_s: float


# DeepEP's low-latency kernels (deepseek-ai/DeepEP, docs/legacy.md, "Low-latency kernels with
# pure RDMA"): H800, one CX7 400 Gb/s NIC each (~50 GB/s), 128 tokens per rank, hidden 7168,
# top-8 experts, FP8 dispatch, BF16 combine.
DEEPEP_LOW_LATENCY = (
    AllToAllPoint(8, 77e-6, 114e-6),
    AllToAllPoint(16, 118e-6, 195e-6),
    AllToAllPoint(32, 155e-6, 273e-6),
    AllToAllPoint(64, 173e-6, 314e-6),
    AllToAllPoint(128, 192e-6, 369e-6),
    AllToAllPoint(256, 194e-6, 360e-6),
)
DEEPEP_NIC_BW = 50e9  # bytes/s, the README's "~50 GB/s maximum bandwidth" of a CX7
DEEPEP_TOKENS, DEEPEP_HIDDEN, DEEPEP_TOPK = 128, 7168, 8
# what one token copy carries: FP8 values and one fp32 scale per 128 (dispatch), bf16 (combine)
DEEPEP_DISPATCH_BYTES = DEEPEP_HIDDEN + 4 * DEEPEP_HIDDEN // 128
DEEPEP_COMBINE_BYTES = 2 * DEEPEP_HIDDEN

# DeepEP-Ascend's low-latency kernels (sgl-project/sgl-kernel-npu, README.md, "Low-Latency
# Kernels with Pure HCCS"): Atlas A3 384 SuperPoD (Ascend 910C), 128 tokens per rank, hidden
# 7168, top-8, INT8 dispatch, BF16 combine; published for 8, 16 and 32 ranks only.
ASCEND_LOW_LATENCY = (
    AllToAllPoint(8, 132e-6, 126e-6),
    AllToAllPoint(16, 139e-6, 135e-6),
    AllToAllPoint(32, 153e-6, 151e-6),
)
# the same README's normal kernels (4,096 tokens per rank: bandwidth-bound) at the same ranks:
# the HCCS bandwidth a dispatch and a combine reach once their fixed cost is amortized, bytes/s
ASCEND_HCCS_BW = {8: (146e9, 125e9), 16: (107e9, 103e9), 32: (102e9, 95e9)}
ASCEND_DISPATCH_BYTES = DEEPEP_HIDDEN  # INT8 values (a per-token scale is 4 bytes: left out)

# the sources `sim afd --all-to-all-latency` takes (`fixed`: TRANSFER_LATENCY_S whatever the ranks)
ALL_TO_ALL_LATENCY = ("deepep", "ascend", "fixed")


def deepep_fixed_latency(point: AllToAllPoint) -> AllToAllLatency:
    """What a DeepEP low-latency dispatch and combine take beyond their bytes at the NIC's
    bandwidth (each rank sends every token to its top-8 experts' ranks): the part that does not
    shrink with a faster link. Below 64 ranks the measured time is under the NIC time (part of
    the traffic stays on the rank or its node), so there is nothing left: 0."""
    copies = DEEPEP_TOKENS * DEEPEP_TOPK
    return AllToAllLatency(
        max(0.0, point.dispatch_s - copies * DEEPEP_DISPATCH_BYTES / DEEPEP_NIC_BW),
        max(0.0, point.combine_s - copies * DEEPEP_COMBINE_BYTES / DEEPEP_NIC_BW),
    )


def ascend_fixed_latency(point: AllToAllPoint) -> AllToAllLatency:
    """What a DeepEP-Ascend low-latency dispatch and combine take beyond their bytes at the
    HCCS bandwidth the normal kernels reach at the same ranks. Dispatch keeps 70-82 us (its
    INT8 quantization and the token counts exchanged before the data); combine's measured time
    is its bytes (its 0-9 us left fall to the TRANSFER_LATENCY_S floor)."""
    copies = DEEPEP_TOKENS * DEEPEP_TOPK
    dispatch_bw, combine_bw = ASCEND_HCCS_BW[point.ranks]
    return AllToAllLatency(
        max(0.0, point.dispatch_s - copies * ASCEND_DISPATCH_BYTES / dispatch_bw),
        max(0.0, point.combine_s - copies * DEEPEP_COMBINE_BYTES / combine_bw),
    )


def all_to_all_latency_s(ranks: int, source: str = "deepep") -> AllToAllLatency:
    """The fixed latency of one dispatch and one combine over `ranks` ranks: DeepEP's (see
    deepep_fixed_latency) or DeepEP-Ascend's (see ascend_fixed_latency), interpolated in log2
    of the ranks and held beyond the table's ends, and never under TRANSFER_LATENCY_S (a
    transfer's launch and sync). DeepEP at 64 ranks: 21 and 20 us, about what
    TRANSFER_LATENCY_S already charges; at 128-256, 40-75 us. DeepEP-Ascend: 70-81 us and the
    20 us floor (held at 32 ranks' beyond them)."""
    if source == "ascend":
        points = [(math.log2(p.ranks), ascend_fixed_latency(p)) for p in ASCEND_LOW_LATENCY]
    elif source == "deepep":
        points = [(math.log2(p.ranks), deepep_fixed_latency(p)) for p in DEEPEP_LOW_LATENCY]
    else:
        raise ValueError(f"no published all-to-all latency named {source!r}")
    x = math.log2(max(ranks, 1))
    if x <= points[0][0]:
        lat = points[0][1]
    elif x >= points[-1][0]:
        lat = points[-1][1]
    else:
        (x0, a), (x1, b) = next((p, q) for p, q in itertools.pairwise(points) if x <= q[0])
        w = (x - x0) / (x1 - x0)
        lat = AllToAllLatency(*(u + w * (v - u) for u, v in zip(a, b, strict=True)))
    return AllToAllLatency(*(max(TRANSFER_LATENCY_S, t) for t in lat))
