"""Sampling: per-request options and random streams, logits processors, the batched sampler, stop strings,
logprobs. The engine calls :meth:`Sampler.sample` once per step and checkpoints each request's
:class:`RequestSampler` (and its turn's :class:`StopStringMatcher`) with the step transaction. The sampling
errors live with every other error type in :mod:`pagedgen.errors`."""

from pagedgen.sampling.logprobs import RowLogprobs, compute_logprobs
from pagedgen.sampling.options import SamplingOptions
from pagedgen.sampling.sampler import SampledToken, Sampler, SampleRow, inverse_cdf_sample, process_logits
from pagedgen.sampling.stop import StopCheckpoint, StopStringMatcher, StopUpdate
from pagedgen.sampling.streams import RequestSampler, SamplerCheckpoint, fresh_seed, stream_uniforms

__all__ = [
    "RequestSampler",
    "RowLogprobs",
    "SampleRow",
    "SampledToken",
    "Sampler",
    "SamplerCheckpoint",
    "SamplingOptions",
    "StopCheckpoint",
    "StopStringMatcher",
    "StopUpdate",
    "compute_logprobs",
    "fresh_seed",
    "inverse_cdf_sample",
    "process_logits",
    "stream_uniforms",
]
