"""The Triton paged-attention kernels against the oracle and the torch paths, and how they are selected.

Here (no GPU) the kernels run under Triton's interpreter on CPU tensors: ``tests/conftest.py`` turns it on
before triton is first imported. With CUDA present the same tests run the compiled kernels on the GPU.
Cases are small on purpose: the interpreter runs each program in numpy, one tile at a time.

Oracles: :func:`paged_attention_reference` (float32, one token at a time) where it applies, otherwise the
CPU torch path of :func:`paged_attention` (sliding windows, soft-capping), which its own tests check
against dense attention.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pagedgen.executor.inputs import SequenceChunk, pack_step
from pagedgen.ops.mixers import triton_attention
from pagedgen.ops.mixers.attention import paged_attention, paged_attention_reference, plan_attention
from pagedgen.ops.mixers.triton_attention import TRITON_ENV

pytestmark = pytest.mark.skipif(
    not triton_attention.triton_importable(), reason="triton is not installed (the `test` extra brings it)"
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _one_thread_and_triton(monkeypatch):
    """Tiny tensors: one intra-op thread. The kernels are forced on, CPU tensors included."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv(TRITON_ENV, "1")
    yield
    torch.set_num_threads(previous)


@dataclass(slots=True)
class Case:
    """A step over shuffled blocks of a noise-filled cache (fp32, CPU); the kernels read it on ``DEVICE``."""

    chunks: list[SequenceChunk]
    block_size: int
    query: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor


def make_case(
    seqs: list[tuple[int, int]],
    block_size: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    seed: int = 0,
    verify: tuple[int, ...] = (),
) -> Case:
    """``seqs`` holds ``(past_len, query_len)`` per request; rows in ``verify`` are draft-verification rows.

    Every slot of the cache is noise, spare blocks included, so a read through a wrong block or past a
    row's keys changes the result.
    """
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(past + q) // block_size) for past, q in seqs]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    chunks, start = [], 0
    for i, ((past, q), n) in enumerate(zip(seqs, need, strict=True)):
        chunks.append(SequenceChunk([0] * q, past, perm[start : start + n], all_logits=i in verify))
        start += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    tokens = sum(q for _, q in seqs)
    query = torch.randn(tokens, kv_heads * group, head_dim, generator=gen)
    return Case(chunks, block_size, query, k_cache, v_cache)


def torch_path(case: Case, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """The CPU torch path in float32 (the kernels switched off for the call)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TRITON_ENV, "0")
        inputs = pack_step(case.chunks, case.block_size)
        plan = plan_attention(inputs, case.k_cache, window=window)
        assert plan.triton is None
        scale = case.query.shape[2] ** -0.5
        return paged_attention(case.query, case.k_cache, case.v_cache, inputs, scale, plan, softcap=softcap)


def triton_path(
    case: Case,
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    strided_query: bool = False,
) -> torch.Tensor:
    """The kernels on ``DEVICE`` in ``dtype``; the result back on the CPU in float32."""
    inputs = pack_step(case.chunks, case.block_size, device=DEVICE)
    k_cache = case.k_cache.to(DEVICE, dtype)
    v_cache = case.v_cache.to(DEVICE, dtype)
    query = case.query.to(DEVICE, dtype)
    if strided_query:  # a view into a fused q/k/v product, as models pass it
        tokens, heads, dim = query.shape
        fused = torch.cat(
            [query.reshape(tokens, -1), torch.zeros(tokens, 2 * dim, dtype=dtype, device=DEVICE)], 1
        )
        query = fused[:, : heads * dim].view(tokens, heads, dim)
        assert not query.is_contiguous()
    plan = plan_attention(inputs, k_cache, window=window)
    assert plan.triton is not None and plan.kernel is None and not plan.prefill
    if num_splits is not None:
        plan.triton.num_splits = num_splits
    out = paged_attention(query, k_cache, v_cache, inputs, query.shape[2] ** -0.5, plan, softcap=softcap)
    assert out.dtype == dtype and out.shape == query.shape
    return out.float().cpu()


def reference(case: Case) -> torch.Tensor:
    inputs = pack_step(case.chunks, case.block_size)
    scale = case.query.shape[2] ** -0.5
    return paged_attention_reference(case.query, case.k_cache, case.v_cache, inputs, scale)


# Decode rows at block boundaries and inside blocks, first prefills, a prefill after a cached prefix, a
# two-token row planned as a prefill, a one-key row.
MIXED = [(37, 1), (0, 21), (70, 1), (19, 18), (0, 1), (31, 2), (64, 1)]


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_a_mixed_step_matches_the_reference(block_size, group):
    case = make_case(MIXED, block_size, kv_heads=2, group=group, head_dim=64, seed=block_size + group)
    assert (triton_path(case) - reference(case)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("head_dim", [16, 40, 80, 128])
def test_head_dims_of_any_size_match_the_reference(head_dim):
    """Non-powers of two are padded to the next one inside the kernels and masked."""
    case = make_case([(21, 1), (9, 13)], 16, kv_heads=1, group=2, head_dim=head_dim, seed=head_dim)
    assert (triton_path(case) - reference(case)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("block_size", [1, 3, 8])
def test_small_and_odd_block_sizes_match_the_reference(block_size):
    """Keys are looked up one by one through the table, so a tile spans blocks of any size."""
    case = make_case([(40, 1), (11, 6)], block_size, kv_heads=2, group=2, head_dim=16, seed=3)
    assert (triton_path(case) - reference(case)).abs().max().item() <= 1e-5


def test_prefill_after_a_cached_prefix_sees_the_prefix_and_itself_causally():
    """A prefix-cache hit or a later chunk: 70 new queries at positions 45..114 (two work-list entries,
    each split over programs of 16 queries x 4 padded heads, some of which have no query)."""
    case = make_case([(45, 70), (0, 33)], 16, kv_heads=2, group=3, head_dim=64, seed=7)
    plan = plan_attention(pack_step(case.chunks, 16, device=DEVICE), case.k_cache.to(DEVICE))
    assert plan.triton.prefill_blocks.tolist() == [[0, 0, 64, 45], [0, 64, 6, 109], [1, 70, 33, 0]]
    assert (triton_path(case) - reference(case)).abs().max().item() <= 1e-5


def test_draft_verification_rows_attend_as_decodes():
    """Each draft token sees the keys through its own position, planned as a decode entry."""
    case = make_case([(30, 5), (12, 1), (0, 9), (7, 3)], 8, kv_heads=2, group=3, head_dim=64, verify=(0, 3))
    inputs = pack_step(case.chunks, case.block_size, device=DEVICE)
    plan = plan_attention(inputs, case.k_cache.to(DEVICE))
    assert plan.triton.decode_entries == 5 + 1 + 3
    assert plan.triton.prefill_blocks[:, 2].tolist() == [9]  # the one plain prefill row
    assert (triton_path(case) - reference(case)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("window", [1, 7, 20])
@pytest.mark.parametrize("block_size", [8, 16])
def test_sliding_windows_match_the_torch_path(window, block_size):
    """Windows read through the block tables: decode starts inside a block, prefill rows masked per query."""
    case = make_case([(53, 1), (6, 1), (30, 19), (0, 12), (17, 2)], block_size, 2, 2, 64, seed=window)
    expected = torch_path(case, window=window)
    assert (triton_path(case, window=window) - expected).abs().max().item() <= 1e-5


@pytest.mark.skipif(DEVICE.type != "cpu", reason="the window-ring cases are built on CPU tensors")
@pytest.mark.parametrize("ring", [True, False])
def test_window_rings_match_dense_window_attention(ring):
    """Rings filled as the engine fills them (oldest positions overwritten), the windowed suite's builder."""
    from tests.helpers.window_attention import run_case

    seqs = [(0, 1), (9, 1), (22, 1), (33, 1), (5, 7), (40, 9)]
    plan = run_case(seqs, 7, 4, 2, 2, 64, seed=5, ring=ring, use_native=True)
    assert plan.triton is not None and plan.triton.window == 7
    run_case(seqs, 7, 4, 2, 2, 16, seed=6, ring=ring, use_native=True, softcap=1.5)


def test_soft_capped_scores_match_the_torch_path():
    case = make_case([(29, 1), (0, 17), (12, 6)], 8, kv_heads=2, group=2, head_dim=64, seed=11)
    case.query *= 4  # scores of a few units, where the cap bends them
    expected = torch_path(case, softcap=2.0)
    assert (triton_path(case, softcap=2.0) - expected).abs().max().item() <= 1e-5
    windowed = torch_path(case, window=5, softcap=2.0)
    assert (triton_path(case, window=5, softcap=2.0) - windowed).abs().max().item() <= 1e-5


@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_split_kv_decode_equals_one_pass(num_splits):
    """Flash-decoding: slices of a row's keys merged by the combine kernel, trailing slices empty."""
    case = make_case([(150, 1), (3, 1), (64, 1), (20, 4)], 16, kv_heads=2, group=3, head_dim=64, seed=2)
    assert (triton_path(case, num_splits=num_splits) - reference(case)).abs().max().item() <= 1e-5
    expected = torch_path(case, window=40)
    assert (triton_path(case, window=40, num_splits=num_splits) - expected).abs().max().item() <= 1e-5


def test_a_strided_query_view_is_read_in_place():
    case = make_case([(25, 1), (4, 9)], 8, kv_heads=2, group=2, head_dim=64, seed=4)
    assert (triton_path(case, strided_query=True) - reference(case)).abs().max().item() <= 1e-5


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float16, 4e-3), (torch.bfloat16, 3e-2)])
def test_half_precision_matches_the_reference_on_the_rounded_inputs(dtype, tolerance):
    """fp16 multiplies in fp16 tiles as on the GPU; bf16 (the interpreter cannot multiply it) in fp32 tiles
    here, in bf16 tiles on the GPU. Accumulation is fp32 either way: the error is about one rounding."""
    case = make_case(MIXED[:5], 16, kv_heads=2, group=3, head_dim=64, seed=9)
    rounded = Case(
        case.chunks,
        case.block_size,
        case.query.to(dtype).float(),
        case.k_cache.to(dtype).float(),
        case.v_cache.to(dtype).float(),
    )
    assert (triton_path(case, dtype=dtype) - reference(rounded)).abs().max().item() <= tolerance


def test_the_call_reads_no_device_value_on_the_host():
    """Decode, split-KV combine and prefill launches with every host read of a tensor made to fail: what the
    kernels need is in the plan (on CUDA each such read would be a stream synchronisation)."""
    case = make_case([(30, 5), (12, 1), (0, 9)], 8, kv_heads=2, group=3, head_dim=64, verify=(0,))
    inputs = pack_step(case.chunks, 8, device=DEVICE)
    k_cache, v_cache, query = (t.to(DEVICE) for t in (case.k_cache, case.v_cache, case.query))
    plan = plan_attention(inputs, k_cache, window=6)
    plan.triton.num_splits = 2

    def host_read(*args, **kwargs):
        raise AssertionError("a device value was read on the host")

    with pytest.MonkeyPatch.context() as patch:
        for name in ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"):
            patch.setattr(torch.Tensor, name, host_read)
        out = paged_attention(query, k_cache, v_cache, inputs, 0.125, plan, softcap=3.0)
    expected = paged_attention(
        query, k_cache, v_cache, inputs, 0.125, plan_attention(inputs, k_cache, window=6), softcap=3.0
    )
    assert (out - expected).abs().max().item() <= 1e-5


def test_selection_follows_the_switch_and_the_device(monkeypatch):
    case = make_case([(3, 1)], 8, kv_heads=1, group=1, head_dim=16)
    inputs = pack_step(case.chunks, 8)
    monkeypatch.setenv(TRITON_ENV, "0")
    assert plan_attention(inputs, case.k_cache).triton is None
    monkeypatch.setenv(TRITON_ENV, "auto")
    assert plan_attention(inputs, case.k_cache).triton is None  # CPU tensors: only when forced
    if torch.cuda.is_available():
        assert triton_attention.triton_selected(torch.device("cuda"))
    monkeypatch.setenv(TRITON_ENV, "yes")
    with pytest.raises(ValueError, match="PAGEDGEN_TRITON_ATTENTION must be 0, 1 or auto, got 'yes'"):
        plan_attention(inputs, case.k_cache)
    monkeypatch.setenv(TRITON_ENV, "1")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_attention, "triton_interpreting", lambda: False)
        with pytest.raises(RuntimeError, match="on cpu tensors needs Triton's interpreter"):
            triton_attention.triton_selected(torch.device("cpu"))
    monkeypatch.setattr(triton_attention, "_importable", False)
    with pytest.raises(
        RuntimeError, match="forces the Triton attention kernels, but triton is not installed"
    ):
        plan_attention(inputs, case.k_cache)
    monkeypatch.setenv(TRITON_ENV, "auto")
    assert not triton_attention.triton_selected(torch.device("cuda"))


def test_unsupported_dtypes_are_refused_by_name():
    case = make_case([(3, 1)], 8, kv_heads=1, group=1, head_dim=16)
    inputs = pack_step(case.chunks, 8)
    plan = plan_attention(inputs, case.k_cache)
    with pytest.raises(ValueError, match="query is torch.float64"):
        paged_attention(case.query.double(), case.k_cache, case.v_cache, inputs, 0.25, plan)


def test_pagedgen_imports_and_attends_without_triton():
    """Triton is optional: with it unimportable the default rule never selects it, the torch path serves."""
    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "import pagedgen\n"
        "from pagedgen.executor.inputs import SequenceChunk, pack_step\n"
        "from pagedgen.ops.mixers.attention import paged_attention, plan_attention\n"
        "inputs = pack_step([SequenceChunk([0], 3, [0])], 4)\n"
        "k = torch.randn(1, 4, 1, 8)\n"
        "plan = plan_attention(inputs, k)\n"
        "assert plan.triton is None\n"
        "paged_attention(torch.randn(1, 2, 8), k, k, inputs, 0.3, plan)\n"
        "assert 'triton' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok')\n"
    )
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", TRITON_ENV: "auto"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
