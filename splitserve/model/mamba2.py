"""The Mamba2 mixer of hybrid models (Nemotron-H), over per-request state slots.

A Mamba layer remembers the past as a fixed-size state per request instead of per-token
KV: the last `conv_kernel - 1` inputs of its causal depthwise convolution and the SSM
state [heads, head_dim, state_size] (float32). The engine keeps both in slots of a state
pool (splitserve/engine/state_pool.py); a step's decode-like rows (one token each) run the
single-step recurrence batched over their slots, each prefill chunk the chunked scan (SSD)
from its slot's state, which it leaves as of the chunk's last token (so chunked prefill
carries it across chunks). A prefill chunk can also leave copies of the state at given
offsets inside it (the block boundaries it crosses: prefix-cache snapshots).

Numerics follow transformers' PyTorch path (`modeling_nemotron_h.py`): projections in the
model dtype, convolution in the weight dtype, scan and recurrence in float32. One quirk is
kept on purpose: transformers clamps dt from below at `time_step_min` in the scan (its
prompt pass) but not in the recurrence (its generated tokens). Each token here carries
that floor (`MambaMetadata.dt_floor`: time_step_min for prompt tokens, 0 for generated
ones), so a generated token recomputed by a prefill after preemption, or a one-token prompt
run as a decode row, computes what transformers computed for it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.model.linear import Linear


class MambaShape(NamedTuple):
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    time_step_min: float
    use_conv_bias: bool
    use_bias: bool
    norm_eps: float

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.n_groups * self.state_size


class MambaPrefill(NamedTuple):
    token_start: int  # offset in the flattened step
    num_tokens: int
    slot: int  # the request's state slot
    # (offset in the chunk, capture row): the state before the chunk's token at that offset
    # (0 < offset < num_tokens) is copied to the metadata's capture rows (prefix snapshots)
    captures: tuple[tuple[int, int], ...] = ()


class MambaMetadata(NamedTuple):
    """Built once per step, read by every Mamba layer. Rows are ordered as the attention
    metadata's: decode-like rows first, then the prefill chunks."""

    num_decode_tokens: int
    decode_slots: torch.Tensor  # int64 [num_decode_tokens]
    prefills: list[MambaPrefill]
    dt_floor: torch.Tensor  # float32 [tokens]: time_step_min for prompt tokens, else 0
    conv_states: torch.Tensor  # [slots, mamba_layers, conv_dim, conv_kernel - 1]
    ssm_states: torch.Tensor  # float32 [slots, mamba_layers, heads, head_dim, state_size]
    capture_conv: torch.Tensor | None = None  # [captures, mamba_layers, conv_dim, conv_kernel - 1]
    capture_ssm: torch.Tensor | None = None  # float32 [captures, mamba_layers, heads, head_dim, state]


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: out[..., i, j] = sum(x[..., j+1 : i+1]) for j <= i, else -inf."""
    length = x.size(-1)
    x = x[..., None].expand(*x.size(), length)
    below = torch.tril(torch.ones(length, length, device=x.device, dtype=torch.bool), diagonal=-1)
    x = x.masked_fill(~below, 0)
    sums = torch.cumsum(x, dim=-2)
    on_or_below = torch.tril(torch.ones(length, length, device=x.device, dtype=torch.bool), diagonal=0)
    return sums.masked_fill(~on_or_below, -torch.inf)


def chunk_scan(
    x: torch.Tensor,  # [T, heads, head_dim]
    dt: torch.Tensor,  # [T, heads], softplus(dt + dt_bias) and floored already
    A: torch.Tensor,  # float32 [heads]
    B: torch.Tensor,  # [T, groups, state]
    C: torch.Tensor,  # [T, groups, state]
    D: torch.Tensor,  # [heads]
    initial_state: torch.Tensor,  # float32 [heads, head_dim, state]
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's SSD scan (transformers' `mamba2_chunk_scan`, batch of one): the
    output float32 [T, heads, head_dim] and the state after the last token."""
    length, heads, _ = x.shape
    groups = B.shape[1]
    x = x.float()
    B = B.float().repeat_interleave(heads // groups, dim=1, output_size=heads)
    C = C.float().repeat_interleave(heads // groups, dim=1, output_size=heads)
    pad = (chunk_size - length % chunk_size) % chunk_size
    d_residual = D[:, None] * F.pad(x, (0, 0, 0, 0, 0, pad))
    x = x * dt[..., None].float()
    A = A.to(x.dtype) * dt.float()

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [T, ...] -> [1, chunks, chunk_size, ...]
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return t.reshape(1, -1, chunk_size, *t.shape[1:])

    x, A, B, C = chunks(x), chunks(A), chunks(B), chunks(C)
    A = A.permute(0, 3, 1, 2)  # [1, heads, chunks, chunk_size]
    A_cumsum = torch.cumsum(A, dim=-1)
    # within each chunk (the diagonal blocks)
    L = torch.exp(segment_sum(A))
    G = torch.einsum("bclhn,bcshn->bclsh", C, B)
    M = G * L.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", M, x)
    # each chunk's own contribution to the state at its end
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    B_decay = B * decay_states.permute(0, -2, -1, 1)[..., None]
    states = torch.einsum("bclhn,bclhp->bchpn", B_decay, x)
    # the recurrence across chunks, from the initial state
    states = torch.cat([initial_state[None, None].to(states.dtype), states], dim=1)
    decay_chunk = torch.exp(segment_sum(F.pad(A_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)
    states, final_state = new_states[:, :-1], new_states[:, -1]
    # each chunk's start state read out at its positions
    C_times_states = torch.einsum("bclhn,bchpn->bclhp", C, states)
    y_off = C_times_states * torch.exp(A_cumsum).permute(0, 2, 3, 1)[..., None]
    y = (y_diag + y_off).contiguous().reshape(-1, heads, x.shape[-1]) + d_residual
    return y[:length], final_state[0]


def recurrence_step(
    state: torch.Tensor,  # float32 [rows, heads, head_dim, state], updated in place
    x: torch.Tensor,  # [rows, heads, head_dim]
    dt: torch.Tensor,  # [rows, heads], softplus(dt + dt_bias) and floored already
    A: torch.Tensor,  # float32 [heads]
    B: torch.Tensor,  # [rows, groups, state]
    C: torch.Tensor,  # [rows, groups, state]
    D: torch.Tensor,  # [heads]
) -> torch.Tensor:
    """One token per row (transformers' `mamba2_selective_state_update`): the output
    [rows, heads, head_dim] in x's dtype."""
    rows, heads, head_dim = x.shape
    repeat = heads // B.shape[1]
    dt = dt[..., None].expand(-1, -1, head_dim)  # [rows, heads, head_dim]
    dA = torch.exp(dt.float()[..., None] * A.float()[None, :, None, None])
    B = B.repeat_interleave(repeat, dim=1, output_size=heads)[:, :, None, :]  # [rows, heads, 1, state]
    C = C.repeat_interleave(repeat, dim=1, output_size=heads)  # [rows, heads, state]
    dBx = dt[..., None] * B * x[..., None]
    new_state = state * dA + dBx
    state.copy_(new_state.to(state.dtype))
    out = torch.bmm(
        new_state.to(C.dtype).view(rows * heads, head_dim, -1), C.reshape(rows * heads, -1, 1)
    ).view(rows, heads, head_dim)
    out = out + x * D[:, None]
    return out.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm over groups of channels of y * silu(gate) (transformers' NemotronHRMSNormGated)."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        y = y.float() * F.silu(gate.float())
        grouped = y.view(y.shape[0], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.view_as(y).to(dtype)


class Mamba2Mixer(nn.Module):
    """in_proj -> causal conv + SiLU -> selective scan -> gated RMSNorm -> out_proj."""

    def __init__(self, hidden_size: int, shape: MambaShape, layer_index: int) -> None:
        super().__init__()
        self.shape = shape
        self.layer_index = layer_index  # which Mamba layer: its index in the state slots
        s = shape
        self.in_proj = Linear(hidden_size, s.intermediate + s.conv_dim + s.num_heads, bias=s.use_bias)
        self.conv1d = nn.Conv1d(
            s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=s.use_conv_bias
        )
        self.dt_bias = nn.Parameter(torch.empty(s.num_heads))
        self.A_log = nn.Parameter(torch.empty(s.num_heads))
        self.D = nn.Parameter(torch.empty(s.num_heads))
        self.norm = GatedRMSNorm(s.intermediate, s.intermediate // s.n_groups, s.norm_eps)
        self.out_proj = Linear(s.intermediate, hidden_size, bias=s.use_bias)

    def forward(self, hidden: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        s = self.shape
        num_tokens = hidden.shape[0]
        gate, xbc, dt = self.in_proj(hidden).split([s.intermediate, s.conv_dim, s.num_heads], dim=-1)
        dt = torch.maximum(F.softplus(dt + self.dt_bias.to(dt.dtype)), meta.dt_floor[:, None].to(dt.dtype))
        A = -torch.exp(self.A_log.float())
        conv_layer = meta.conv_states[:, self.layer_index]
        ssm_layer = meta.ssm_states[:, self.layer_index]
        weight = self.conv1d.weight  # [conv_dim, 1, kernel]
        y = torch.empty(num_tokens, s.num_heads, s.head_dim, dtype=torch.float32, device=hidden.device)
        decodes = meta.num_decode_tokens
        if decodes:
            slots = meta.decode_slots
            window = torch.cat([conv_layer[slots], xbc[:decodes, :, None].to(conv_layer.dtype)], dim=-1)
            conv_layer[slots] = window[:, :, 1:]
            conv = F.conv1d(window.to(weight.dtype), weight, self.conv1d.bias, groups=s.conv_dim)
            x, B, C = self.split_conv_output(F.silu(conv[:, :, -1]).to(hidden.dtype))
            state = ssm_layer[slots]
            y[:decodes] = recurrence_step(
                state, x.view(decodes, s.num_heads, s.head_dim), dt[:decodes], A, B, C, self.D
            ).float()
            ssm_layer[slots] = state
        for chunk in meta.prefills:
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            window = torch.cat([conv_layer[chunk.slot], xbc[rows].t().to(conv_layer.dtype)], dim=-1)
            conv_layer[chunk.slot] = window[:, -(s.conv_kernel - 1) :]
            conv = F.conv1d(window[None].to(weight.dtype), weight, self.conv1d.bias, groups=s.conv_dim)
            x, B, C = self.split_conv_output(F.silu(conv[0].t()).to(hidden.dtype))
            x = x.view(chunk.num_tokens, s.num_heads, s.head_dim)
            chunk_dt = dt[rows]
            state, start = ssm_layer[chunk.slot], 0
            # scanned piece by piece up to each capture point (the state there is kept)
            for end, capture in [*chunk.captures, (chunk.num_tokens, -1)]:
                lo = chunk.token_start + start
                y[lo : lo + end - start], state = chunk_scan(
                    x[start:end],
                    chunk_dt[start:end],
                    A,
                    B[start:end],
                    C[start:end],
                    self.D,
                    state,
                    s.chunk_size,
                )
                if capture >= 0:
                    assert meta.capture_conv is not None and meta.capture_ssm is not None
                    meta.capture_ssm[capture, self.layer_index] = state
                    meta.capture_conv[capture, self.layer_index] = window[:, end : end + s.conv_kernel - 1]
                start = end
            ssm_layer[chunk.slot] = state
        out = self.norm(y.view(num_tokens, s.intermediate), gate)
        return self.out_proj(out.to(hidden.dtype))

    def split_conv_output(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[rows, conv_dim] -> x [rows, intermediate], B and C [rows, groups, state]."""
        s = self.shape
        group_width = s.n_groups * s.state_size
        x, B, C = conv_out.split([s.intermediate, group_width, group_width], dim=-1)
        return x, B.reshape(-1, s.n_groups, s.state_size), C.reshape(-1, s.n_groups, s.state_size)
