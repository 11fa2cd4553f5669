"""Mamba-2's selective state-space scan over packed variable-length steps, continuing each row's state.

Per head ``h`` (scalar decay ``a_h < 0``), per token ``t`` of one row::

    state_t = exp(dt_t a_h) state_{t-1} + dt_t x_t B_t^T        state [head_dim, N]
    y_t     = state_t C_t                                        y [head_dim]

``B``/``C`` are shared by the heads of a group. A step's rows may be prefill chunks or single decode tokens
packed back to back (``cu_seqlens``); each starts from its committed state and the state after its last token
is written out, so chunked prefill and decode continue exactly where the previous step stopped.

The scan runs token position by token position *within* the rows, vectorised across rows and heads: a
decode step (one token per row) is a single update for the whole batch, a prefill of ``n`` tokens ``n``
updates. It runs in float32 whatever the model's dtype: the state multiplies by a decay every token, so
rounding it to 16 bits each step would accumulate (transformers' scan also computes in float32).
"""

from __future__ import annotations

import torch


def packed_selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_in: torch.Tensor,
    state_out: torch.Tensor,
) -> torch.Tensor:
    """``y [T, H, P]`` (float32) for ``x [T, H, P]``, ``dt [T, H]`` (already softplus'd and clamped),
    ``a [H]``, ``b``/``c [T, G, N]``; reads each row's state from ``state_in [B, H, P, N]`` and writes the
    state after its last token into ``state_out [B, H, P, N]`` (``state_in`` is not mutated)."""
    tokens, heads, head_dim = x.shape
    per_group = heads // b.shape[1]
    b = b.float().repeat_interleave(per_group, dim=1)  # [T, H, N]
    c = c.float().repeat_interleave(per_group, dim=1)  # [T, H, N]
    decay = torch.exp(dt.float() * a.float())  # [T, H]
    dx = dt.float()[..., None] * x.float()  # [T, H, P]
    cu = cu_seqlens.long()
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    state = state_in.float().clone()  # [B, H, P, N]
    y = torch.empty(tokens, heads, head_dim, dtype=torch.float32, device=x.device)
    every_row = torch.arange(len(starts), device=x.device)
    for j in range(int(lengths.max()) if len(lengths) else 0):
        rows = every_row[lengths > j]  # the rows with a j-th token
        tok = starts[rows] + j
        inflow = dx[tok][..., None] * b[tok][:, :, None, :]  # [r, H, P, N]
        state[rows] = state[rows] * decay[tok][:, :, None, None] + inflow
        y[tok] = (state[rows] @ c[tok][..., None]).squeeze(-1)
    state_out.copy_(state)
    return y
