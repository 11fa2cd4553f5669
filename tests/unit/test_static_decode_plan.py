"""Attention plans for a captured CUDA graph's static decode inputs (``host`` None), built without reads.

The step is written into :class:`~pagedgen.executor.cuda_graphs.StaticDecodeBuffers`' own views (padding
rows included), planned from them with no host copies, and compared with the same step planned from its
host copies; :class:`tests.host_reads.HostReads` checks that planning and attending read no device value.
Triton runs under its interpreter here (``tests/conftest.py``), forced by ``PAGEDGEN_TRITON_ATTENTION=1``.
"""

from __future__ import annotations

import pytest
import torch

from pagedgen.executor.cuda_graphs import GraphGeometry, GraphKey, StaticDecodeBuffers, classify_step
from pagedgen.executor.inputs import SequenceChunk, pack_step
from pagedgen.ops.mixers import attention, triton_attention
from pagedgen.ops.mixers.attention import paged_attention, plan_attention
from pagedgen.ops.mixers.triton_attention import TRITON_ENV
from tests.host_reads import HostReads

BS = 4
KV_HEADS, GROUP, HEAD_DIM = 2, 2, 16
GEOMETRY = GraphGeometry(max_batch_size=8, max_width=16, block_size=BS)
PASTS = [5, 17, 30]  # 3 rows: bucket 4 (one padding row); the longest reads 8 columns: width bucket 8
OTHER_PASTS = [29, 0, 2]  # another step of the same key

needs_triton = pytest.mark.skipif(
    not triton_attention.triton_importable(), reason="triton is not installed (the `test` extra brings it)"
)
# (Triton forced on, use_native): the Triton plan, the native CPU kernel, the pure-torch bucket
PATHS = [pytest.param(True, True, marks=needs_triton, id="triton"), (False, True), (False, False)]


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_step(pasts: list[int], seed: int = 0):
    """A packed decode step over shuffled blocks of a noise-filled cache (the last block is the scratch)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(past + 1) // BS) for past in pasts]
    num_blocks = sum(need) + 4
    scratch = num_blocks - 1
    perm = torch.randperm(scratch, generator=gen).tolist()
    chunks, start = [], 0
    for past, n in zip(pasts, need, strict=True):
        chunks.append(SequenceChunk([1], past, perm[start : start + n]))
        start += n
    shape = (num_blocks, BS, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    query = torch.randn(len(pasts), KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    return pack_step(chunks, BS), k_cache, v_cache, query, scratch


def static_step(inputs, scratch: int):
    """The step as a captured graph sees it: ``key``'s static views, loaded by the graph buffers."""
    key = classify_step(inputs, GEOMETRY)
    assert key == GraphKey(4, 8)
    buffers = StaticDecodeBuffers(GEOMETRY, torch.device("cpu"), scratch)
    static = buffers.load(inputs, key)
    assert static.host is None and static.num_seqs == key.batch > inputs.num_seqs
    return static, buffers, key


def padded(query: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.zeros(rows, *query.shape[1:])
    out[: query.shape[0]] = query
    return out


def set_mode(monkeypatch, triton: bool) -> None:
    monkeypatch.setenv(TRITON_ENV, "1" if triton else "0")


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize(("triton", "use_native"), PATHS)
def test_a_static_decode_plan_attends_as_the_host_plan(triton, use_native, window, monkeypatch):
    set_mode(monkeypatch, triton)
    inputs, k_cache, v_cache, query, scratch = make_step(PASTS)
    static, _buffers, key = static_step(inputs, scratch)
    scale = HEAD_DIM**-0.5
    host_plan = plan_attention(inputs, k_cache, use_native=use_native, window=window)
    plan = plan_attention(static, k_cache, use_native=use_native, window=window)
    assert (plan.triton is not None) == triton and not plan.prefill
    rows = inputs.num_seqs
    assert plan.decode_token_rows.tolist() == list(range(key.batch))
    assert plan.decode_kv_lens[:rows].tolist() == host_plan.decode_kv_lens.tolist()
    if window is not None:
        assert plan.decode_starts[:rows].tolist() == host_plan.decode_starts.tolist()
    want = paged_attention(query, k_cache, v_cache, inputs, scale, host_plan)
    got = paged_attention(padded(query, key.batch), k_cache, v_cache, static, scale, plan)
    assert (got[:rows] - want).abs().max().item() <= 1e-5
    # the padding row attends to the one key it wrote, in the scratch block
    expected_pad = v_cache[scratch, 0].repeat_interleave(GROUP, dim=0)
    assert (got[rows] - expected_pad).abs().max().item() <= 1e-5


@pytest.mark.parametrize(("triton", "use_native"), PATHS)
def test_the_soft_capped_torch_fallback_of_a_static_plan_matches(triton, use_native, monkeypatch):
    set_mode(monkeypatch, triton)
    inputs, k_cache, v_cache, query, scratch = make_step(PASTS, seed=1)
    static, _buffers, key = static_step(inputs, scratch)
    scale = HEAD_DIM**-0.5
    want = paged_attention(query, k_cache, v_cache, inputs, scale, softcap=5.0)
    plan = plan_attention(static, k_cache, use_native=use_native)
    got = paged_attention(padded(query, key.batch), k_cache, v_cache, static, scale, plan, softcap=5.0)
    assert (got[: inputs.num_seqs] - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize(("triton", "use_native"), PATHS)
def test_planning_and_attending_a_static_step_reads_no_device_value(triton, use_native, window, monkeypatch):
    set_mode(monkeypatch, triton)
    inputs, k_cache, v_cache, query, scratch = make_step(PASTS)
    static, buffers, key = static_step(inputs, scratch)
    q = padded(query, key.batch)
    reads = HostReads()
    reads.mark(buffers.buffer, k_cache, v_cache, q)
    reads.mark([getattr(static, name) for name in ("input_ids", "positions", "cu_seqlens", "past_lens")])
    reads.mark(static.block_tables, static.slot_mapping, static.logits_rows)
    with reads:
        plan = plan_attention(static, k_cache, use_native=use_native, window=window)
        for softcap in (None, 5.0):
            paged_attention(q, k_cache, v_cache, static, HEAD_DIM**-0.5, plan, softcap=softcap)
    assert reads.reads == []
    with reads:  # the harness does see the read the old plan made of these views
        attention._host_lengths(static, window)
    assert [r.op for r in reads.reads] == ["tolist"]


@pytest.mark.parametrize("window", [None, 6])
def test_a_static_split_count_is_a_function_of_the_bucket_only(window, monkeypatch):
    """Two steps of one key plan the same split count, from the bucket's rows and a bound on every row's
    keys (its capacity; a window's keys from the start of their first block)."""
    if not triton_attention.triton_importable():
        pytest.skip("triton is not installed")
    set_mode(monkeypatch, True)
    calls = []

    def splits(programs: int, max_keys: int, device: torch.device) -> int:
        calls.append((programs, max_keys))
        return 1 + max_keys % 5

    monkeypatch.setattr(attention, "decode_splits", splits)
    planned, longest = [], 0
    for pasts in (PASTS, OTHER_PASTS):
        inputs, k_cache, _v, _q, scratch = make_step(pasts)
        static, _buffers, key = static_step(inputs, scratch)
        planned.append(plan_attention(static, k_cache, window=window).triton.num_splits)
        longest = max(longest, *plan_attention(static, k_cache, window=window).decode_kv_lens.tolist())
    upper, _lower = GEOMETRY.kv_bounds(key)
    bound = upper if window is None else min(upper, window + BS - 1)
    assert calls[0] == calls[1] == (key.batch * KV_HEADS, bound) and longest <= bound
    assert planned[0] == planned[1] == 1 + bound % 5
