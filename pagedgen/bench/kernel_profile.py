"""``pagedgen bench kernels``: one batch-1 decode forward split per kernel, against the machine's bandwidth.

Why: at batch 1 every weight is read once per token, so a decode step is bounded by memory traffic, not by
FLOPs. For each kernel this reports the bytes it moves per forward (its weight blocks as stored, the K/V it
reads, its activations), the time it takes, the GB/s that makes, and the time the machine's measured streaming
read bandwidth would need for those bytes (the roofline): what is left on the table, per kernel.
docs/performance.md, "Module notes: ops and bench", has the rest.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedgen.core.json_value import JsonObject

if TYPE_CHECKING:
    from pagedgen.core.kv import PagedKVCache
    from pagedgen.core.step_inputs import StepInputs
    from pagedgen.models.model import Model
    from pagedgen.ops.matmul.qweight import QuantizedWeight

LINEAR_ROLES = {
    "qkv": "qkv",
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "o_proj": "o",
    "gate_up": "gate_up",
    "gate_proj": "gate_up",
    "up_proj": "gate_up",
    "down_proj": "down",
    "lm_head": "head",
}
BLOCK_SIZE = 16
STREAM_BYTES = 256 * 2**20


@dataclass(frozen=True, slots=True)
class ModuleRole:
    """What one hooked module is in the profile: its kernel group and the bytes it moves per forward."""

    group: str  # e.g. "down Q4_K", "attention", "norms"
    bytes_moved: int


@dataclass(slots=True)
class KernelRow:
    """One line of the table: a kernel group over a whole forward."""

    group: str
    calls: int  # module calls per forward
    seconds: float  # median over the repeats of the group's summed time per forward
    bytes_moved: int

    def gb_per_s(self) -> float | None:
        return self.bytes_moved / self.seconds / 1e9 if self.seconds > 0 and self.bytes_moved else None

    def to_dict(self, bandwidth: float | None) -> JsonObject:
        floor = None if not bandwidth or not self.bytes_moved else self.bytes_moved / bandwidth
        return {
            "group": self.group,
            "calls": self.calls,
            "ms": self.seconds * 1e3,
            "bytes": self.bytes_moved,
            "gb_per_s": self.gb_per_s(),
            "roofline_ms": None if floor is None else floor * 1e3,
            "roofline_fraction": None if floor is None or self.seconds <= 0 else floor / self.seconds,
        }


@dataclass(slots=True)
class KernelProfile:
    """Everything ``pagedgen bench kernels`` measured for one model."""

    model: str
    weights: str
    context: int
    repeats: int
    bandwidth: float | None  # bytes/s of a streaming read on the bench's threads
    forward_s: dict[str, dict[str, float]] = field(default_factory=dict)  # path -> {"best", "median"}
    rows: list[KernelRow] = field(default_factory=list)

    @property
    def bytes_per_forward(self) -> int:
        return sum(r.bytes_moved for r in self.rows)

    def to_dict(self) -> JsonObject:
        floor = None if not self.bandwidth else self.bytes_per_forward / self.bandwidth
        return {
            "model": self.model,
            "weights": self.weights,
            "context": self.context,
            "repeats": self.repeats,
            "stream_gb_per_s": None if not self.bandwidth else self.bandwidth / 1e9,
            "bytes_per_forward": self.bytes_per_forward,
            "roofline_forward_ms": None if floor is None else floor * 1e3,
            "forward_ms": {p: {k: v * 1e3 for k, v in t.items()} for p, t in self.forward_s.items()},
            "kernels": [r.to_dict(self.bandwidth) for r in self.rows],
        }


def measure_stream_bandwidth(nbytes: int = STREAM_BYTES, repeats: int = 10) -> float:
    """Bytes/s of ``torch.sum`` over a buffer far larger than the caches, on torch's threads (best of).

    A streaming read is what a batch-1 forward does to its weights, so this is the roofline's slope."""
    if nbytes <= 0 or repeats <= 0:
        raise ValueError(f"nbytes and repeats must be positive, got {nbytes}, {repeats}")
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)  # [n] touched once: no page faults in the loop
    buffer.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best


def weight_format(weight: torch.Tensor | QuantizedWeight) -> str:
    """``Q4_K`` for a weight kept as stored, else the tensor's dtype (``f32``, ``bf16``)."""
    qtype = getattr(weight, "qtype", None)
    if qtype is not None:
        return str(qtype.name)
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}.get(weight.dtype, "?")


def weight_bytes(weight: torch.Tensor | QuantizedWeight) -> int:
    nbytes = getattr(weight, "nbytes", None)
    return int(nbytes) if nbytes is not None else int(weight.numel() * weight.element_size())


def _tensor_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else int(t.numel() * t.element_size())


def module_roles(runtime: nn.Module, context: int) -> dict[nn.Module, ModuleRole]:
    """Each module of the decoder that the profile times, with its group and bytes per 1-row forward.

    ``context``: the K/V positions an attention layer reads (the windowed ones at most their window).
    A Linear reads its weight and bias and an input row and writes an output row; an attention layer
    reads K and V of its context and writes one position of each; a norm reads and writes a row and reads
    its weight; the embedding reads one row of its table.
    """
    config = runtime.config
    kv_bytes = config.num_kv_heads * config.head_dim * 4  # one position of K (or V), fp32 cache
    window = getattr(config, "sliding_window", None)
    roles: dict[nn.Module, ModuleRole] = {}
    for name, module in runtime.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        kind = type(module).__name__
        if leaf in LINEAR_ROLES and hasattr(module, "weight"):
            w = module.weight
            out, inp = w.shape
            moved = weight_bytes(w) + _tensor_bytes(getattr(module, "bias", None)) + 4 * (out + inp)
            roles[module] = ModuleRole(f"{LINEAR_ROLES[leaf]} {weight_format(w)}", moved)
        elif leaf == "embed_tokens":
            w = module.weight
            roles[module] = ModuleRole("embedding", weight_bytes(w) // w.shape[0] + 4 * w.shape[1])
        elif leaf == "self_attn":
            windowed = getattr(runtime.model.layers[int(name.split(".")[2])], "windowed", False)
            positions = min(context + 1, window) if windowed and window else context + 1
            q = config.num_heads * config.head_dim * 4
            roles[module] = ModuleRole("attention", 2 * kv_bytes * (positions + 1) + 3 * q)
        elif leaf == "mlp":
            roles[module] = ModuleRole("activation", 3 * config.intermediate_size * 4)
        elif kind.endswith("Norm") or kind.endswith("RMSNorm"):
            dim = module.weight.shape[0]
            roles[module] = ModuleRole("norms", 4 * dim * 3)
        elif kind.endswith("DecoderLayer"):
            roles[module] = ModuleRole("residual + norm", 4 * config.hidden_size * 6)
        elif leaf.startswith("rotary_emb"):
            roles[module] = ModuleRole("rotary tables", 0)
    return roles


AddNorm = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # a norm's add_forward


class ModuleClock:
    """Forward hooks timing every role module: inclusive times, children subtracted into exclusive ones."""

    def __init__(self, roles: dict[nn.Module, ModuleRole], clock: Callable[[], float] = time.perf_counter):
        self.roles = roles
        self.clock = clock
        self._stack: list[list[float]] = []  # [start, children's time]
        self.exclusive: dict[nn.Module, float] = {}
        self.calls: dict[nn.Module, int] = {}

    def _pre(self, module: nn.Module, args: tuple[object, ...]) -> None:
        self._stack.append([self.clock(), 0.0])

    def _post(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        start, children = self._stack.pop()
        elapsed = self.clock() - start
        if self._stack:
            self._stack[-1][1] += elapsed
        self.exclusive[module] = self.exclusive.get(module, 0.0) + elapsed - children
        self.calls[module] = self.calls.get(module, 0) + 1

    @contextmanager
    def attached(self) -> Iterator[None]:
        handles = []
        adds = [m for m, role in self.roles.items() if role.group == "norms" and hasattr(m, "add_forward")]
        for module in self.roles:
            handles.append(module.register_forward_pre_hook(self._pre))
            handles.append(module.register_forward_hook(self._post))
        for module in adds:
            module.add_forward = self._top_level_add(module, module.add_forward)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for module in adds:
                del module.add_forward  # the instance attribute shadowed the method

    def _top_level_add(self, module: nn.Module, add: AddNorm) -> AddNorm:
        """``add`` (a norm's fused add + norm) timed as the norm's own call when it is called outside every
        role module: the final add + norm, which the forward calls directly rather than through the module's
        hooks. Inside a decoder layer it stays that layer's own time, as before."""

        def timed(residual: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if self._stack:
                return add(residual, delta)
            self._pre(module, ())
            out = add(residual, delta)
            self._post(module, (), out)
            return out

        return timed

    def reset(self) -> None:
        self._stack.clear()
        self.exclusive.clear()
        self.calls.clear()


@contextmanager
def timed_head(runtime: nn.Module, sink: list[float]) -> Iterator[None]:
    """Wrap the runtime's ``_head`` (the LM head GEMM, called outside any module) to time each call."""
    head: Callable[[torch.Tensor], torch.Tensor] = runtime._head

    def timed(x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = head(x)
        sink.append(time.perf_counter() - start)
        return out

    runtime._head = timed  # an instance attribute shadows the method until deleted
    try:
        yield
    finally:
        del runtime._head


@dataclass(slots=True)
class DecodeStep:
    """A prefilled request and its next 1-row decode step, re-runnable (it rewrites the same slot)."""

    runtime: nn.Module
    cache: PagedKVCache
    inputs: StepInputs

    def forward(self) -> torch.Tensor:
        return self.runtime.forward(self.inputs, self.cache)


def decode_step(model: Model, context: int, token_ids: list[int]) -> DecodeStep:
    """Prefill ``context`` tokens (``token_ids`` repeated) and pack the decode step that follows them."""
    from pagedgen.core.kv import PagedKVCache
    from pagedgen.executor.inputs import SequenceChunk, pack_step

    if context <= 0:
        raise ValueError(f"context must be positive, got {context}")
    if not token_ids:
        raise ValueError("decode_step needs at least one prompt token id")
    runtime = model.runtime
    blocks = -(-(context + 2) // BLOCK_SIZE)
    cache = PagedKVCache(model.kv_spec, num_blocks=blocks + 1, block_size=BLOCK_SIZE)
    table = list(range(1, blocks + 1))
    prompt = [token_ids[i % len(token_ids)] for i in range(context)]
    logits = runtime.forward(pack_step([SequenceChunk(prompt, 0, table)], block_size=BLOCK_SIZE), cache)
    nxt = int(logits[-1].argmax())
    inputs = pack_step([SequenceChunk([nxt], context, table)], block_size=BLOCK_SIZE)
    return DecodeStep(runtime, cache, inputs)


@contextmanager
def per_layer_path(runtime: nn.Module) -> Iterator[None]:
    """The forward without the fused decoder (restored after)."""
    kept = getattr(runtime, "fused_decoder", None)
    runtime.fused_decoder = None
    try:
        yield
    finally:
        runtime.fused_decoder = kept


def time_forwards(step: DecodeStep, repeats: int) -> dict[str, dict[str, float]]:
    """Per-layer and (when there is one) fused forwards, interleaved: ``{path: {"best", "median"}}``."""
    paths: dict[str, list[float]] = {"per-layer": []}
    if getattr(step.runtime, "fused_decoder", None) is not None:
        paths["fused"] = []
    for _ in range(repeats):
        for path, times in paths.items():
            if path == "per-layer":
                with per_layer_path(step.runtime):
                    times.append(_timed(step.forward))
            else:
                times.append(_timed(step.forward))
    return {p: {"best": min(t), "median": statistics.median(t)} for p, t in paths.items()}


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def profile_kernels(step: DecodeStep, context: int, repeats: int) -> tuple[list[KernelRow], float]:
    """The per-layer forward ``repeats`` times under the hooks: the table's rows and the hooked forward's
    median total. Each group's figure is the median over repeats of its summed exclusive time."""
    runtime = step.runtime
    roles = module_roles(runtime, context)
    clock = ModuleClock(roles)
    per_group: dict[str, list[float]] = {}
    calls: dict[str, int] = {}
    totals: list[float] = []
    with per_layer_path(runtime), clock.attached():
        for _ in range(repeats):
            clock.reset()
            heads: list[float] = []
            with timed_head(runtime, heads):
                total = _timed(step.forward)
            totals.append(total)
            sums: dict[str, float] = {"head": sum(heads)}
            calls = {"head": len(heads)}
            for module, seconds in clock.exclusive.items():
                group = roles[module].group
                sums[group] = sums.get(group, 0.0) + seconds
                calls[group] = calls.get(group, 0) + clock.calls[module]
            sums["other"] = total - sum(sums.values())
            calls["other"] = 1
            for group, seconds in sums.items():
                per_group.setdefault(group, []).append(seconds)
    moved: dict[str, int] = {"head": _head_bytes(runtime)}
    for module, role in roles.items():
        if module in clock.calls:
            moved[role.group] = moved.get(role.group, 0) + role.bytes_moved * clock.calls[module]
    rows = [
        KernelRow(group, calls.get(group, 0), statistics.median(times), moved.get(group, 0))
        for group, times in per_group.items()
        if calls.get(group, 0) or group == "other"
    ]
    rows.sort(key=lambda r: -r.seconds)
    return rows, statistics.median(totals)


def _head_bytes(runtime: nn.Module) -> int:
    weight = getattr(runtime, "head_weight", None)
    if weight is None:
        return 0
    out, inp = weight.shape
    return weight_bytes(weight) + 4 * (out + inp)


def run_kernel_profile(
    model: Model, name: str, token_ids: list[int], *, context: int, repeats: int, bandwidth: float | None
) -> tuple[KernelProfile, float]:
    """Profile ``model`` (a loaded ``pg.Model``); returns the profile and the hooked forward's median."""
    if repeats <= 0:
        raise ValueError(f"repeats must be positive, got {repeats}")
    step = decode_step(model, context, token_ids)
    for _ in range(2):  # first calls: thread pools, kernel choice, allocator
        step.forward()
        with per_layer_path(step.runtime):
            step.forward()
    weights = getattr(getattr(model, "weights_format", None), "value", "float32")
    profile = KernelProfile(name, str(weights), context, repeats, bandwidth)
    profile.forward_s = time_forwards(step, repeats)
    profile.rows, hooked = profile_kernels(step, context, repeats)
    return profile, hooked


def format_profile_table(profile: KernelProfile) -> str:
    """The markdown table: one row per kernel group, then the forward totals and the roofline."""
    lines = [
        "| kernel | calls | ms / forward | share | MB moved | GB/s | roofline ms | % of roofline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    record = profile.to_dict()
    total = sum(r.seconds for r in profile.rows)
    for row in record["kernels"]:
        share = row["ms"] / (total * 1e3) if total > 0 else 0.0
        lines.append(
            f"| {row['group']} | {row['calls']} | {row['ms']:.3f} | {share:.1%} | {row['bytes'] / 1e6:.2f} "
            f"| {_fmt(row['gb_per_s'], '.1f')} | {_fmt(row['roofline_ms'], '.3f')} "
            f"| {_fmt(None if row['roofline_fraction'] is None else 100 * row['roofline_fraction'], '.0f')} |"
        )
    floor = record["roofline_forward_ms"]
    lines.append(
        f"| **sum** | | {total * 1e3:.3f} | 100% | {profile.bytes_per_forward / 1e6:.2f} | "
        f"{profile.bytes_per_forward / total / 1e9 if total > 0 else 0:.1f} | {_fmt(floor, '.3f')} "
        f"| {_fmt(None if floor is None or total <= 0 else floor / (total * 1e3) * 100, '.0f')} |"
    )
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)
