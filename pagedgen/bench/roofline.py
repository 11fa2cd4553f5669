"""The physical limit a throughput is judged against: this machine's fp32 GEMM rate and the workload's FLOPs.

Why FLOPs of useful work: a decoder that computes logits only for sampled rows does the same arithmetic
whatever system runs it, so the fraction of the machine's fp32 GEMM rate compares the systems on one scale.
Decode-heavy workloads are memory-bound, so their fraction is naturally far below 1. docs/performance.md,
"Module notes: ops and bench", has the rest.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedgen.bench.workloads import BenchRequest


class DecoderShape(Protocol):
    """The config fields the FLOP count reads (:class:`pagedgen.models.config.ModelConfig` has them)."""

    hidden_size: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    num_layers: int
    intermediate_size: int
    vocab_size: int


@dataclass(frozen=True, slots=True)
class FlopModel:
    """Per-token FLOP coefficients of a Llama-family decoder."""

    linear_params: int  # weights of every q/k/v/o and MLP projection, all layers
    attention_coeff: int  # 4 * layers * q_heads * head_dim: FLOPs per token per unit of context
    head_flops: int  # 2 * hidden * vocab per logits row

    @classmethod
    def from_config(cls, config: DecoderShape) -> FlopModel:
        """From a :class:`pagedgen.models.config.ModelConfig` (or any object with the same fields)."""
        hidden, d = config.hidden_size, config.head_dim
        q, kv = config.num_heads * d, config.num_kv_heads * d
        per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * config.intermediate_size
        return cls(
            linear_params=config.num_layers * per_layer,
            attention_coeff=4 * config.num_layers * config.num_heads * d,
            head_flops=2 * hidden * config.vocab_size,
        )

    def request_flops(self, prompt_len: int, output_len: int) -> float:
        forwarded = prompt_len + output_len - 1  # the last generated token is never fed back
        context_sum = forwarded * (forwarded + 1) / 2  # kv_len of the forwarded tokens: 1 .. forwarded
        return (
            2.0 * self.linear_params * forwarded
            + float(self.attention_coeff) * context_sum
            + float(self.head_flops) * output_len
        )

    def workload_flops(self, requests: Sequence[BenchRequest]) -> float:
        return sum(self.request_flops(len(r.prompt_ids), r.output_len) for r in requests)


def flop_model_of(model: object) -> FlopModel | None:
    """The FLOP model of a loaded ``pg.Model``; None for models without a Llama config (the synthetic one)."""
    config = getattr(model, "config", None)
    needed = ("hidden_size", "head_dim", "num_heads", "num_kv_heads", "num_layers", "intermediate_size")
    if config is None or not all(hasattr(config, name) for name in needed):
        return None
    return FlopModel.from_config(config)


def measure_gemm_flops(size: int = 1024, repeats: int = 20) -> float:
    """FLOP/s of torch's fp32 ``[size, size] @ [size, size]`` on the current thread count (best of repeats).

    Best-of rather than median: on a shared machine the fastest repeat is the one least disturbed by others,
    i.e. the closest estimate of what the hardware can do.
    """
    if size <= 0 or repeats <= 0:
        raise ValueError(f"size and repeats must be positive, got {size}, {repeats}")
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    out = torch.empty(size, size)
    torch.mm(a, b, out=out)  # warm up the thread pool and the kernel choice
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best
