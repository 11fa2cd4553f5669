"""The Triton paged-attention backend: when it is selected, its host-side plan, and the kernel launches.

Why this shape: Triton stays optional (nothing imports it until a plan selects it), one process runs Triton
one way (compiled or interpreted, fixed when it is first imported), and the launches read no device value on
the host, so a step on CUDA never waits for the device to plan its attention. docs/performance.md, "Module
notes: ops and bench", has the rest.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import threading
from dataclasses import dataclass
from types import ModuleType

import torch

TRITON_ENV = "PAGEDGEN_TRITON_ATTENTION"
BLOCK_Q = 64  # query tokens per prefill work-list entry
PREFILL_ROWS = 64  # rows (query tokens x padded group heads) of a prefill program's tile
TILE = 32  # keys per inner-loop step
MAX_SPLITS = 16
SPLIT_MIN_KEYS = 256  # a split reads at least this many keys: fewer would cost more to combine than to read
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_KERNELS = "pagedgen.ops.kernels.triton_kernels"
_lock = threading.Lock()
_importable: bool | None = None


def triton_importable() -> bool:
    """Whether ``import triton`` works here (checked once)."""
    global _importable
    if _importable is None:
        try:
            import triton  # noqa: F401

            _importable = True
        except Exception:  # missing, or a broken install (as good as none): the torch path serves
            _importable = False
    return _importable


def triton_selected(device: torch.device) -> bool:
    """Whether attention over a cache on ``device`` runs on the Triton kernels (module docstring).

    Raises ``ValueError`` for an unknown ``PAGEDGEN_TRITON_ATTENTION`` value and ``RuntimeError`` when it
    forces the kernels (``1``) but Triton is not installed, or for CPU tensors when this process's Triton
    is not interpreting (:func:`triton_interpreting`): better refused at planning than failed in a kernel.
    """
    mode = os.environ.get(TRITON_ENV, "auto").strip().lower() or "auto"
    if mode not in ("0", "1", "auto"):
        raise ValueError(f"{TRITON_ENV} must be 0, 1 or auto, got {mode!r}")
    if mode == "0":
        return False
    if mode == "1":
        if not triton_importable():
            raise RuntimeError(
                f"{TRITON_ENV}=1 forces the Triton attention kernels, but triton is not installed"
            )
        if device.type != "cuda" and not triton_interpreting():
            raise RuntimeError(
                f"{TRITON_ENV}=1 on {device.type} tensors needs Triton's interpreter: set "
                "TRITON_INTERPRET=1 before triton is first imported"
            )
        return True
    return device.type == "cuda" and triton_importable()


@functools.cache
def triton_interpreting() -> bool:
    """Whether this process's Triton runs kernels in its interpreter (on the CPU).

    Triton fixes that when ``triton.language`` is first imported: its own helpers (``tl.sum``, ``tl.max``,
    ``tl.zeros``...) are decorated then, from ``TRITON_INTERPRET``, and an interpreted kernel cannot call
    compiled helpers. So the interpreter needs ``TRITON_INTERPRET=1`` before anything imports triton
    (``tests/conftest.py`` sets it on machines without CUDA).
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.sum, InterpretedFunction)


def _kernels() -> ModuleType:
    """:mod:`pagedgen.ops.kernels.triton_kernels`, imported on first use and decorated in the mode of this
    process's Triton (:func:`triton_interpreting`), whatever ``TRITON_INTERPRET`` says by now."""
    with _lock:
        module = sys.modules.get(_KERNELS)
        if module is not None:
            return module
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if triton_interpreting() else "0"
        try:
            return importlib.import_module(_KERNELS)
        finally:
            if previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = previous


@dataclass(slots=True)
class TritonPlan:
    """What the Triton launches need beyond the decode fields of :class:`AttentionPlan`, built on the host.

    ``num_splits`` may be changed after planning (tests force split-KV on small cases); it must stay the
    same for every replay of a captured CUDA graph, so a graph's plan derives it from the bucket's bound.
    """

    decode_entries: int  # grid axis 0 of the decode kernel
    num_splits: int  # split-KV slices per decode entry (1: no combine kernel)
    prefill_blocks: torch.Tensor  # [NB, 4] int32: (prefill row, first flat token, query count, first key)
    prefill_tables: torch.Tensor  # [P, W] int32: each multi-token row's table from its first readable block
    window: int | None


def prefill_work(
    q_lens: list[int], past: list[int], cu: list[int], first_pos: list[int], decode_rows: set[int]
) -> tuple[list[int], list[int]]:
    """The prefill kernel's work list, flattened ``[NB * 4]``: per ``BLOCK_Q`` queries of every multi-token
    row, ``(its index among those rows, first flat token, query count, first query's key index)``; and the
    step rows of those multi-token rows (whose tables the plan gathers). Host arithmetic only."""
    prefill_rows = [i for i in range(len(q_lens)) if i not in decode_rows]
    work: list[int] = []
    for p, i in enumerate(prefill_rows):
        for j in range(0, q_lens[i], BLOCK_Q):
            work += (p, cu[i] + j, min(BLOCK_Q, q_lens[i] - j), past[i] + j - first_pos[i])
    return work, prefill_rows


def decode_splits(programs: int, max_keys: int, device: torch.device) -> int:
    """Split-KV slices per decode entry: enough programs to fill the GPU's SMs when the step has few rows
    and long histories, each slice at least ``SPLIT_MIN_KEYS`` keys. Host values only (the SM count is a
    cached device property). Always 1 off CUDA, where the interpreter gains nothing from splitting."""
    if device.type != "cuda" or programs == 0:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= sms:
        return 1
    return max(1, min(MAX_SPLITS, -(-sms // programs), max_keys // SPLIT_MIN_KEYS))


def check_supported(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Raise ``ValueError`` for tensors these kernels cannot read (the message says which)."""
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"Triton attention supports float32/float16/bfloat16, {name} is {t.dtype}")
        if t.device != k_cache.device:
            raise ValueError(f"Triton attention: {name} is on {t.device}, the cache on {k_cache.device}")


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _dot_config(query: torch.Tensor, interpret: bool) -> tuple[object, str]:
    """The dtype fed to ``tl.dot`` and its precision.

    fp32 multiplies in IEEE fp32 (never TF32: fp32 results must match the oracle tightly). Half dtypes use
    the tensor cores on a GPU; the interpreter cannot multiply bfloat16 (it computes on the raw bits), so
    there bfloat16 tiles are widened to fp32 first. float16 runs as on the GPU.
    """
    import triton.language as tl

    if query.dtype is torch.float16:
        return tl.float16, "tf32"
    if query.dtype is torch.bfloat16 and not interpret:
        return tl.bfloat16, "tf32"
    return tl.float32, "ieee"


def triton_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    token_rows: torch.Tensor,
    tables: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_starts: torch.Tensor | None,
    plan: TritonPlan,
    scale: float,
    softcap: float | None,
    out: torch.Tensor,
) -> None:
    """Write the attention of every query row into ``out [T, Hq, D]``: decode entries (``token_rows``,
    ``tables``, ``kv_lens``, ``kv_starts`` of the attention plan) and the plan's prefill blocks.

    Reads the caches only; launches at most three kernels and never reads a device value on the host.
    """
    check_supported(query, k_cache, v_cache)
    kernels = _kernels()
    interpret = triton_interpreting()
    dot_dtype, precision = _dot_config(query, interpret)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group = query.shape[1] // num_kv_heads
    d_pad = max(16, _next_pow2(head_dim))
    common = dict(
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=k_cache.shape[1],
        TILE=TILE,
        HAS_SOFTCAP=softcap is not None,
        DOT_DTYPE=dot_dtype,
        PRECISION=precision,
    )
    strides = (*query.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride())
    cap = 0.0 if softcap is None else float(softcap)
    if plan.decode_entries:
        _launch_decode(
            kernels,
            query,
            k_cache,
            v_cache,
            token_rows,
            tables,
            kv_lens,
            kv_starts,
            plan,
            scale,
            cap,
            out,
            strides,
            group,
            common,
        )
    num_blocks = plan.prefill_blocks.shape[0]
    if num_blocks:
        group_pad = _next_pow2(group)
        sub_q = max(1, min(BLOCK_Q, PREFILL_ROWS // group_pad))
        kernels.paged_prefill_kernel[(num_blocks, num_kv_heads, BLOCK_Q // sub_q)](
            out,
            query,
            k_cache,
            v_cache,
            plan.prefill_blocks,
            plan.prefill_tables,
            plan.window or 0,
            scale,
            cap,
            *strides,
            plan.prefill_tables.stride(0),
            GROUP=group,
            GROUP_PAD=group_pad,
            SUB_Q=sub_q,
            HAS_WINDOW=plan.window is not None,
            **common,
        )


def _launch_decode(
    kernels: ModuleType,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    token_rows: torch.Tensor,
    tables: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_starts: torch.Tensor | None,
    plan: TritonPlan,
    scale: float,
    cap: float,
    out: torch.Tensor,
    strides: tuple[int, ...],
    group: int,
    common: dict,
) -> None:
    """The decode kernel, and with split-KV its partials (float32 scratch) and the combine kernel."""
    entries, splits = plan.decode_entries, plan.num_splits
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    num_heads = query.shape[1]
    part_acc = part_ml = out  # placeholders: never read or written with one split
    if splits > 1:
        part_acc = torch.empty(entries, num_heads, splits, head_dim, dtype=torch.float32, device=out.device)
        part_ml = torch.empty(entries, num_heads, splits, 2, dtype=torch.float32, device=out.device)
    starts = kv_lens if kv_starts is None else kv_starts  # placeholder when there is no window
    kernels.paged_decode_kernel[(entries, num_kv_heads, splits)](
        out,
        query,
        k_cache,
        v_cache,
        token_rows,
        tables,
        kv_lens,
        starts,
        part_acc,
        part_ml,
        scale,
        cap,
        *strides,
        tables.stride(0),
        GROUP=group,
        GROUP_PAD=max(16, _next_pow2(group)),
        NUM_SPLITS=splits,
        HAS_START=kv_starts is not None,
        **common,
    )
    if splits > 1:
        kernels.combine_splits_kernel[(entries, num_heads)](
            out,
            token_rows,
            part_acc,
            part_ml,
            *out.stride(),
            NUM_SPLITS=splits,
            SPLITS_PAD=_next_pow2(splits),
            HEAD_DIM=head_dim,
            D_PAD=common["D_PAD"],
        )
