"""Hybrid models (Nemotron-H: Mamba2 + attention + MLP/MoE layers): a Mamba2 mixer's geometry,
its fixed per-request state, its weights and FLOPs, and the layer pattern of a config.

An attention layer remembers the past as per-token KV; a Mamba2 layer as a fixed-size state,
the same however long the sequence: the recurrent SSM state (heads x head_dim x state, kept
in float32) and the causal convolution's last `conv_kernel - 1` inputs (in the model's
dtype). A P/D handoff ships that state whole, as of the prompt's end.
"""

from __future__ import annotations

from dataclasses import dataclass

# One character per layer, as Nemotron-H's `hybrid_override_pattern`.
MAMBA, ATTENTION, MLP, MOE = "M", "*", "-", "E"
# transformers' `layers_block_type` names (older and newer spellings) -> pattern characters
_BLOCK_TYPES = {
    "mamba": MAMBA,
    "linear_attention": MAMBA,
    "attention": ATTENTION,
    "full_attention": ATTENTION,
    "mlp": MLP,
    "moe": MOE,
}
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class MambaSpec:
    """One Mamba2 mixer. B and C are shared within each of `groups` groups of heads."""

    heads: int
    head_dim: int
    state: int  # ssm_state_size
    groups: int
    conv_kernel: int = 4
    ssm_dtype_bytes: int = 4  # the recurrent state in float32 (transformers' and vLLM's default)

    def __post_init__(self) -> None:
        if min(self.heads, self.head_dim, self.state, self.conv_kernel, self.ssm_dtype_bytes) < 1:
            raise ValueError("Mamba sizes must be positive")
        if self.groups < 0:
            raise ValueError("Mamba groups must be >= 0")

    @property
    def inner(self) -> int:
        """The mixer's inner width (x channels): heads x head_dim."""
        return self.heads * self.head_dim

    def _groups_per_rank(self, tp: int) -> int:
        # fewer groups than ranks: each rank keeps a copy of its heads' group (as vLLM does)
        return max(1, self.groups // tp) if self.groups else 0

    def conv_channels(self, tp: int = 1) -> int:
        """Channels the causal convolution runs over on one of `tp` ranks: x, then B and C."""
        return self.inner // tp + 2 * self._groups_per_rank(tp) * self.state

    def ssm_state_bytes(self, tp: int = 1) -> int:
        return (self.heads // tp) * self.head_dim * self.state * self.ssm_dtype_bytes

    def conv_state_bytes(self, dtype_bytes: int, tp: int = 1) -> int:
        return (self.conv_kernel - 1) * self.conv_channels(tp) * dtype_bytes

    def state_bytes(self, dtype_bytes: int, tp: int = 1) -> int:
        """One layer's state for one request on one of `tp` ranks (fixed, whatever the length)."""
        return self.ssm_state_bytes(tp) + self.conv_state_bytes(dtype_bytes, tp)

    def params(self, hidden: int) -> int:
        """Weight matrices: the input projection (z, x, B, C and dt), the convolution, the output."""
        in_proj = hidden * (2 * self.inner + 2 * self.groups * self.state + self.heads)
        return in_proj + self.conv_channels() * self.conv_kernel + self.inner * hidden

    @property
    def scan_flops_per_token(self) -> int:
        """The recurrence per token, beyond the projections: decay the state (1 FLOP per
        element), add dt * x outer B (2) and read it out against C (2)."""
        return 5 * self.inner * self.state


def check_pattern(pattern: str, layers: int) -> None:
    if len(pattern) != layers:
        raise ValueError(f"layer pattern {pattern!r} has {len(pattern)} layers, not {layers}")
    bad = set(pattern) - {MAMBA, ATTENTION, MLP, MOE}
    if bad:
        raise ValueError(f"layer pattern {pattern!r}: unknown layer kinds {''.join(sorted(bad))!r} (M * - E)")


def hybrid_from_hf_config(cfg: dict, model_dtype_bytes: int) -> tuple[str, MambaSpec | None] | None:
    """The layer pattern and Mamba geometry of a Nemotron-H config (`hybrid_override_pattern`,
    or transformers' `layers_block_type` list); None for a config that is not hybrid."""
    pattern = cfg.get("hybrid_override_pattern")
    if pattern is None and isinstance(cfg.get("layers_block_type"), list):
        try:
            pattern = "".join(_BLOCK_TYPES[str(kind)] for kind in cfg["layers_block_type"])
        except KeyError as exc:
            raise ValueError(f"config.json: unknown layers_block_type entry {exc}") from exc
    if pattern is None:
        return None
    pattern = str(pattern)
    if MAMBA not in pattern:
        return pattern, None
    try:
        mamba = MambaSpec(
            heads=int(cfg["mamba_num_heads"]),
            head_dim=int(cfg["mamba_head_dim"]),
            state=int(cfg["ssm_state_size"]),
            groups=int(cfg.get("n_groups", cfg.get("mamba_n_groups", 1))),
            conv_kernel=int(cfg.get("conv_kernel", cfg.get("mamba_d_conv", 4))),
            ssm_dtype_bytes=_DTYPE_BYTES.get(
                str(cfg.get("mamba_ssm_cache_dtype", "float32")), model_dtype_bytes
            ),
        )
    except KeyError as exc:
        raise ValueError(f"config.json: a hybrid model's Mamba layers need {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config.json: bad Mamba geometry ({exc})") from exc
    return pattern, mamba
