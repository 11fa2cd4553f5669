"""Paged attention ops: write_kv, the oracle against dense attention, the fast path against the oracle."""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedgen.core.step_inputs import StepInputs
from pagedgen.executor.inputs import SequenceChunk, pack_step
from pagedgen.ops.kernels import native
from pagedgen.ops.kernels.cpu_memory import release_freed_cpu_memory, retain_freed_cpu_memory
from pagedgen.ops.mixers import attention
from pagedgen.ops.mixers.attention import (
    check_step_slots,
    paged_attention,
    paged_attention_reference,
    plan_attention,
    write_kv,
)


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """These tensors are tiny: waking intra-op threads costs more than the math and thrashes a shared CPU."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@dataclass(slots=True)
class PagedCase:
    """A packed step over shuffled physical blocks, with each request's full contiguous K/V kept aside."""

    inputs: StepInputs
    query: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    dense_keys: list[torch.Tensor]  # per request [past + q, Hkv, D]
    dense_values: list[torch.Tensor]  # per request [past + q, Hkv, D]


def build_case(
    seqs: list[tuple[int, int]],
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> PagedCase:
    """Scatter each request's history into randomly permuted blocks, then write the step's K/V via write_kv.

    ``seqs`` holds ``(past_len, query_len)`` per request. Spare blocks are filled with noise so a read through
    a wrong block shows up.
    """
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(past + q) // block_size) for past, q in seqs]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    chunks, dense_keys, dense_values, start = [], [], [], 0
    for (past, q), n in zip(seqs, need, strict=True):
        table = perm[start : start + n]
        start += n
        keys = torch.randn(past + q, num_kv_heads, head_dim, generator=gen).to(dtype)
        values = torch.randn(past + q, num_kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(past)
        blocks = torch.tensor(table, dtype=torch.long)[pos // block_size]
        k_cache[blocks, pos % block_size] = keys[:past]
        v_cache[blocks, pos % block_size] = values[:past]
        chunks.append(SequenceChunk(tokens=[0] * q, past_len=past, block_table=table))
        dense_keys.append(keys)
        dense_values.append(values)
    inputs = pack_step(chunks, block_size)
    new_keys = torch.cat([k[past:] for k, (past, _) in zip(dense_keys, seqs, strict=True)])
    new_values = torch.cat([v[past:] for v, (past, _) in zip(dense_values, seqs, strict=True)])
    write_kv(new_keys, new_values, k_cache, v_cache, inputs.slot_mapping)
    query = torch.randn(inputs.num_tokens, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return PagedCase(inputs, query, k_cache, v_cache, dense_keys, dense_values)


def dense_causal_attention(case: PagedCase, scale: float, softcap: float | None = None) -> torch.Tensor:
    """Textbook attention on each request's contiguous K/V in float64, built independently of the oracle;
    with ``softcap`` each score becomes ``softcap * tanh(score / softcap)`` before the mask."""
    outs = []
    cu = case.inputs.cu_seqlens.tolist()
    hq, hkv = case.query.shape[1], case.k_cache.shape[2]
    kv_head = torch.arange(hq) // (hq // hkv)  # [Hq], the kv head each query head reads
    for i, (keys, values) in enumerate(zip(case.dense_keys, case.dense_values, strict=True)):
        q = case.query[cu[i] : cu[i + 1]].double()  # [q, Hq, D]
        k = keys.double()[:, kv_head]  # [kv, Hq, D]
        v = values.double()[:, kv_head]  # [kv, Hq, D]
        q_len, kv_len = q.shape[0], k.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, q, kv]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len)
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


seq_strategy = st.tuples(
    st.integers(min_value=0, max_value=40),
    st.one_of(st.just(1), st.integers(min_value=1, max_value=20)),
)


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "torch"])
@settings(max_examples=150)
@given(
    seqs=st.lists(seq_strategy, min_size=1, max_size=8),
    block_size=st.integers(min_value=1, max_value=32),
    num_kv_heads=st.integers(min_value=1, max_value=3),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([1, 4, 8, 64, 128]),  # 64 and 128 take the kernel's unrolled branches
    seed=st.integers(min_value=0, max_value=2**31 - 1),
)
def test_fast_path_matches_reference(use_native, seqs, block_size, num_kv_heads, group, head_dim, seed):
    case = build_case(seqs, block_size, num_kv_heads, group, head_dim, seed)
    scale = head_dim**-0.5
    plan = plan_attention(case.inputs, case.k_cache, use_native=use_native)
    decodes = plan.decode_token_rows.numel() > 0
    assert (plan.kernel is not None) == (use_native and decodes and native.native_status().available)
    fast = paged_attention(case.query, case.k_cache, case.v_cache, case.inputs, scale, plan)
    ref = paged_attention_reference(case.query, case.k_cache, case.v_cache, case.inputs, scale)
    assert fast.shape == ref.shape == case.query.shape
    assert fast.dtype == case.query.dtype
    assert (fast - ref).abs().max().item() <= 1e-5


@pytest.mark.cpu
def test_native_decode_kernel_is_built_here_and_shares_torchs_openmp_runtime():
    """With a C compiler the kernel must be in use, bound to the one OpenMP runtime torch loaded."""
    if shutil.which("cc") is None and shutil.which("gcc") is None and not os.environ.get("CC"):
        pytest.skip("no C compiler on this machine: the pure-torch path is used")
    status = native.native_status()
    assert status.available, status.detail
    maps = Path("/proc/self/maps").read_text().splitlines()
    runtimes = {line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]}
    assert len(runtimes) == 1, runtimes


@pytest.mark.cpu
def test_native_decode_kernel_gives_the_same_bits_on_one_and_two_threads():
    case = build_case([(300, 1), (17, 1), (64, 1), (5, 1)], 16, num_kv_heads=3, group=3, head_dim=64, seed=4)
    plan = plan_attention(case.inputs, case.k_cache)
    if plan.kernel is None:
        pytest.skip(native.native_status().detail)
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        outs.append(paged_attention(case.query, case.k_cache, case.v_cache, case.inputs, 0.125, plan))
    torch.set_num_threads(1)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.cpu
def test_native_kernels_can_be_switched_off_and_a_failed_build_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    library = native._build_and_load()
    assert library.decode is None and library.gemm is None
    assert library.status == native.NativeStatus(False, f"disabled by {native.DISABLE_ENV}")
    monkeypatch.delenv(native.DISABLE_ENV)
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    library = native._build_and_load()
    assert library.decode is None and library.gemm is None and not library.status.available
    assert library.status.detail.startswith("building the native kernels failed")
    assert not list(tmp_path.rglob("*.so*"))  # no half-written library left behind


@pytest.mark.cpu
def test_the_kernels_march_comes_from_the_environment_and_a_bad_one_is_refused(monkeypatch, tmp_path):
    """PAGEDGEN_KERNEL_MARCH replaces -march=native (and keys the cache); a value that is not one word never
    reaches the compiler's command line."""
    args = tmp_path / "args"
    compiler = tmp_path / "cc"
    compiler.write_text(
        f'#!/bin/sh\n[ "$1" = --version ] && echo fake-cc 1 && exit 0\necho "$@" > {args}\nexit 1\n'
    )
    compiler.chmod(0o755)
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv(native.MARCH_ENV, "x86-64-v3")
    assert native.kernel_march() == "x86-64-v3"
    library = native._build_and_load()
    assert not library.status.available
    flags = args.read_text().split()
    assert "-march=x86-64-v3" in flags and "-march=native" not in flags
    args.unlink()
    monkeypatch.setenv(native.MARCH_ENV, "native -O0")
    library = native._build_and_load()
    assert library.status.detail == (
        f"building the native kernels failed: {native.MARCH_ENV}='native -O0' is not a -march value "
        "(one word such as x86-64-v3 or znver3)"
    )
    assert not args.exists()
    monkeypatch.delenv(native.MARCH_ENV)
    assert native.kernel_march() == "native"


def test_a_step_plan_is_reusable_across_layers():
    """One plan serves every layer: the same result as planning inside each call, for both decode paths."""
    case = build_case(
        [(0, 7), (13, 1), (5, 1), (9, 6)], block_size=4, num_kv_heads=2, group=3, head_dim=8, seed=2
    )
    unplanned = paged_attention(case.query, case.k_cache, case.v_cache, case.inputs, 0.25)
    for use_native in (True, False):
        plan = plan_attention(case.inputs, case.k_cache, use_native=use_native)
        for _ in range(2):
            planned = paged_attention(case.query, case.k_cache, case.v_cache, case.inputs, 0.25, plan)
            assert (planned - unplanned).abs().max().item() <= 1e-6


@settings(max_examples=60)
@given(
    seqs=st.lists(seq_strategy, min_size=1, max_size=5),
    block_size=st.integers(min_value=1, max_value=32),
    num_kv_heads=st.integers(min_value=1, max_value=3),
    group=st.sampled_from([1, 2, 4]),
    seed=st.integers(min_value=0, max_value=2**31 - 1),
)
def test_reference_equals_dense_causal_attention(seqs, block_size, num_kv_heads, group, seed):
    case = build_case(seqs, block_size, num_kv_heads, group, head_dim=8, seed=seed)
    scale = 0.3
    ref = paged_attention_reference(case.query, case.k_cache, case.v_cache, case.inputs, scale)
    dense = dense_causal_attention(case, scale)
    assert (ref.double() - dense).abs().max().item() <= 1e-5


def test_mixed_step_with_gqa_matches_dense_attention():
    """A fixed mixed step: a fresh prefill, two decodes, a chunked prefill continuing its history."""
    case = build_case(
        [(0, 7), (13, 1), (5, 1), (9, 6)], block_size=4, num_kv_heads=2, group=3, head_dim=8, seed=1
    )
    fast = paged_attention(case.query, case.k_cache, case.v_cache, case.inputs, 0.25)
    assert (fast.double() - dense_causal_attention(case, 0.25)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("use_native", [True, False], ids=["native-plan", "torch"])
def test_softcapped_scores_match_the_reference_and_dense_attention(use_native):
    """Gemma 2's attention logit soft-capping on every path: prefill from 0, continued prefill, decodes."""
    case = build_case(
        [(0, 7), (13, 1), (5, 1), (9, 6), (30, 1)], block_size=4, num_kv_heads=2, group=3, head_dim=8, seed=5
    )
    query, cap, scale = case.query * 4, 2.0, 0.5  # scores of a few units: the cap bends them
    plan = plan_attention(case.inputs, case.k_cache, use_native=use_native)
    fast = paged_attention(query, case.k_cache, case.v_cache, case.inputs, scale, plan, softcap=cap)
    ref = paged_attention_reference(query, case.k_cache, case.v_cache, case.inputs, scale, softcap=cap)
    case.query = query
    assert (fast - ref).abs().max().item() <= 1e-5
    assert (ref.double() - dense_causal_attention(case, scale, softcap=cap)).abs().max().item() <= 1e-5
    uncapped = paged_attention(query, case.k_cache, case.v_cache, case.inputs, scale, plan)
    assert (fast - uncapped).abs().max().item() > 1e-2  # the cap changes the result here


def test_fast_path_keeps_a_low_precision_dtype():
    case = build_case(
        [(3, 1), (0, 5)], block_size=2, num_kv_heads=1, group=2, head_dim=8, seed=3, dtype=torch.bfloat16
    )
    fast = paged_attention(case.query, case.k_cache, case.v_cache, case.inputs, 0.5)
    ref = paged_attention_reference(case.query, case.k_cache, case.v_cache, case.inputs, 0.5)
    assert fast.dtype == torch.bfloat16
    assert (fast.float() - ref.float()).abs().max().item() <= 2e-2


def test_a_token_sees_no_future_keys():
    """Changing a later token's K/V leaves earlier tokens' outputs bit-identical (causality)."""
    case = build_case([(2, 5)], block_size=3, num_kv_heads=1, group=1, head_dim=4, seed=7)
    before = paged_attention(case.query, case.k_cache, case.v_cache, case.inputs, 1.0)
    last_slot = case.inputs.slot_mapping[-1:]
    write_kv(torch.full((1, 1, 4), 9.0), torch.full((1, 1, 4), 9.0), case.k_cache, case.v_cache, last_slot)
    after = paged_attention(case.query, case.k_cache, case.v_cache, case.inputs, 1.0)
    assert torch.equal(before[:-1], after[:-1])
    assert not torch.equal(before[-1], after[-1])


@pytest.fixture(params=["native", "torch"])
def write_path(request, monkeypatch):
    """write_kv through the native copy kernel, and through index_copy_."""
    if request.param == "native" and native.decode_kernel() is None:
        pytest.skip(native.native_status().detail)
    if request.param == "torch":
        monkeypatch.setattr(attention, "decode_kernel", lambda: None)
    return request.param


def test_write_kv_writes_exactly_the_mapped_slots(write_path):
    k_cache = torch.zeros(3, 2, 1, 2)
    v_cache = torch.zeros(3, 2, 1, 2)
    fused = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 9.0], [5.0, 6.0, 9.0]])  # rows at stride 3, as in q/k/v
    key = fused[:, :2].view(3, 1, 2)  # [3, 1, 2]
    slots = torch.tensor([5, 0, 2])  # block 2 offset 1, block 0 offset 0, block 1 offset 0
    write_kv(key, -key, k_cache, v_cache, slots)
    expected = torch.zeros(3, 2, 1, 2)
    expected[2, 1, 0] = torch.tensor([1.0, 2.0])
    expected[0, 0, 0] = torch.tensor([3.0, 4.0])
    expected[1, 0, 0] = torch.tensor([5.0, 6.0])
    assert torch.equal(k_cache, expected)
    assert torch.equal(v_cache, -expected)


def test_write_kv_refuses_a_slot_outside_the_cache_without_writing(write_path):
    k_cache, v_cache = torch.zeros(2, 2, 1, 2), torch.zeros(2, 2, 1, 2)
    with pytest.raises(IndexError):
        write_kv(torch.ones(2, 1, 2), torch.ones(2, 1, 2), k_cache, v_cache, torch.tensor([1, 4]))
    assert not k_cache.any() and not v_cache.any()


def test_write_kv_reads_no_device_slot_back():
    """On a device, the bounds check would cost two host synchronisations per layer: the meta device holds no
    data, so any read of the slots (``int``, ``.tolist()``) would raise here."""
    k_cache, v_cache = torch.zeros(2, 2, 1, 2, device="meta"), torch.zeros(2, 2, 1, 2, device="meta")
    key = torch.ones(2, 1, 2, device="meta")
    write_kv(key, key, k_cache, v_cache, torch.tensor([1, 3], device="meta"))


def test_a_steps_slots_are_checked_on_their_host_copies_before_the_model_runs():
    """What stands in for write_kv's check on a device: check_step_slots reads only ``inputs.host``."""
    step = pack_step([SequenceChunk([1, 2], 0, [0]), SequenceChunk([3], 0, [1])], 2, device="meta")
    check_step_slots(step, full_slots=4)  # slots 0, 1, 2: inside
    with pytest.raises(IndexError, match="outside the cache's 2 slots"):
        check_step_slots(step, full_slots=2)
    ring = pack_step([SequenceChunk([1], 4, [1, 2, 0], window_ring=[5, 6])], 2, device="meta", window=2)
    check_step_slots(ring, full_slots=6, window_slots=14)
    with pytest.raises(IndexError, match="window-ring slot"):
        check_step_slots(ring, full_slots=6, window_slots=10)
    check_step_slots(dataclasses.replace(step, host=None), full_slots=0)  # no host copies: write_kv checks


def test_write_kv_refuses_mismatched_shapes_without_writing():
    k_cache = torch.zeros(2, 2, 1, 2)
    v_cache = torch.zeros(2, 2, 1, 2)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(torch.ones(2, 1, 2), torch.ones(2, 1, 2), k_cache, v_cache, torch.tensor([0]))
    with pytest.raises(ValueError, match="key/value"):
        write_kv(torch.ones(1, 2, 2), torch.ones(1, 2, 2), k_cache, v_cache, torch.tensor([0]))
    assert not k_cache.any() and not v_cache.any()


def test_attention_refuses_inconsistent_shapes():
    case = build_case([(1, 2)], block_size=2, num_kv_heads=2, group=1, head_dim=4, seed=0)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_attention(case.query[:, :1].repeat(1, 3, 1), case.k_cache, case.v_cache, case.inputs, 1.0)
    with pytest.raises(ValueError, match="query must be"):
        paged_attention(case.query[:1], case.k_cache, case.v_cache, case.inputs, 1.0)
    with pytest.raises(ValueError, match="block_size"):
        paged_attention_reference(
            case.query, case.k_cache.view(-1, 1, 2, 4), case.v_cache.view(-1, 1, 2, 4), case.inputs, 1.0
        )


@pytest.mark.cpu
def test_retained_cpu_memory_stops_page_faults_in_the_decode_gather():
    """With default glibc thresholds each call re-faults its ~8 MiB K/V gather (about 2,500 minor faults)."""
    if not retain_freed_cpu_memory():
        pytest.skip("not glibc: allocator thresholds cannot be tuned")
    case = build_case([(600, 1)] * 16, block_size=16, num_kv_heads=3, group=3, head_dim=64, seed=0)
    plan = plan_attention(case.inputs, case.k_cache, use_native=False)  # the path that gathers
    faults = []
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        paged_attention(case.query, case.k_cache, case.v_cache, case.inputs, 0.125, plan)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    # The heap grows to its high-water mark once (and may grow again while earlier tests' fragments settle);
    # untuned, every single call faults the whole gather in again.
    assert min(faults) < 200, faults
    assert retain_freed_cpu_memory()  # idempotent


@pytest.mark.cpu
def test_retained_cpu_memory_reuses_buffers_past_glibcs_mmap_threshold():
    """A buffer of 32 MiB or more (a 32-row decode step's logits over a 262,144-token vocabulary) was mapped
    and faulted in afresh on every allocation, whatever the threshold; from the heap it is reused."""
    if not retain_freed_cpu_memory():
        pytest.skip("not glibc: allocator settings cannot be tuned")
    faults = []
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(32, 262144).fill_(1.0)  # 32 MiB, written, freed
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    assert min(faults) < 100, faults  # mapped afresh: 8,192 faults of 4 KiB pages each time


def _resident_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


@pytest.mark.cpu
def test_released_cpu_memory_leaves_the_heap():
    """A one-off phase's freed buffers stay resident under the retaining settings until released."""
    if not retain_freed_cpu_memory():
        pytest.skip("not glibc: allocator settings cannot be tuned")
    buffers = [torch.ones(64, 262144) for _ in range(4)]  # 256 MiB, touched
    del buffers
    kept = _resident_mib()
    assert release_freed_cpu_memory()
    assert _resident_mib() < kept - 200


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "torch"])
@settings(max_examples=60)
@given(
    seqs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 9)), min_size=1, max_size=5),
    flags=st.lists(st.booleans(), min_size=5, max_size=5),
    block_size=st.integers(min_value=1, max_value=16),
    group=st.sampled_from([1, 2]),
    seed=st.integers(min_value=0, max_value=2**31 - 1),
)
def test_verification_rows_attend_token_by_token_like_decodes(
    use_native, seqs, flags, block_size, group, seed
):
    """A draft-verification row's tokens are planned as decodes (no prefill SDPA): each sees the keys
    through its own position, exactly as the reference, and as a single-token decode there would."""
    case = build_case(seqs, block_size, 2, group, 64, seed)
    verify = tuple(i for i, (_, q) in enumerate(seqs) if flags[i] and q > 1)
    inputs = dataclasses.replace(case.inputs, verify_rows=verify)
    plan = plan_attention(inputs, case.k_cache, use_native=use_native)
    planned_as_decodes = sum(q for i, (_, q) in enumerate(seqs) if q == 1 or i in verify)
    assert plan.decode_token_rows.numel() == planned_as_decodes
    assert len(plan.prefill) == sum(1 for i, (_, q) in enumerate(seqs) if q > 1 and i not in verify)
    scale = 64**-0.5
    fast = paged_attention(case.query, case.k_cache, case.v_cache, inputs, scale, plan)
    ref = paged_attention_reference(case.query, case.k_cache, case.v_cache, inputs, scale)
    assert (fast - ref).abs().max().item() <= 1e-5


def test_planning_a_packed_step_reads_its_lengths_from_the_host_copies():
    """A step packed for the meta device (no data to read back) plans without touching the device tensors:
    the lengths come from ``inputs.host``, so a CUDA plan costs no stream synchronisation."""
    from pagedgen.executor.inputs import SequenceChunk, pack_step

    chunks = [SequenceChunk([1, 2, 3], 5, [4, 7]), SequenceChunk([9], 0, [2])]
    inputs = pack_step(chunks, 4, device="meta")
    k_cache = torch.empty(8, 4, 2, 8, device="meta")
    plan = plan_attention(inputs, k_cache, use_native=False)
    cpu_plan = plan_attention(pack_step(chunks, 4), torch.empty(8, 4, 2, 8), use_native=False)
    assert [(r.start, r.end, r.kv_len) for r in plan.prefill] == [
        (r.start, r.end, r.kv_len) for r in cpu_plan.prefill
    ]
    assert plan.decode_token_rows.device.type == "meta" and plan.decode_token_rows.shape == (1,)


def test_write_kv_checks_a_device_step_on_the_host_copy_of_its_slots():
    k_cache, v_cache = torch.zeros(2, 2, 1, 2, device="meta"), torch.zeros(2, 2, 1, 2, device="meta")
    key = torch.ones(2, 1, 2, device="meta")
    slots = torch.tensor([1, 4], device="meta")
    with pytest.raises(IndexError, match="outside the cache's 4 slots"):
        write_kv(key, key, k_cache, v_cache, slots, host_slots=torch.tensor([1, 4]))
    write_kv(key, key, k_cache, v_cache, slots, host_slots=torch.tensor([1, 3]))


GROUPED_LAYOUTS = [(4, 1, 256), (9, 3, 64), (16, 2, 128), (6, 3, 96)]  # query heads, kv heads, head size


@pytest.mark.cpu
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), GROUPED_LAYOUTS)
def test_grouped_value_sums_have_the_per_head_bits(q_heads, kv_heads, head_dim):
    """The native decode kernel sums the values of a kv head's 2-8 query heads together; the same problem
    with every kv head repeated for its query heads (one query head per kv head) takes the per-head loop.
    The two give the same bits: the grouping changes what is read when, not the sums."""
    kernel = native.decode_kernel()
    if kernel is None:
        pytest.skip(native.native_status().detail)
    rows, block = 5, 16
    g = torch.Generator().manual_seed(q_heads * head_dim)
    lens = torch.tensor([1, 17, 40, 3, 64], dtype=torch.int32)
    tables = torch.randperm(rows * 4, generator=g).to(torch.int32).view(rows, 4)
    keys = torch.randn(rows * 4, block, kv_heads, head_dim, generator=g)
    values = torch.randn(rows * 4, block, kv_heads, head_dim, generator=g)
    query = torch.randn(rows, q_heads, head_dim, generator=g)
    token_rows = torch.arange(rows)
    grouped, per_head = torch.empty_like(query), torch.empty_like(query)
    kernel(query, keys, values, tables, lens, token_rows, 0.125, grouped)
    repeat = q_heads // kv_heads
    wide_keys = keys.repeat_interleave(repeat, dim=2).contiguous()
    wide_values = values.repeat_interleave(repeat, dim=2).contiguous()
    kernel(query, wide_keys, wide_values, tables, lens, token_rows, 0.125, per_head)
    assert torch.equal(grouped, per_head)
