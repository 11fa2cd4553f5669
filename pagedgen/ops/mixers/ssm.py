"""Mamba-2's selective state-space scan over packed variable-length steps, continuing each row's state.

Why the chunked form: the state is materialised once per chunk rather than once per token, a decode step is
one update for the whole batch, and each row continues its committed state exactly, so chunked prefill and
decode agree. Everything runs in float32: the state decays and accumulates every token. docs/performance.md,
"Module notes: ops and bench", has the rest.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedgen.core.transfer import upload_values

CHUNK = 64  # positions per chunk: the quadratic part grows with it, the per-chunk state update shrinks


def packed_selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_in: torch.Tensor,
    state_out: torch.Tensor,
    chunk: int = CHUNK,
    host_cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y [T, H, P]`` (float32) for ``x [T, H, P]``, ``dt [T, H]`` (already softplus'd and clamped),
    ``a [H]``, ``b``/``c [T, G, N]``; reads each row's state from ``state_in [B, H, P, N]`` and writes the
    state after its last token into ``state_out [B, H, P, N]`` (``state_in`` is not mutated).

    ``host_cu_seqlens`` is the host copy of ``cu_seqlens`` (``StepInputs.host``): which rows each chunk
    covers and where their tokens go are host arithmetic, so the scan reads nothing back from the device.
    Without it the boundaries are read back once.
    """
    tokens, heads, head_dim = x.shape
    per_group = heads // b.shape[1]
    b = b.float().repeat_interleave(per_group, dim=1)  # [T, H, N]
    c = c.float().repeat_interleave(per_group, dim=1)  # [T, H, N]
    x, dt, a = x.float(), dt.float(), a.float()
    device = x.device
    host = (cu_seqlens.cpu() if host_cu_seqlens is None else host_cu_seqlens).numpy().astype(np.int64)
    host_starts, host_lengths = host[:-1], host[1:] - host[:-1]  # [B], [B]
    cu = cu_seqlens.long()
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    state = state_in.float().clone()  # [B, H, P, N]
    y = torch.zeros(tokens, heads, head_dim, dtype=torch.float32, device=device)
    offsets = torch.arange(chunk, device=device)
    for first in range(0, int(host_lengths.max(initial=0)), chunk):
        active = np.flatnonzero(host_lengths > first)  # [r] the rows with a token in this chunk
        taken = np.minimum(host_lengths[active] - first, chunk)  # [r] their tokens in it
        row_of = np.repeat(np.arange(active.size), taken)  # [n] for each such token: its row in the chunk
        within = np.arange(row_of.size) - np.repeat(np.cumsum(taken) - taken, taken)  # [n] its position
        index = np.concatenate(
            [active, row_of * chunk + within, host_starts[active][row_of] + first + within]
        )
        rows, flat, out_tok = upload_values(index, torch.long, device).split(
            [active.size, row_of.size, row_of.size]
        )
        valid = first + offsets[None, :] < lengths[rows, None]  # [r, Q]
        tok = (starts[rows, None] + first + offsets[None, :]).clamp(max=tokens - 1)  # [r, Q]
        dt_chunk = dt[tok] * valid[..., None]  # [r, Q, H]; padding positions get dt = 0
        y_chunk, state[rows] = _scan_chunk(x[tok], dt_chunk, a, b[tok], c[tok], state[rows])
        y[out_tok] = y_chunk.reshape(-1, heads, head_dim)[flat]  # the valid positions, by host index
    state_out.copy_(state)
    return y


def _scan_chunk(
    x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of ``Q`` positions for ``r`` rows: ``x [r, Q, H, P]``, ``dt [r, Q, H]``, ``b``/``c
    [r, Q, H, N]``, start ``state [r, H, P, N]`` -> ``(y [r, Q, H, P], state after the chunk)``."""
    q = x.shape[1]
    log_decay = torch.cumsum(dt * a, dim=1)  # [r, Q, H]: log of the decay from the chunk start to l
    between = log_decay[:, :, None, :] - log_decay[:, None, :, :]  # [r, l, s, H]: from s to l
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()[None, :, :, None]
    weights = torch.einsum("rlhn,rshn->rlsh", c, b) * torch.exp(between.masked_fill(~causal, -torch.inf))
    inflow = dt[..., None] * x  # [r, Q, H, P]
    y = torch.einsum("rlsh,rshp->rlhp", weights, inflow)  # within the chunk
    y = y + torch.einsum("rlhn,rhpn->rlhp", c, state) * torch.exp(log_decay)[..., None]  # the start state
    to_end = torch.exp(log_decay[:, -1:, :] - log_decay)[..., None]  # [r, Q, H, 1]: from s to the chunk end
    carried = state * torch.exp(log_decay[:, -1])[..., None, None]
    return y, carried + torch.einsum("rshp,rshn->rhpn", to_end * inflow, b)
