"""CUDA-graph bookkeeping on the CPU: buckets, eligibility, static views, the registry's budget, the runner.

No CUDA runs here. Capture is driven by :class:`CallingCapture`, a stand-in that "replays" by calling the
forward again on the static views: it proves what the bookkeeping promises (a step is copied into the key's
static views once, padding rows touch only the scratch block, real rows' logits equal the eager ones), not
that a CUDA graph would capture. That part is checked on a GPU by ``scripts/gpu_check.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pagedgen as pg
from pagedgen.core.kv import KVSpec
from pagedgen.core.step_inputs import FixedStateInputs, StepInputs
from pagedgen.executor import cuda_graphs
from pagedgen.executor.cuda_graphs import (
    CapturedGraph,
    DecodeGraphs,
    EagerReason,
    GraphGeometry,
    GraphKey,
    StaticDecodeBuffers,
    batch_buckets,
    bucket_of,
    classify_step,
    decode_image,
    key_layout,
    width_buckets,
)
from pagedgen.executor.inputs import SequenceChunk, pack_step
from pagedgen.executor.runner import ModelRunner
from pagedgen.models.synthetic import SyntheticModel, synthetic_next_token

BS = 4


class CallingCapture:
    """Stand-in for CudaGraphCapture: the "graph" reruns the forward into a fixed output tensor."""

    def __init__(self, nbytes: int = 100, fail: BaseException | None = None):
        self.nbytes = nbytes
        self.fail = fail
        self.captured = 0
        self.replayed = 0

    def capture(self, run):
        if self.fail is not None:
            raise self.fail
        self.captured += 1
        output = run().clone()

        def replay() -> None:
            self.replayed += 1
            output.copy_(run())

        return CapturedGraph(output, replay, self.nbytes)


def decode_step(pasts: list[int], tokens: list[int] | None = None, block_size: int = BS) -> StepInputs:
    """A pure decode step: row i sends one token after ``pasts[i]`` cached ones, blocks 10*i, 10*i+1, ..."""
    tokens = tokens or [3 + i for i in range(len(pasts))]
    chunks = []
    for i, (past, token) in enumerate(zip(pasts, tokens, strict=True)):
        width = -(-(past + 1) // block_size)
        chunks.append(SequenceChunk([token], past, [10 * i + j for j in range(width)]))
    return pack_step(chunks, block_size)


# -- buckets ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_batch", "expected"),
    [
        (1, (1,)),
        (3, (1, 2, 3)),
        (8, (1, 2, 4, 8)),
        (16, (1, 2, 4, 8, 16)),
        (17, (1, 2, 4, 8, 16, 17)),
        (64, (1, 2, 4, 8, 16, 32, 48, 64)),
        (70, (1, 2, 4, 8, 16, 32, 48, 64, 70)),
    ],
)
def test_batch_buckets_are_small_powers_then_multiples_of_16_capped_at_the_maximum(max_batch, expected):
    assert batch_buckets(max_batch) == expected


@pytest.mark.parametrize(
    ("max_width", "expected"),
    [
        (1, (1,)),  # a capacity-clamped sub-minimum bucket
        (5, (5,)),
        (8, (8,)),
        (9, (8, 9)),  # truncated final bucket
        (16, (8, 16)),
        (100, (8, 16, 32, 64, 100)),
        (512, (8, 16, 32, 64, 128, 256, 512)),
    ],
)
def test_width_buckets_are_powers_of_two_from_8_with_a_clamped_last(max_width, expected):
    assert width_buckets(max_width) == expected


def test_bucket_of_picks_the_smallest_bucket_that_holds_the_value():
    buckets = (8, 16, 32, 40)
    assert [bucket_of(v, buckets) for v in (1, 8, 9, 16, 17, 33, 40, 41)] == [8, 8, 16, 16, 32, 40, 40, None]


@pytest.mark.parametrize("bad", [0, -1])
def test_buckets_refuse_non_positive_limits(bad):
    with pytest.raises(ValueError, match="must be positive"):
        batch_buckets(bad)
    with pytest.raises(ValueError, match="must be positive"):
        width_buckets(bad)


def test_kv_bounds_follow_the_seed():
    geometry = GraphGeometry(max_batch_size=4, max_width=40, block_size=16)
    assert geometry.widths == (8, 16, 32, 40)
    assert geometry.kv_bounds(GraphKey(4, 8)) == (128, 1)  # minimum bucket: lower bound 1
    assert geometry.kv_bounds(GraphKey(4, 16)) == (256, 129)  # previous capacity + 1
    assert geometry.kv_bounds(GraphKey(4, 40)) == (640, 513)  # truncated final bucket
    assert GraphGeometry(4, 3, 16).kv_bounds(GraphKey(1, 3)) == (48, 1)  # clamped sub-minimum


def test_graph_ids_number_the_keys_and_eager_is_minus_one():
    geometry = GraphGeometry(max_batch_size=4, max_width=40, block_size=16)
    assert geometry.batches == (1, 2, 4) and geometry.widths == (8, 16, 32, 40)
    assert geometry.graph_id(GraphKey(1, 8)) == 0
    assert geometry.graph_id(GraphKey(2, 16)) == 5
    assert geometry.graph_id(GraphKey(4, 40)) == 11
    assert geometry.graph_id(EagerReason.MULTI_TOKEN_ROWS) == -1


# -- eligibility -----------------------------------------------------------------------------------------


GEOMETRY = GraphGeometry(max_batch_size=20, max_width=40, block_size=BS)


def test_a_pure_decode_step_gets_the_key_of_its_rows_and_longest_table():
    assert classify_step(decode_step([0, 5, 3]), GEOMETRY) == GraphKey(4, 8)
    assert classify_step(decode_step([31]), GEOMETRY) == GraphKey(1, 8)  # kv 32 = 8 blocks of 4
    assert classify_step(decode_step([32]), GEOMETRY) == GraphKey(1, 16)
    assert classify_step(decode_step([0] * 17), GEOMETRY) == GraphKey(20, 8)
    assert classify_step(decode_step([159]), GEOMETRY) == GraphKey(1, 40)


def test_only_pure_decode_steps_are_eligible():
    prefill = pack_step([SequenceChunk([1, 2], 0, [0]), SequenceChunk([3], 4, [1, 2])], BS)
    assert classify_step(prefill, GEOMETRY) is EagerReason.MULTI_TOKEN_ROWS
    drafts = pack_step([SequenceChunk([1], 4, [1, 2], all_logits=True)], BS)
    drafts.verify_rows = (0,)  # a one-token row that verifies (no drafts left) is still a draft row
    assert classify_step(drafts, GEOMETRY) is EagerReason.DRAFT_ROWS
    windowed = pack_step([SequenceChunk([1], 4, [1, 2], window_ring=[5, 6, 7])], BS, window=4)
    assert classify_step(windowed, GEOMETRY) is EagerReason.WINDOW_RINGS
    fixed = decode_step([1])
    fixed.fixed = FixedStateInputs({}, {})
    assert classify_step(fixed, GEOMETRY) is EagerReason.FIXED_STATE
    unsampled = decode_step([1, 2])
    unsampled.logits_rows = unsampled.logits_rows[:1]
    assert classify_step(unsampled, GEOMETRY) is EagerReason.UNSAMPLED_ROWS
    hostless = decode_step([1])
    hostless.host = None
    assert classify_step(hostless, GEOMETRY) is EagerReason.NO_HOST_COPY
    assert classify_step(decode_step([0] * 21), GEOMETRY) is EagerReason.TOO_MANY_ROWS
    assert classify_step(decode_step([160]), GEOMETRY) is EagerReason.TOO_WIDE


# -- static views ----------------------------------------------------------------------------------------


def test_static_views_are_fixed_views_of_one_buffer_shaped_like_the_key():
    buffers = StaticDecodeBuffers(GEOMETRY, torch.device("cpu"), scratch_block=99)
    assert buffers.nbytes == key_layout(GEOMETRY.largest)[1]
    views = buffers.views(GraphKey(4, 16))
    assert views is buffers.views(GraphKey(4, 16))  # the same tensors every time: stable addresses
    base = buffers.buffer.untyped_storage().data_ptr()
    for name in ("input_ids", "positions", "cu_seqlens", "past_lens", "block_tables", "slot_mapping"):
        assert getattr(views, name).untyped_storage().data_ptr() == base
    assert tuple(views.block_tables.shape) == (4, 16) and views.block_tables.is_contiguous()
    assert tuple(views.cu_seqlens.shape) == (5,)
    assert (views.max_query_len, views.max_kv_len, views.min_kv_len, views.host) == (1, 64, 1, None)


def test_decode_image_pads_rows_onto_the_scratch_block():
    step = decode_step([0, 5], tokens=[7, 8])  # row 1 holds blocks 10, 11 (kv 6 of block size 4)
    key = GraphKey(4, 8)
    buffers = StaticDecodeBuffers(GEOMETRY, torch.device("cpu"), scratch_block=99)
    view = buffers.load(step, key)
    assert view.input_ids.tolist() == [7, 8, 0, 0]
    assert view.positions.tolist() == [0, 5, 0, 0]
    assert view.past_lens.tolist() == [0, 5, 0, 0]
    assert view.cu_seqlens.tolist() == [0, 1, 2, 3, 4]
    assert view.logits_rows.tolist() == [0, 1, 2, 3]
    assert view.slot_mapping.tolist() == [0, 11 * BS + 1, 99 * BS, 99 * BS]
    tables = view.block_tables.tolist()
    assert tables[0] == [0, 0] + [99] * 6  # pack_step's 0 padding of the narrower row stays (never read)
    assert tables[1] == [10, 11] + [99] * 6
    assert tables[2] == tables[3] == [99] * 8


def test_decode_image_drops_table_columns_past_the_bucket_and_refuses_too_many_rows():
    chunk = SequenceChunk([1], 2, list(range(20, 32)))  # 12 blocks held, 1 needed
    step = pack_step([chunk], BS)
    key = classify_step(step, GEOMETRY)
    assert key == GraphKey(1, 8)
    image = decode_image(step, key, scratch_block=99)
    offsets, _total = key_layout(key)
    tables = image[offsets["block_tables"] :].view(np.int32)[:8]
    assert tables.tolist() == list(range(20, 28))
    with pytest.raises(ValueError, match="do not fit"):
        decode_image(decode_step([0, 0]), GraphKey(1, 8), 99)


def test_loading_a_step_is_one_transfer(monkeypatch):
    calls = []
    real = cuda_graphs.transfer
    monkeypatch.setattr(cuda_graphs, "transfer", lambda dst, src: calls.append(src.shape) or real(dst, src))
    buffers = StaticDecodeBuffers(GEOMETRY, torch.device("cpu"), scratch_block=99)
    buffers.load(decode_step([0, 5, 9]), GraphKey(4, 8))
    assert calls == [(key_layout(GraphKey(4, 8))[1],)]


# -- the registry ----------------------------------------------------------------------------------------


class CountingForward:
    def __init__(self, vocab: int = 5):
        self.vocab = vocab
        self.calls: list[int] = []

    def __call__(self, inputs: StepInputs) -> torch.Tensor:
        self.calls.append(inputs.num_seqs)
        return inputs.input_ids.float()[:, None].repeat(1, self.vocab)  # [rows, vocab]


def make_graphs(capture, **limits) -> tuple[DecodeGraphs, CountingForward]:
    forward = CountingForward()
    buffers = StaticDecodeBuffers(GEOMETRY, torch.device("cpu"), scratch_block=99)
    return DecodeGraphs(GEOMETRY, buffers, capture, forward, **limits), forward


def test_a_key_is_captured_the_second_time_and_replayed_after():
    capture = CallingCapture()
    graphs, _forward = make_graphs(capture)
    assert graphs.run(decode_step([1, 2, 3], tokens=[4, 5, 6])) is None  # first sight: eager
    assert graphs.stats.eager == {"WARMING": 1}
    logits = graphs.run(decode_step([2, 3, 4], tokens=[7, 8, 9]))
    assert capture.captured == 1 and capture.replayed == 1
    assert logits[:, 0].tolist() == [7.0, 8.0, 9.0]  # the real rows only, this step's tokens
    logits = graphs.run(decode_step([3, 4, 5], tokens=[1, 2, 3]))
    assert capture.captured == 1 and capture.replayed == 2
    assert logits[:, 0].tolist() == [1.0, 2.0, 3.0]
    assert list(graphs.graphs) == [GraphKey(4, 8)]
    assert (graphs.stats.captures, graphs.stats.replays, graphs.stats.graph_bytes) == (1, 2, 100)


def test_returned_logits_survive_the_next_replay():
    graphs, _forward = make_graphs(CallingCapture(), capture_after=1)
    first = graphs.run(decode_step([1], tokens=[4]))
    graphs.run(decode_step([2], tokens=[5]))
    assert first[0, 0].item() == 4.0


def test_prefill_steps_never_reach_the_registry():
    capture = CallingCapture()
    graphs, forward = make_graphs(capture, capture_after=1)
    step = pack_step([SequenceChunk([1, 2, 3], 0, [0])], BS)
    for _ in range(3):
        assert graphs.run(step) is None
    assert capture.captured == 0 and forward.calls == []
    assert graphs.stats.eager == {"MULTI_TOKEN_ROWS": 3} and graphs.uses == {}


def test_the_graph_count_bound_refuses_new_keys_and_keeps_the_old():
    capture = CallingCapture()
    graphs, _forward = make_graphs(capture, max_graphs=1, capture_after=1)
    assert graphs.run(decode_step([1])) is not None  # key (1, 8) captured
    assert graphs.run(decode_step([1, 1])) is None  # key (2, 8): refused
    assert graphs.run(decode_step([1, 1])) is None  # stays refused, no second count
    assert graphs.run(decode_step([2])) is not None  # the captured key still replays
    assert graphs.stats.refused_keys == 1 and graphs.stats.eager == {"REFUSED": 2}
    assert list(graphs.graphs) == [GraphKey(1, 8)] and capture.captured == 1


def test_the_memory_bound_refuses_once_spent():
    graphs, _forward = make_graphs(CallingCapture(nbytes=600), max_bytes=1000, capture_after=1)
    assert graphs.run(decode_step([1])) is not None  # 600 bytes
    assert graphs.run(decode_step([1, 1])) is not None  # 1200: the overshoot is one graph at most
    assert graphs.run(decode_step([1, 1, 1])) is None  # spent: refused
    assert graphs.stats.graph_bytes == 1200 and graphs.stats.refused_keys == 1


def test_a_failed_capture_turns_graphs_off_and_the_step_runs_eagerly():
    error = RuntimeError("called a synchronizing CUDA operation")
    graphs, _forward = make_graphs(CallingCapture(fail=error), capture_after=1)
    assert graphs.run(decode_step([1])) is None
    assert not graphs.enabled and graphs.stats.capture_failures == 1
    assert "synchronizing" in graphs.stats.last_error
    assert graphs.run(decode_step([1])) is None
    assert graphs.stats.eager == {"DISABLED": 2}


def test_an_out_of_memory_capture_refuses_only_its_key():
    graphs, _forward = make_graphs(CallingCapture(fail=torch.OutOfMemoryError("full")), capture_after=1)
    assert graphs.run(decode_step([1])) is None
    assert graphs.enabled and GraphKey(1, 8) in graphs.refused


def test_limits_are_validated():
    with pytest.raises(ValueError, match="bad graph limits"):
        make_graphs(CallingCapture(), capture_after=0)


# -- the runner ------------------------------------------------------------------------------------------


def synthetic_decode(pasts: list[int], first: int = 1) -> tuple[StepInputs, list[int]]:
    """A decode step over histories prefilled into the runner's cache by ``prefill``: returns the step and
    each row's expected greedy token."""
    chunks, expected = [], []
    for i, past in enumerate(pasts):
        history = [first + i + p for p in range(past + 1)]
        width = -(-(past + 1) // BS)
        chunks.append(SequenceChunk([history[-1]], past, [10 * i + j for j in range(width)]))
        prev = history[-2] if past > 0 else 0
        expected.append(synthetic_next_token(history[0], prev, history[-1], past, 257))
    return pack_step(chunks, BS), expected


def prefill(runner: ModelRunner, pasts: list[int], first: int = 1) -> None:
    chunks = []
    for i, past in enumerate(pasts):
        if past:
            width = -(-past // BS)
            chunks.append(
                SequenceChunk([first + i + p for p in range(past)], 0, [10 * i + j for j in range(width)])
            )
    if chunks:
        runner.execute(pack_step(chunks, BS))


def graph_runner(capture=None, max_batch_size: int = 8) -> ModelRunner:
    model = SyntheticModel(max_context=64)
    return ModelRunner(
        model,
        num_blocks=100,
        block_size=BS,
        max_batch_size=max_batch_size,
        graph_capture=capture or CallingCapture(),
    )


def test_the_runner_replays_pure_decode_steps_with_exact_tokens():
    runner = graph_runner()
    assert runner.kv_cache.num_blocks == 101 and runner.graphs.buffers.scratch_block == 100
    for pasts in ([3, 9, 14], [4, 10, 15], [5, 11, 16]):  # grown by one each step, like decoding
        prefill(runner, [p for p in pasts])
        step, expected = synthetic_decode(pasts)
        logits = runner.execute(step)
        assert logits.argmax(dim=1).tolist() == expected
    # Step 1 ran eagerly (first sight), step 2 captured, step 3 replayed: the exact tokens of steps 2 and 3
    # prove the padding row (token 0, position 0) wrote the scratch block, not a request's first slot.
    assert runner.graphs.stats.captures == 1 and runner.graphs.stats.replays == 2
    assert list(runner.graphs.graphs) == [GraphKey(4, 8)]


def test_the_runner_runs_prefills_eagerly_and_ignores_graphs_on_the_cpu():
    runner = graph_runner()
    step = pack_step([SequenceChunk([1, 2, 3], 0, [0])], BS)
    assert runner.execute(step).argmax(dim=1).tolist() == [synthetic_next_token(1, 2, 3, 2, 257)]
    assert runner.graphs.stats.eager == {"MULTI_TOKEN_ROWS": 1}
    plain = ModelRunner(SyntheticModel(), num_blocks=8, block_size=BS, cuda_graphs=True, max_batch_size=4)
    assert plain.graphs is None and plain.kv_cache.num_blocks == 8  # CPU: graphs ignored, no scratch block


def test_models_with_windows_or_fixed_state_never_get_graphs():
    for model in (SyntheticModel(window=4), SyntheticModel(hybrid=True)):
        runner = ModelRunner(
            model, num_blocks=8, block_size=BS, max_batch_size=4, graph_capture=CallingCapture()
        )
        assert runner.graphs is None


def test_engine_config_validates_cuda_graphs():
    assert pg.EngineConfig().cuda_graphs is True
    with pytest.raises(pg.EngineError, match="cuda_graphs must be a bool"):
        pg.EngineConfig(cuda_graphs=1)


def test_an_engine_on_the_cpu_runs_with_cuda_graphs_on():
    model = SyntheticModel()
    engine = pg.Engine(model, pg.EngineConfig(max_batch_size=4, num_blocks=32, cuda_graphs=True))
    try:
        assert engine.parts.runner.graphs is None
    finally:
        engine.close()


class MetaModel:
    """A model on the meta device (no data: any host read of a step tensor raises). Its forward uses
    the packed inputs the way a model does, without synchronising."""

    def __init__(self) -> None:
        self.device = torch.device("meta")
        self.vocab_size = 7
        self.max_context = 64
        self.kv_spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1)
        self.fixed_state_specs = ()
        self.runtime = self

    def forward(self, inputs: StepInputs, kv_cache) -> torch.Tensor:
        cache = kv_cache.keys[0].view(-1)
        cache[inputs.slot_mapping] = inputs.input_ids.float()
        read = cache[inputs.block_tables.long()[:, 0] * inputs.block_size]  # [B]
        rows = inputs.logits_rows
        return (read[: rows.shape[0], None] + inputs.positions[rows, None]).repeat(1, self.vocab_size)


def test_the_runner_path_reads_nothing_back_from_the_device():
    """Packing, the graph bookkeeping (eager, capture, replay) and the eager path all run on meta tensors,
    so none of them reads a device value on the host; only the forward itself is the model's business."""
    runner = ModelRunner(
        MetaModel(), num_blocks=16, block_size=BS, max_batch_size=4, graph_capture=CallingCapture()
    )
    for past in (2, 3, 4):
        chunks = [SequenceChunk([1], past, [0, 1]), SequenceChunk([2], past + 1, [2, 3])]
        logits = runner.execute(pack_step(chunks, BS, device="meta"))
        assert logits.device.type == "meta" and tuple(logits.shape) == (2, 7)
    prefill = runner.execute(pack_step([SequenceChunk([1, 2, 3], 2, [0, 1])], BS, device="meta"))
    assert tuple(prefill.shape) == (1, 7)
    assert runner.graphs.stats.to_dict() | {"eager": None} == {
        "replays": 2,
        "captures": 1,
        "capture_failures": 0,
        "graph_bytes": 100,
        "refused_keys": 0,
        "eager": None,
        "last_error": None,
    }
    assert runner.graphs.stats.eager == {"WARMING": 1, "MULTI_TOKEN_ROWS": 1}
