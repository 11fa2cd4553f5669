"""Every decoder layer of a pure-decode step in one native call (``kernels/decoder_layers.c``).

Why: at batch 1 a decoder layer is ten microsecond-sized kernels; calling them one by one from Python, with
the tensor bookkeeping between them, cost about a quarter of a forward (docs/performance.md, "The fused decode
path"). :class:`FusedDecoder` runs the same kernels' arithmetic on the same kinds of buffers, from one C loop
over the layers, so its output is bit-identical to the per-layer path. Its threads share one OpenMP region for
the whole step (each owns a slice of every GEMM's columns and a run of kv heads) and meet at five barriers per
layer instead of forking and joining for every kernel. docs/performance.md, "Module notes: ops and bench", has
the rest.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedgen.core.step_inputs import StepInputs
from pagedgen.ops.kernels.native import native_library
from pagedgen.ops.layers.layer_ops import Activation
from pagedgen.ops.matmul.gemm_threads import torch_pool
from pagedgen.ops.matmul.quant_gemm import use_quant_kernel
from pagedgen.ops.matmul.qweight import QuantizedWeight
from pagedgen.ops.mixers.attention import AttentionPlan

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
MAX_SEGMENTS = 3  # of one fused matrix (kernels/decoder_layers.c)
SCRATCH_ROWS = 16  # steps of up to this many rows reuse one set of working buffers (FusedDecoder._scratch)


@dataclass
class FusedSteps:
    """How many forward steps ran every layer through the fused path (a process-wide counter)."""

    count: int = 0


FUSED_STEPS = FusedSteps()


class _Segment(ctypes.Structure):
    _fields_ = [("data", _P), ("row_bytes", _I64), ("qtype", _I64), ("rows", _I64)]


class _PackedWeight(ctypes.Structure):
    _fields_ = [("segments", _Segment * MAX_SEGMENTS), ("num_segments", _I64), ("bias", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _P),
        ("post_norm", _P),
        ("q_norm", _P),
        ("k_norm", _P),
        ("attn_out_norm", _P),
        ("mlp_out_norm", _P),
        ("qkv", _PackedWeight),
        ("o", _PackedWeight),
        ("gate_up", _PackedWeight),
        ("down", _PackedWeight),
        ("k_cache", _P),
        ("v_cache", _P),
        ("windowed", _I64),
        ("local_rope", _I64),
    ]


class _Dims(ctypes.Structure):
    _fields_ = [
        ("hidden", _I64),
        ("q_heads", _I64),
        ("kv_heads", _I64),
        ("head_dim", _I64),
        ("inner", _I64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("activation", _I64),
    ]


class _KVView(ctypes.Structure):
    _fields_ = [
        ("slots", _P),
        ("num_slots", _I64),
        ("tables", _P),
        ("table_stride", _I64),
        ("kv_lens", _P),
        ("kv_starts", _P),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("tokens", _I64),
        ("cos", _P),
        ("sin", _P),
        ("local_cos", _P),
        ("local_sin", _P),
        ("full", _KVView),
        ("window", _KVView),
        ("token_rows", _P),
        ("block_size", _I64),
        *((name, _P) for name in ("x", "delta", "qkv", "attn", "o", "gate_up", "act")),
    ]


Segments = tuple[QuantizedWeight, ...]  # one matrix's row ranges, stacked by output row, in order


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One layer's parameters as the per-layer path runs them; q/k/v and gate/up each one matrix given as
    its segments (one when the parts were fused into one weight, else the parts as stored).

    The norm weights are the ones the native RMSNorm multiplies by (Gemma's ``1 + weight`` already formed).
    """

    input_norm: torch.Tensor  # [hidden] fp32
    post_norm: torch.Tensor  # [hidden] fp32, before the MLP
    qkv: Segments  # rows sum to (Hq + 2 Hkv) D; each [rows, hidden]
    qkv_bias: torch.Tensor | None  # [(Hq + 2 Hkv) D]
    o: QuantizedWeight  # [hidden, Hq D]
    gate_up: Segments  # rows sum to 2 inner (gate first); each [rows, hidden]
    gate_up_bias: torch.Tensor | None
    down: QuantizedWeight  # [hidden, inner]
    down_bias: torch.Tensor | None
    windowed: bool = False  # a sliding-window layer: writes and reads through the step's window plan
    o_bias: torch.Tensor | None = None  # [hidden]
    q_norm: torch.Tensor | None = None  # [D] per-head RMSNorm of q before RoPE (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None  # [D] likewise of k; present exactly when q_norm is
    attn_out_norm: torch.Tensor | None = None  # [hidden] sandwich norm of o (Gemma)
    mlp_out_norm: torch.Tensor | None = None  # [hidden] sandwich norm of the MLP output (Gemma)
    local_rope: bool = False  # rotated with the step's local table (Gemma 3's local layers)


@dataclass(frozen=True, slots=True)
class DecoderDims:
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    inner: int
    eps: float
    scale: float
    activation: Activation = Activation.SILU


def _fp32_vector(t: torch.Tensor | None, size: int) -> bool:
    return t is None or (
        t.dtype is torch.float32 and t.device.type == "cpu" and t.is_contiguous() and t.shape == (size,)
    )


def _native_decode_only(plan: AttentionPlan | None, tokens: int) -> bool:
    """The plan reads every one of the step's ``tokens`` rows as a decode on the native kernel."""
    return (
        plan is not None
        and plan.kernel is not None
        and not plan.prefill
        and plan.decode_token_rows.shape[0] == tokens
    )


def _view(plan: AttentionPlan, slots: torch.Tensor, cache: torch.Tensor) -> _KVView:
    """Where the plan's layers write (``slots``, contiguous int64) and read the step's keys."""
    starts = plan.decode_starts
    return _KVView(
        slots.data_ptr(),
        cache.shape[0] * cache.shape[1],
        plan.decode_tables.data_ptr(),
        plan.decode_tables.shape[1],
        plan.decode_kv_lens.data_ptr(),
        None if starts is None else starts.data_ptr(),
    )


def _packed(segments: Segments, bias: torch.Tensor | None) -> _PackedWeight:
    packed = _PackedWeight(num_segments=len(segments), bias=None if bias is None else bias.data_ptr())
    for c, w in zip(packed.segments, segments, strict=False):
        c.data, c.row_bytes, c.qtype, c.rows = w.data.data_ptr(), w.data.shape[1], w.kernel_id, w.shape[0]
    return packed


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _segments_fit(segments: Segments, rows: int, k: int) -> bool:
    """1 to MAX_SEGMENTS stored-format weights of in size ``k`` whose rows sum to ``rows``."""
    return (
        0 < len(segments) <= MAX_SEGMENTS
        and all(isinstance(w, QuantizedWeight) and w.shape[1] == k for w in segments)
        and sum(w.shape[0] for w in segments) == rows
    )


class FusedDecoder:
    """The layers of one model, ready for :meth:`run`; holds references to every tensor it points into."""

    def __init__(self, function: ctypes._CFuncPtr, layers: Sequence[LayerWeights], dims: DecoderDims):
        self._fn = function
        self._weights = tuple(layers)
        self._dims = dims
        self._c_dims = _Dims(
            dims.hidden,
            dims.q_heads,
            dims.kv_heads,
            dims.head_dim,
            dims.inner,
            dims.eps,
            dims.scale,
            int(dims.activation),
        )
        self._c_layers = (_Layer * len(layers))()
        for c, w in zip(self._c_layers, layers, strict=True):
            c.input_norm, c.post_norm = w.input_norm.data_ptr(), w.post_norm.data_ptr()
            c.q_norm, c.k_norm = _ptr(w.q_norm), _ptr(w.k_norm)
            c.attn_out_norm, c.mlp_out_norm = _ptr(w.attn_out_norm), _ptr(w.mlp_out_norm)
            c.qkv, c.o = _packed(w.qkv, w.qkv_bias), _packed((w.o,), w.o_bias)
            c.gate_up, c.down = _packed(w.gate_up, w.gate_up_bias), _packed((w.down,), w.down_bias)
            c.windowed, c.local_rope = int(w.windowed), int(w.local_rope)
        self._windowed = any(w.windowed for w in layers)
        self._local_rope = any(w.local_rope for w in layers)
        # one weight per (format, shape): the quant kernel's use is decided per format and shape
        every = (w for lw in layers for w in (*lw.qkv, lw.o, *lw.gate_up, lw.down))
        self._distinct = tuple({(w.qtype, w.shape): w for w in every}.values())
        self._caches: tuple[int, ...] = ()  # the k/v cache pointers last written into _c_layers
        self._local = threading.local()  # each calling thread's scratch buffers (see _scratch)

    def _scratch(self, tokens: int) -> tuple[torch.Tensor, ...]:
        """The working buffers a step of ``tokens`` rows passes between a layer's kernels (q/k/v, attention,
        o, gate/up, activation products): written before they are read in every layer, never returned, so
        one set is kept for steps of up to ``SCRATCH_ROWS`` rows (where the allocations are a visible part
        of the host time) and reused while the row count stays; larger steps allocate their own, so no
        large buffer outlives its step. Per thread: two engines stepping one model from two threads
        (ctypes lets go of the GIL during the call) never share them."""
        buffers = getattr(self._local, "buffers", None)
        if buffers is not None and buffers[0].shape[0] == tokens:
            return buffers
        dims = self._dims
        q_width, kv_width = dims.q_heads * dims.head_dim, dims.kv_heads * dims.head_dim
        widths = (q_width + 2 * kv_width, q_width, dims.hidden, 2 * dims.inner, dims.inner)
        buffers = tuple(torch.empty(tokens, width, dtype=torch.float32) for width in widths)
        if tokens <= SCRATCH_ROWS:
            self._local.buffers = buffers
        return buffers

    def _cache_of(self, keys: Sequence[torch.Tensor], windowed: bool) -> torch.Tensor:
        """A cache of the full-attention (or sliding-window) layers; the first layer's when none is."""
        return next((k for k, w in zip(keys, self._weights, strict=True) if w.windowed == windowed), keys[0])

    @staticmethod
    def build(layers: Sequence[LayerWeights], dims: DecoderDims) -> FusedDecoder | None:
        """The fused runner for ``layers``, or ``None`` when a weight or the kernels do not allow it."""
        library = native_library()
        if library is None or not layers or not hasattr(library, "decoder_layers_f32"):
            return None
        q, kv, d, hidden = (
            dims.q_heads * dims.head_dim,
            dims.kv_heads * dims.head_dim,
            dims.head_dim,
            dims.hidden,
        )
        for w in layers:
            if not (
                _segments_fit(w.qkv, q + 2 * kv, hidden)
                and _segments_fit(w.gate_up, 2 * dims.inner, hidden)
                and _segments_fit((w.o,), hidden, q)
                and _segments_fit((w.down,), hidden, dims.inner)
            ):
                return None
            if (w.q_norm is None) != (w.k_norm is None) or w.input_norm is None or w.post_norm is None:
                return None
            vectors = ((w.input_norm, hidden), (w.post_norm, hidden), (w.qkv_bias, q + 2 * kv))
            vectors += ((w.gate_up_bias, 2 * dims.inner), (w.down_bias, hidden), (w.o_bias, hidden))
            vectors += ((w.q_norm, d), (w.k_norm, d), (w.attn_out_norm, hidden), (w.mlp_out_norm, hidden))
            if not all(_fp32_vector(t, n) for t, n in vectors):
                return None
        if d % 2 or dims.q_heads % dims.kv_heads:
            return None
        function = library.decoder_layers_f32
        function.argtypes = [ctypes.POINTER(_Layer), _I64, ctypes.POINTER(_Dims), ctypes.POINTER(_Step)]
        function.argtypes += [ctypes.c_int]
        function.restype = ctypes.c_int
        return FusedDecoder(function, layers, dims)

    def supports(
        self,
        x: torch.Tensor,
        inputs: StepInputs,
        plan: AttentionPlan,
        window_plan: AttentionPlan | None = None,
    ) -> bool:
        """Whether the per-layer path would run this step on exactly the kernels :meth:`run` calls.

        ``window_plan`` is the sliding-window layers' plan (required when the model has such layers).
        """
        tokens = inputs.num_tokens
        plans = (plan, window_plan) if self._windowed else (plan,)
        return (
            all(_native_decode_only(p, tokens) for p in plans)
            and x.dtype is torch.float32
            and x.device.type == "cpu"
            and all(use_quant_kernel(w, tokens) for w in self._distinct)
        )

    def run(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        inputs: StepInputs,
        plan: AttentionPlan,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        window_plan: AttentionPlan | None = None,
        local_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer over the step: ``(x, delta)`` as the per-layer loop leaves them (``x`` in place).

        ``local_rope`` is the cos/sin table of the layers built with ``local_rope`` (required then).

        Writes each layer's new K/V into ``keys``/``values`` (``[num_blocks, block_size, Hkv, D]`` fp32,
        contiguous; checked by :meth:`supports` through the plan): a full-attention layer through the
        step's slots and ``plan``, a sliding-window layer through ``window_plan`` (its ring's slots and its
        window). Raises ``IndexError`` for a slot outside its cache (nothing written), ``MemoryError`` when
        a kernel could not allocate.
        """
        dims, tokens = self._dims, inputs.num_tokens
        if len(keys) != len(self._c_layers) or len(values) != len(self._c_layers):
            raise ValueError(f"the fused decoder has {len(self._c_layers)} layers, the cache {len(keys)}")
        caches = tuple(k.data_ptr() for k in keys) + tuple(v.data_ptr() for v in values)
        if caches != self._caches:  # the layers' cache pointers, rewritten only when the caches moved
            for c, k, v in zip(self._c_layers, keys, values, strict=True):
                c.k_cache, c.v_cache = k.data_ptr(), v.data_ptr()
            self._caches = caches
        x = x.contiguous()
        cos, sin = (t.contiguous() for t in rope)
        slots = inputs.slot_mapping.to(torch.int64).contiguous()
        full = _view(plan, slots, self._cache_of(keys, windowed=False))
        window_slots, window = slots, _KVView()
        if self._windowed:
            if window_plan is None:
                raise ValueError("the model has sliding-window layers: run() needs their window_plan")
            ring_slots = inputs.slot_mapping if window_plan.slot_mapping is None else window_plan.slot_mapping
            window_slots = ring_slots.to(torch.int64).contiguous()
            window = _view(window_plan, window_slots, self._cache_of(keys, windowed=True))
        local_cos = local_sin = None
        if self._local_rope:
            if local_rope is None:
                raise ValueError("the model has layers with their own RoPE: run() needs their local_rope")
            local_cos, local_sin = (t.contiguous() for t in local_rope)
        delta = torch.empty(tokens, dims.hidden, dtype=torch.float32)  # returned: the caller's
        qkv, attn, o, gate_up, act = self._scratch(tokens)
        step = _Step(
            tokens,
            cos.data_ptr(),
            sin.data_ptr(),
            _ptr(local_cos),
            _ptr(local_sin),
            full,
            window,
            plan.decode_token_rows.data_ptr(),
            keys[0].shape[1],
            *(t.data_ptr() for t in (x, delta, qkv, attn, o, gate_up, act)),
        )
        torch_pool.restore()
        failed = self._fn(self._c_layers, len(self._c_layers), self._c_dims, step, torch.get_num_threads())
        if failed == -3:
            rings = f"; the window layers' ring slots: {window_slots.tolist()}" if self._windowed else ""
            raise IndexError(f"write_kv: a slot of {slots.tolist()} is outside the cache{rings}")
        if failed:
            raise MemoryError(f"decoder_layers_f32 failed ({failed})")
        FUSED_STEPS.count += 1
        return x, delta
