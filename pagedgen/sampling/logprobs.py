"""Log-probabilities of sampled tokens and their top-n alternatives.

They are taken from the PROCESSED distribution, the one the token was actually drawn from (vLLM's
``logprobs_mode="processed_logprobs"``): after EOS suppression, repetition / presence / frequency penalties,
n-gram bans and logit bias, and, for sampled rows, after temperature and top-k / top-p / min-p filtering.
Greedy rows use the processed logits without warpers (greedy decoding ignores them, as in transformers), so
their chosen token always carries the maximum logprob. Filtered tokens have probability 0 (logprob -inf); they
are never sampled and are left out of the alternatives, so a row may get fewer than n of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedgen.core.transfer import upload_values


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's logprob and its top ``(token_id, logprob)`` alternatives, as a caller gets them
    (``CompletionOutput.logprobs``, the server's responses): copied off the engine's event."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(slots=True)
class RowLogprobs:
    """One row's sampled-token logprob and its top-n ``(token, logprob)`` alternatives, descending."""

    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(slots=True)
class LogprobTensors:
    """The device side of a step's logprobs, for the rows that asked (``wanted``, in row order)."""

    wanted: list[int]  # rows with num_logprobs > 0
    chosen: torch.Tensor  # [W] float32, the sampled token's logprob
    values: torch.Tensor  # [W, n_max] float32, top-n logprobs, descending
    ids: torch.Tensor  # [W, n_max] int64, their tokens

    @property
    def parts(self) -> list[torch.Tensor]:
        """The flat tensors to read back, in the order :meth:`rows` takes them."""
        return [self.chosen, self.values.reshape(-1), self.ids.reshape(-1)]

    def rows(self, host: list[float], num_logprobs: Sequence[int], vocab: int) -> list[RowLogprobs | None]:
        """Each row's :class:`RowLogprobs` (None where none was asked) from the host copy of :attr:`parts`
        (float64 or the tensors' own dtypes: ids are exact in float64)."""
        w, n_max = self.values.shape
        chosen, values, ids = host[:w], host[w : w + w * n_max], host[w + w * n_max :]
        result: list[RowLogprobs | None] = [None] * len(num_logprobs)
        for i, r in enumerate(self.wanted):
            n = min(num_logprobs[r], vocab)
            row_ids = ids[i * n_max : i * n_max + n]
            row_values = values[i * n_max : i * n_max + n]
            top = tuple((int(t), v) for t, v in zip(row_ids, row_values, strict=True) if v != -float("inf"))
            result[r] = RowLogprobs(chosen[i], top)
        return result


def logprob_tensors(
    processed: torch.Tensor, tokens: torch.Tensor, num_logprobs: Sequence[int]
) -> LogprobTensors | None:
    """The logprob tensors of every row with ``num_logprobs[r] > 0`` (None when no row asked), on the
    logits' device, with no host read: the sampler copies them back together with its tokens.

    ``processed`` is ``[R, V]``, ``tokens`` ``[R]`` int64 on the same device. One log-softmax, one gather and
    one top-k over the rows that asked; nothing is mutated.
    """
    wanted = [r for r, n in enumerate(num_logprobs) if n > 0]
    if not wanted:
        return None
    vocab = processed.shape[-1]
    if len(wanted) == len(num_logprobs):
        logp, chosen_tokens = processed.float(), tokens  # every row asked: no gather at all
    else:
        index = upload_values(wanted, torch.long, processed.device)  # [W]
        logp, chosen_tokens = processed.index_select(0, index).float(), tokens.index_select(0, index)
    logp = torch.log_softmax(logp, dim=-1)  # [W, V]
    chosen = logp.gather(1, chosen_tokens[:, None]).squeeze(1)  # [W]
    top = torch.topk(logp, min(max(num_logprobs), vocab), dim=-1)  # values/indices [W, n_max], descending
    return LogprobTensors(wanted, chosen, top.values, top.indices)


def compute_logprobs(
    processed: torch.Tensor, tokens: torch.Tensor, num_logprobs: Sequence[int]
) -> list[RowLogprobs | None]:
    """Logprobs for every row with ``num_logprobs[r] > 0`` (None for the others), read back with one
    device-to-host copy (:func:`logprob_tensors`, then :meth:`LogprobTensors.rows`)."""
    tensors = logprob_tensors(processed, tokens, num_logprobs)
    if tensors is None:
        return [None] * len(num_logprobs)
    host = torch.cat([part.double() for part in tensors.parts]).tolist()
    return tensors.rows(host, num_logprobs, processed.shape[-1])
