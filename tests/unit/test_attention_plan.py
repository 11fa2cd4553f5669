"""The plain-decode attention plan (``_plan_plain_decode``) is the general plan of the step, field by field.

A packed CPU step whose rows all send one token is planned from its own tensors instead of the general path's
host lists and uploads (docs/performance.md, "Host cost at batch 1, second pass"); every field, dtype and
layout must be the general path's, and every other step (drafts, prefills, windows, the torch path) must still
be planned by the general path.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedgen.executor.inputs import SequenceChunk, pack_step
from pagedgen.ops.kernels.native import decode_kernel, native_status
from pagedgen.ops.mixers import attention
from pagedgen.ops.mixers.attention import paged_attention, plan_attention
from pagedgen.ops.mixers.triton_attention import TRITON_ENV

BS = 4
KV_HEADS, GROUP, HEAD_DIM = 2, 3, 16


@pytest.fixture(autouse=True)
def _native_and_no_triton(monkeypatch):
    if decode_kernel() is None:
        pytest.skip(native_status().detail)
    monkeypatch.setenv(TRITON_ENV, "0")


def _cache(num_blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BS, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _decode_step(pasts: list[int], seed: int = 0):
    """One-token rows at ``pasts`` over shuffled blocks (tables of different lengths, padded)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(past + 1) // BS) for past in pasts]
    perm = torch.randperm(sum(need) + 3, generator=gen).tolist()
    chunks, start = [], 0
    for i, (past, n) in enumerate(zip(pasts, need, strict=True)):
        chunks.append(SequenceChunk([5 + i], past, perm[start : start + n]))
        start += n
    return pack_step(chunks, BS), _cache(len(perm), seed)


def _assert_same(got, want, name: str = "plan") -> None:
    """Equal values, dtypes, devices and layouts, through dataclasses and lists; the same kernel object."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), name
        assert (got.dtype, got.device, got.shape) == (want.dtype, want.device, want.shape), name
        assert got.is_contiguous() == want.is_contiguous() and torch.equal(got, want), name
    elif dataclasses.is_dataclass(want):
        assert type(got) is type(want), name
        for field in dataclasses.fields(want):
            _assert_same(getattr(got, field.name), getattr(want, field.name), f"{name}.{field.name}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), name
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _assert_same(a, b, f"{name}[{i}]")
    elif isinstance(want, (int, float, str, type(None))):
        assert got == want, name
    else:
        assert got is want, name  # the decode kernel


@pytest.mark.parametrize("pasts", [[0], [7], [99], [3, 17, 0, 30], [4, 4, 4, 4, 4, 4, 4, 4]])
def test_a_plain_decode_step_is_planned_as_the_general_path_plans_it(pasts):
    inputs, (k_cache, _v) = _decode_step(pasts)
    fast = attention._plan_plain_decode(inputs, k_cache)
    assert fast is not None
    _assert_same(fast, attention._plan_general(inputs, k_cache, True, None))
    _assert_same(plan_attention(inputs, k_cache), fast)  # the entry point takes it


def test_the_plain_plan_attends_with_the_general_plans_bits():
    inputs, (k_cache, v_cache) = _decode_step([3, 17, 0, 30], seed=2)
    query = torch.randn(
        inputs.num_tokens, KV_HEADS * GROUP, HEAD_DIM, generator=torch.Generator().manual_seed(3)
    )
    general = attention._plan_general(inputs, k_cache, True, None)
    got = paged_attention(query, k_cache, v_cache, inputs, HEAD_DIM**-0.5, plan_attention(inputs, k_cache))
    assert torch.equal(got, paged_attention(query, k_cache, v_cache, inputs, HEAD_DIM**-0.5, general))


def _general_only(monkeypatch) -> list:
    calls = []
    plain = attention._plan_plain_decode
    monkeypatch.setattr(attention, "_plan_plain_decode", lambda *a: calls.append(a) or plain(*a))
    return calls


def test_other_steps_are_planned_by_the_general_path(monkeypatch):
    calls = _general_only(monkeypatch)
    k_cache, _v = _cache(32, 0)
    prefill = pack_step([SequenceChunk([1, 2, 3], 0, [0]), SequenceChunk([4], 9, [1, 2, 3])], BS)
    draft = pack_step([SequenceChunk([1, 2], 5, [4, 5], all_logits=True)], BS)
    decode = pack_step([SequenceChunk([4], 9, [1, 2, 3])], BS)
    for inputs, kwargs in (
        (prefill, {}),
        (draft, {}),
        (decode, {"use_native": False}),
        (decode, {"window": 6}),
    ):
        plan = plan_attention(inputs, k_cache, **kwargs)
        want = attention._plan_general(inputs, k_cache, kwargs.get("use_native", True), kwargs.get("window"))
        _assert_same(plan, want)
    assert calls == []
    no_host = dataclasses.replace(decode, host=None)  # a captured graph's static inputs: the static plan
    assert plan_attention(no_host, k_cache).host_slot_mapping is None and calls == []


def test_a_cache_the_native_kernel_cannot_read_falls_back_to_the_general_path():
    inputs, _caches = _decode_step([6])
    k_cache = torch.zeros(8, BS, KV_HEADS, HEAD_DIM, dtype=torch.float64)
    assert attention._plan_plain_decode(inputs, k_cache) is None
    plan = plan_attention(inputs, k_cache)
    assert plan.kernel is None and plan.decode_buckets is not None
