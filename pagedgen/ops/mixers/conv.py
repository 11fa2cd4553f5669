"""Causal depthwise convolution over packed variable-length steps, continuing each row's committed window.

Shared by the hybrid families whose layers keep a short convolution's last inputs as ``fixed_conv`` state
(LFM2's gated short convolution, the Mamba-2 mixer's conv before its scan): a step's rows may be prefill
chunks or single decode tokens, packed back to back without padding (``cu_seqlens``).
"""

from __future__ import annotations

import torch


def packed_causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    state_in: torch.Tensor,
    state_out: torch.Tensor,
) -> torch.Tensor:
    """A causal depthwise convolution over packed rows, continuing each row's committed window.

    ``x [T, C]`` are the step's inputs, ``weight [C, L]``, ``state_in [B, L - 1, C]`` each row's last
    ``L - 1`` inputs before the step (oldest first). Returns ``[T, C]`` and writes the window after each row's
    last token into ``state_out [B, L - 1, C]``. Vectorised: each row's window and tokens are laid out
    back to back in one buffer, then every token gathers its ``L`` taps from it.
    """
    tokens, channels = x.shape
    rows, history = state_in.shape[0], weight.shape[1] - 1
    device = x.device
    cu = cu_seqlens.long()
    # output_size: the total is known (T), so the lengths' sum is never read back from the device
    row = torch.repeat_interleave(
        torch.arange(rows, device=device), cu[1:] - cu[:-1], output_size=tokens
    )  # [T]
    ext = x.new_empty(tokens + rows * history, channels)  # per row: its window, then its tokens
    taps = torch.arange(history, device=device)
    window_at = (cu[:-1] + torch.arange(rows, device=device) * history)[:, None] + taps  # [B, L - 1]
    token_at = torch.arange(tokens, device=device) + (row + 1) * history  # [T]
    ext[window_at.flatten()] = state_in.reshape(-1, channels).to(x.dtype)
    ext[token_at] = x
    gathered = ext[token_at[:, None] - history + torch.arange(history + 1, device=device)]  # [T, L, C]
    out = (gathered * weight.t().to(x.dtype)).sum(dim=1)  # [T, C]
    if bias is not None:
        out = out + bias
    end = cu[1:] + (torch.arange(rows, device=device) + 1) * history  # one past each row's last token
    state_out.copy_(ext[end[:, None] - history + taps])
    return out
