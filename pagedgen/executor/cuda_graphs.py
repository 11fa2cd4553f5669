"""CUDA graphs for pure decode steps: bucketing, eligibility, static input buffers, a bounded registry.

Only steps whose rows each send and sample one token (no drafts, window rings or fixed state) are captured,
keyed by (batch-size bucket, block-table-width bucket); everything else runs eagerly and says why
(:class:`EagerReason`). Inputs live at fixed addresses in one static device buffer, padding rows touch a
scratch block, and the registry captures a key the second time it is seen, within a count and memory
budget, refusing new keys rather than evicting. Capture sits behind :class:`GraphCapture`, so all of this
is tested on the CPU with a stand-in; the CUDA capture itself is UNVERIFIED ON HARDWARE until a GPU session
runs ``scripts/gpu_check.py`` (docs/performance.md, "The CUDA path: the prepared device check").
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from pagedgen.core.step_inputs import StepInputs

MIN_WIDTH_BUCKET = 8  # block-table columns of the smallest width bucket
SMALL_BATCH_BUCKETS = (1, 2, 4, 8, 16)  # then every multiple of BATCH_STEP
BATCH_STEP = 16
DEFAULT_MAX_GRAPHS = 64
DEFAULT_MAX_GRAPH_BYTES = 2 << 30  # graph-pool memory (activations of the largest captured shapes)
CAPTURE_AFTER_USES = 2  # a key is captured the second time a step needs it
EAGER_GRAPH_ID = -1  # the graph id reported for a step that runs eagerly (logs and reports only)
_ALIGN = 8


class EagerReason(enum.Enum):
    """Why a step ran eagerly (graph id -1)."""

    MULTI_TOKEN_ROWS = "a row sends more than one token (prefill or mixed step)"
    DRAFT_ROWS = "the step verifies drafts"
    WINDOW_RINGS = "sliding-window rings are not in the static buffers"
    FIXED_STATE = "fixed conv / recurrent state is not in the static buffers"
    UNSAMPLED_ROWS = "a row does not sample this step"
    NO_HOST_COPY = "the inputs carry no host copy to pad from"
    TOO_MANY_ROWS = "more rows than the largest batch bucket"
    TOO_WIDE = "a block table wider than the largest width bucket"
    WARMING = "the key was not seen often enough to capture yet"
    REFUSED = "the graph budget (count or memory) is spent"
    DISABLED = "a capture failed, graphs are off"


@dataclass(frozen=True, slots=True, order=True)
class GraphKey:
    """The identity of a captured graph: padded rows and block-table columns of its static inputs."""

    batch: int
    width: int


def batch_buckets(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 32, 48, ... up to and including ``max_batch_size``."""
    if max_batch_size <= 0:
        raise ValueError(f"max_batch_size must be positive, got {max_batch_size}")
    small = [b for b in SMALL_BATCH_BUCKETS if b < max_batch_size]
    large = list(range(2 * BATCH_STEP, max_batch_size, BATCH_STEP)) if max_batch_size > BATCH_STEP else []
    return (*small, *large, max_batch_size)


def width_buckets(max_width: int) -> tuple[int, ...]:
    """Powers of two from :data:`MIN_WIDTH_BUCKET`, the last clamped to ``max_width``; ``(max_width,)`` when
    the model can never need :data:`MIN_WIDTH_BUCKET` columns."""
    if max_width <= 0:
        raise ValueError(f"max_width must be positive, got {max_width}")
    buckets = []
    width = MIN_WIDTH_BUCKET
    while width < max_width:
        buckets.append(width)
        width *= 2
    buckets.append(max_width)
    return tuple(buckets)


def bucket_of(value: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= ``value`` (``buckets`` ascending), or None when ``value`` exceeds them all."""
    i = bisect.bisect_left(buckets, value)
    return buckets[i] if i < len(buckets) else None


@dataclass(frozen=True, slots=True)
class GraphGeometry:
    """The configured limits the buckets and the static buffers are derived from."""

    max_batch_size: int
    max_width: int  # block-table columns of the longest sequence the model can hold
    block_size: int
    batches: tuple[int, ...] = field(init=False)
    widths: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        object.__setattr__(self, "batches", batch_buckets(self.max_batch_size))
        object.__setattr__(self, "widths", width_buckets(self.max_width))

    @property
    def largest(self) -> GraphKey:
        return GraphKey(self.batches[-1], self.widths[-1])

    def graph_id(self, decision: GraphKey | EagerReason) -> int:
        """A numeric graph id, for logs and reports: the key's index in (batch, width) order, or
        -1 for a step that runs eagerly. The code itself passes :class:`GraphKey` / :class:`EagerReason`."""
        if isinstance(decision, EagerReason):
            return EAGER_GRAPH_ID
        return self.batches.index(decision.batch) * len(self.widths) + self.widths.index(decision.width)

    def kv_bounds(self, key: GraphKey) -> tuple[int, int]:
        """(upper bound on every row's KV length, lower bound on the longest) valid for every replay of
        ``key``, for reservations of exactly ceil(kv_len / block_size) blocks: the lower
        bound is 1 in the smallest (or clamped sub-minimum) bucket, else one more than the previous
        bucket's capacity."""
        i = self.widths.index(key.width)
        lower = 1 if i == 0 else self.widths[i - 1] * self.block_size + 1
        return key.width * self.block_size, lower


def classify_step(inputs: StepInputs, geometry: GraphGeometry) -> GraphKey | EagerReason:
    """The step's graph key, or why it must run eagerly. Reads only host metadata (shapes, host copies)."""
    rows = inputs.num_seqs
    if inputs.max_query_len != 1 or inputs.num_tokens != rows:
        return EagerReason.MULTI_TOKEN_ROWS
    if inputs.verify_rows:
        return EagerReason.DRAFT_ROWS
    if inputs.window is not None:
        return EagerReason.WINDOW_RINGS
    if inputs.fixed is not None:
        return EagerReason.FIXED_STATE
    if int(inputs.logits_rows.shape[0]) != rows:
        return EagerReason.UNSAMPLED_ROWS
    if inputs.host is None:
        return EagerReason.NO_HOST_COPY
    batch = bucket_of(rows, geometry.batches)
    if batch is None:
        return EagerReason.TOO_MANY_ROWS
    needed = -(-inputs.max_kv_len // geometry.block_size)  # columns the longest row reads
    width = bucket_of(needed, geometry.widths)
    if width is None:
        return EagerReason.TOO_WIDE
    return GraphKey(batch, width)


# -- static buffers ------------------------------------------------------------------------------------

# (field, dtype, length as a function of the key): the layout of one key's views, in buffer order.
_FIELDS: tuple[tuple[str, torch.dtype, Callable[[GraphKey], int]], ...] = (
    ("input_ids", torch.int64, lambda k: k.batch),
    ("positions", torch.int64, lambda k: k.batch),
    ("slot_mapping", torch.int64, lambda k: k.batch),
    ("logits_rows", torch.int64, lambda k: k.batch),
    ("cu_seqlens", torch.int32, lambda k: k.batch + 1),
    ("past_lens", torch.int32, lambda k: k.batch),
    ("block_tables", torch.int32, lambda k: k.batch * k.width),
)


def key_layout(key: GraphKey) -> tuple[dict[str, int], int]:
    """Byte offset of each field of ``key``'s static views, and the bytes they span (8-byte aligned)."""
    offsets = {}
    total = 0
    for name, dtype, length in _FIELDS:
        offsets[name] = total
        nbytes = length(key) * dtype.itemsize
        total += -(-nbytes // _ALIGN) * _ALIGN
    return offsets, total


def decode_image(inputs: StepInputs, key: GraphKey, scratch_block: int) -> np.ndarray:
    """The bytes of ``key``'s static views for this pure decode step (uint8 ``[key_layout(key)[1]]``).

    Rows ``0..B-1`` are the step's (from ``inputs.host``); rows ``B..key.batch-1`` are padding: token 0 at
    position 0 with no past, writing slot 0 of ``scratch_block`` and reading only that block, so they touch
    no request's blocks. Block-table columns past a row's own table hold ``scratch_block`` too (never read:
    every read stops at the row's KV length). Logits rows are ``0..key.batch-1``; the caller keeps the
    first ``B``.
    """
    host = inputs.host
    if host is None:
        raise ValueError("decode_image needs the step's host copies (StepInputs.host)")
    rows = inputs.num_seqs
    if rows > key.batch:
        raise ValueError(f"{rows} rows do not fit graph key {key}")
    block_size = inputs.block_size
    offsets, total = key_layout(key)
    image = np.zeros(total, dtype=np.uint8)

    def section(name: str, dtype: type, length: int) -> np.ndarray:
        start = offsets[name]
        return image[start : start + length * np.dtype(dtype).itemsize].view(dtype)

    section("input_ids", np.int64, key.batch)[:rows] = host.input_ids.numpy()
    section("positions", np.int64, key.batch)[:rows] = host.positions.numpy()
    slots = section("slot_mapping", np.int64, key.batch)
    slots[:rows] = host.slot_mapping.numpy()
    slots[rows:] = scratch_block * block_size
    section("logits_rows", np.int64, key.batch)[:] = np.arange(key.batch)
    section("cu_seqlens", np.int32, key.batch + 1)[:] = np.arange(key.batch + 1)
    section("past_lens", np.int32, key.batch)[:rows] = host.past_lens.numpy()
    tables = section("block_tables", np.int32, key.batch * key.width).reshape(key.batch, key.width)
    tables[:] = scratch_block
    source = host.block_tables.numpy()[:, : key.width]  # columns past the bucket are never read
    tables[:rows, : source.shape[1]] = source
    return image


class StaticDecodeBuffers:
    """One persistent device buffer holding every key's static input views (sized for the largest key).

    ``views(key)`` is a :class:`StepInputs` whose tensors are fixed views into the buffer, with bounds valid
    for every replay of ``key`` (``max_query_len`` 1, ``max_kv_len`` the bucket's capacity, ``min_kv_len`` 1:
    padding rows hold one key) and no host copy. ``load(inputs, key)`` writes a step into them with one
    transfer.
    """

    def __init__(self, geometry: GraphGeometry, device: torch.device, scratch_block: int):
        self.geometry = geometry
        self.device = device
        self.scratch_block = scratch_block
        self.nbytes = key_layout(geometry.largest)[1]
        self.buffer = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)  # [bytes]
        self._views: dict[GraphKey, StepInputs] = {}

    def views(self, key: GraphKey) -> StepInputs:
        cached = self._views.get(key)
        if cached is not None:
            return cached
        offsets, _total = key_layout(key)
        t: dict[str, torch.Tensor] = {}
        for name, dtype, length in _FIELDS:
            size = dtype.itemsize
            start = offsets[name]
            t[name] = self.buffer[start : start + length(key) * size].view(dtype)
        upper, _lower = self.geometry.kv_bounds(key)
        inputs = StepInputs(
            input_ids=t["input_ids"],
            positions=t["positions"],
            cu_seqlens=t["cu_seqlens"],
            past_lens=t["past_lens"],
            block_tables=t["block_tables"].view(key.batch, key.width),
            slot_mapping=t["slot_mapping"],
            logits_rows=t["logits_rows"],
            max_query_len=1,
            max_kv_len=upper,
            min_kv_len=1,
            block_size=self.geometry.block_size,
        )
        self._views[key] = inputs
        return inputs

    def load(self, inputs: StepInputs, key: GraphKey) -> StepInputs:
        """Copy the step into ``key``'s views (one host image, one transfer); returns the views."""
        image = torch.from_numpy(decode_image(inputs, key, self.scratch_block))
        if self.device.type == "cuda":
            image = image.pin_memory()
        transfer(self.buffer[: image.shape[0]], image)
        return self.views(key)


def transfer(destination: torch.Tensor, image: torch.Tensor) -> None:
    """The graph path's one host-to-device copy per step (a module function, so tests can count calls)."""
    destination.copy_(image, non_blocking=True)


# -- capture -------------------------------------------------------------------------------------------


@dataclass(slots=True)
class CapturedGraph:
    """A captured forward: ``replay()`` reruns it on the current contents of its static inputs and leaves
    the logits in ``output`` (``[key.batch, vocab]``); ``nbytes`` is the memory its capture took."""

    output: torch.Tensor
    replay: Callable[[], None]
    nbytes: int


class GraphCapture(Protocol):
    """Turns a forward over static inputs into a replayable graph; raises if it cannot."""

    def capture(self, run: Callable[[], torch.Tensor]) -> CapturedGraph: ...


class CudaGraphCapture:
    """``torch.cuda.CUDAGraph`` capture into one shared memory pool. UNVERIFIED ON HARDWARE.

    Warm-up runs go on a side stream (as torch's capture recipe asks) with
    ``torch.cuda.set_sync_debug_mode("error")``, so a forward that synchronises with the host (``.item()``,
    ``.tolist()``, a pageable copy) raises there, before any capture starts, instead of invalidating it.
    Then, once per capture, the graph's replay is compared with an eager run on the same static inputs
    (``check_replay``): a forward that captured something that does not replay (a host value baked in, a
    copy from a temporary host buffer) raises instead of silently giving wrong logits.
    """

    def __init__(self, device: torch.device, warmup_runs: int = 2, check_replay: bool = True):
        self.device = device
        self.warmup_runs = warmup_runs
        self.check_replay = check_replay
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, run: Callable[[], torch.Tensor]) -> CapturedGraph:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        previous = torch.cuda.get_sync_debug_mode()
        with torch.cuda.stream(side):
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(self.warmup_runs):
                    run()
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        current.wait_stream(side)
        torch.cuda.synchronize(self.device)  # once per capture, not per step
        before = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = run()
        nbytes = max(0, torch.cuda.memory_reserved(self.device) - before)
        if self.check_replay:
            _check_replay(graph, output, run())
        return CapturedGraph(output, graph.replay, nbytes)


def _check_replay(graph: torch.cuda.CUDAGraph, output: torch.Tensor, eager: torch.Tensor) -> None:
    """Raise unless a replay gives the eager logits (to a tolerance for reassociation; a sync, once)."""
    graph.replay()
    diff = float((output.float() - eager.float()).abs().max())
    bound = 1e-3 * (1.0 + float(eager.float().abs().max()))
    if not diff <= bound:
        raise RuntimeError(f"the captured graph's logits differ from eager by {diff:.3g} (bound {bound:.3g})")


# -- the registry --------------------------------------------------------------------------------------


@dataclass(slots=True)
class GraphStats:
    """What the graph path did (for the bench and the GPU check; cheap to read)."""

    replays: int = 0  # steps that ran through a graph (captures included)
    captures: int = 0
    capture_failures: int = 0
    graph_bytes: int = 0
    refused_keys: int = 0
    eager: dict[str, int] = field(default_factory=dict)  # EagerReason.name -> steps
    last_error: str | None = None

    def to_dict(self) -> dict[str, object]:
        return {
            "replays": self.replays,
            "captures": self.captures,
            "capture_failures": self.capture_failures,
            "graph_bytes": self.graph_bytes,
            "refused_keys": self.refused_keys,
            "eager": dict(self.eager),
            "last_error": self.last_error,
        }


class DecodeGraphs:
    """Runs eligible pure decode steps through lazily captured graphs (rules in the module docstring).

    ``forward(static_inputs)`` is the model call the graphs capture (logits ``[key.batch, vocab]``).
    ``run(inputs)`` returns the step's logits ``[B, vocab]``, or None when the step must run eagerly (the
    caller then runs it). Mutates only its registry, its stats and the static buffers.
    """

    def __init__(
        self,
        geometry: GraphGeometry,
        buffers: StaticDecodeBuffers,
        capture: GraphCapture,
        forward: Callable[[StepInputs], torch.Tensor],
        max_graphs: int = DEFAULT_MAX_GRAPHS,
        max_bytes: int = DEFAULT_MAX_GRAPH_BYTES,
        capture_after: int = CAPTURE_AFTER_USES,
    ):
        if max_graphs < 0 or max_bytes < 0 or capture_after < 1:
            raise ValueError(
                f"bad graph limits: {max_graphs} graphs, {max_bytes} bytes, after {capture_after}"
            )
        self.geometry = geometry
        self.buffers = buffers
        self.capture = capture
        self.forward = forward
        self.max_graphs = max_graphs
        self.max_bytes = max_bytes
        self.capture_after = capture_after
        self.graphs: dict[GraphKey, CapturedGraph] = {}
        self.uses: dict[GraphKey, int] = {}
        self.refused: set[GraphKey] = set()
        self.enabled = True
        self.stats = GraphStats()

    def decide(self, inputs: StepInputs) -> GraphKey | EagerReason:
        """The key this step would replay or capture, or why it runs eagerly (counts the key's use)."""
        if not self.enabled:
            return EagerReason.DISABLED
        key = classify_step(inputs, self.geometry)
        if isinstance(key, EagerReason) or key in self.graphs:
            return key
        if key in self.refused:
            return EagerReason.REFUSED
        self.uses[key] = self.uses.get(key, 0) + 1
        if self.uses[key] < self.capture_after:
            return EagerReason.WARMING
        if len(self.graphs) >= self.max_graphs or self.stats.graph_bytes >= self.max_bytes:
            self.refused.add(key)
            self.stats.refused_keys += 1
            return EagerReason.REFUSED
        return key

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        decision = self.decide(inputs)
        if isinstance(decision, EagerReason):
            self.stats.eager[decision.name] = self.stats.eager.get(decision.name, 0) + 1
            return None
        static = self.buffers.load(inputs, decision)
        graph = self.graphs.get(decision)
        if graph is None:
            graph = self._capture(decision, static)
            if graph is None:
                return None
        graph.replay()
        self.stats.replays += 1
        return graph.output[: inputs.num_seqs].clone()  # [B, vocab]; the next replay overwrites output

    def _capture(self, key: GraphKey, static: StepInputs) -> CapturedGraph | None:
        try:
            graph = self.capture.capture(lambda: self.forward(static))
        except torch.OutOfMemoryError:
            self.refused.add(key)  # no room for this shape's graph: it stays eager
            self.stats.refused_keys += 1
            self.stats.eager[EagerReason.REFUSED.name] = self.stats.eager.get(EagerReason.REFUSED.name, 0) + 1
            return None
        except Exception as exc:  # a forward that cannot be captured: graphs off, the step runs eagerly
            self.enabled = False
            self.stats.capture_failures += 1
            self.stats.last_error = f"{type(exc).__name__}: {exc}"
            self.stats.eager[EagerReason.DISABLED.name] = (
                self.stats.eager.get(EagerReason.DISABLED.name, 0) + 1
            )
            return None
        self.graphs[key] = graph
        self.stats.captures += 1
        self.stats.graph_bytes += graph.nbytes
        return graph
