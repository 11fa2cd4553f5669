"""The one-call decode path (ops/layers/decoder_layers.py) is the per-layer path with the Python removed.

Every test compares bits: the fused path runs the same kernels in the same order, so its logits and the K/V
it writes must equal the per-layer loop's exactly, for any batch, format and bias; steps it cannot run fall
back to the per-layer loop.
"""

from __future__ import annotations

import ctypes
import json
import sys
import threading

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import pagedgen.models.llama as llama
import pagedgen.ops.layers.decoder_layers as decoder_layers
import pagedgen.ops.matmul.quant_gemm as quant_gemm
from pagedgen.core.kv import PagedKVCache
from pagedgen.executor.inputs import SequenceChunk, pack_step
from pagedgen.models.model import Model
from pagedgen.ops.kernels import native
from pagedgen.ops.mixers.attention import plan_attention
from tests.model.paged_runner import PagedRunner, PagedSequence
from tests.model.tiny_checkpoints import TINY_RAW, formats_by_suffix, random_state, write_gguf

pytestmark = pytest.mark.cpu  # the fused decode path is the native CPU kernel (fp32 on the CPU only)

BLOCK = 4  # small blocks: the tables of the rows below span several, partly filled


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDGEN_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def need_kernels():
    if quant_gemm.quant_kernels() is None:
        pytest.skip(native.native_status().detail)


def _gguf_model(tmp_path, qtype: str, activations: str = "fp32") -> Model:
    path = tmp_path / f"tiny-{qtype}.gguf"
    if not path.exists():
        state = random_state(TINY_RAW, seed=5)
        write_gguf(path, "llama", state, TINY_RAW, qtype=gguf.GGMLQuantizationType[qtype], tokenizer=False)
    return Model(str(path), device="cpu", activations=activations)


def _biased_bf16_model(tmp_path) -> Model:
    """A 16-bit safetensors model with q/k/v and MLP biases (the fused kernel adds them)."""
    raw = {**TINY_RAW, "attention_bias": True, "mlp_bias": True}
    state = random_state(raw, seed=6, qkv_bias=True)
    rng = np.random.default_rng(7)
    for i in range(raw["num_hidden_layers"]):
        for name, rows in (("gate", raw["intermediate_size"]), ("up", raw["intermediate_size"])):
            state[f"model.layers.{i}.mlp.{name}_proj.bias"] = rng.standard_normal(rows).astype(np.float32)
        state[f"model.layers.{i}.mlp.down_proj.bias"] = rng.standard_normal(raw["hidden_size"]).astype(
            np.float32
        )
    directory = tmp_path / "hf-bias"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(raw))
    save_file(
        {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in state.items()},
        str(directory / "model.safetensors"),
    )
    return Model(str(directory), device="cpu")


def _run(
    model: Model, fused: bool, prompts: list[list[int]], steps: int = 5, decode_threads: int | None = None
):
    """Prefill ``prompts`` together, then ``steps`` greedy decode steps (on ``decode_threads`` threads when
    given; the prefill on the default count); ``(logits per step, cache)``."""
    runtime = model.runtime
    kept, threads = runtime.fused_decoder, torch.get_num_threads()
    runtime.fused_decoder = kept if fused else None
    try:
        cache = PagedKVCache(model.kv_spec, num_blocks=64, block_size=BLOCK)
        tables = [list(range(12 * i, 12 * i + 12)) for i in range(len(prompts))]
        chunks = [SequenceChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
        outputs = [runtime.forward(pack_step(chunks, block_size=BLOCK), cache)]
        torch.set_num_threads(decode_threads or threads)
        for step in range(steps):
            ids = outputs[-1].argmax(-1).tolist()
            chunks = [SequenceChunk([ids[i]], len(p) + step, tables[i]) for i, p in enumerate(prompts)]
            outputs.append(runtime.forward(pack_step(chunks, block_size=BLOCK), cache))
        return outputs, cache
    finally:
        runtime.fused_decoder = kept
        torch.set_num_threads(threads)


def _assert_same(model: Model, prompts: list[list[int]], threads: int | None = None) -> None:
    fused_logits, fused_cache = _run(model, True, prompts, decode_threads=threads)
    plain_logits, plain_cache = _run(model, False, prompts)
    for got, expected in zip(fused_logits, plain_logits, strict=True):
        assert torch.equal(got, expected)
    for got, expected in zip(
        fused_cache.keys + fused_cache.values, plain_cache.keys + plain_cache.values, strict=True
    ):
        assert torch.equal(got, expected)


PROMPTS = [[3, 9, 27, 81, 243], [7] * 11, [100, 2], list(range(30, 47))]


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "F16"])
@pytest.mark.parametrize("batch", [1, 4])
def test_fused_decode_equals_the_per_layer_loop(tmp_path, need_kernels, qtype, batch):
    model = _gguf_model(tmp_path, qtype)
    assert model.runtime.fused_decoder is not None
    _assert_same(model, PROMPTS[:batch])


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 4])
def test_the_fused_step_has_the_per_layer_bits_at_any_thread_count(tmp_path, need_kernels, threads, batch):
    """The fused step splits every GEMM's columns over its threads (q/k/v at head boundaries, each thread
    writing the k and v heads of its columns to the cache), and attention by query heads (batch 1; 3
    threads over 4 query heads of 2 kv heads: one thread takes the second head of the first kv head's
    group) or by rows (batch 4): every split gives the per-layer loop's bits."""
    model = _gguf_model(tmp_path, "Q4_1")
    fused_logits, fused_cache = _run(model, True, PROMPTS[:batch], decode_threads=threads)
    plain_logits, plain_cache = _run(model, False, PROMPTS[:batch])
    for got, expected in zip(fused_logits, plain_logits, strict=True):
        assert torch.equal(got, expected)
    for got, expected in zip(
        fused_cache.keys + fused_cache.values, plain_cache.keys + plain_cache.values, strict=True
    ):
        assert torch.equal(got, expected)


def _attention_share(tables: list[list[int]], kv_lens: list[int], q_heads: int, threads: int):
    """The fused step's attention split: ``(first row, end row, first query head, end query head)`` per
    thread."""
    library = native.native_library()
    share = library.decoder_attention_share
    share.restype = None
    table = np.ascontiguousarray(tables, dtype=np.int32)
    lens = np.ascontiguousarray(kv_lens, dtype=np.int32)
    out = np.zeros(4 * threads, dtype=np.int64)
    share(
        ctypes.c_void_p(table.ctypes.data),
        ctypes.c_int64(table.shape[1]),
        ctypes.c_void_p(lens.ctypes.data),
        ctypes.c_int64(len(kv_lens)),
        ctypes.c_int64(q_heads),
        ctypes.c_int(threads),
        ctypes.c_void_p(out.ctypes.data),
    )
    return [tuple(int(v) for v in out[4 * i : 4 * i + 4]) for i in range(threads)]


@pytest.mark.parametrize(
    ("tables", "kv_lens", "threads", "expected"),
    [
        # four sequences of equal length: two whole rows each, every kv head
        ([[0], [1], [2], [3]], [9, 9, 9, 9], 2, [(0, 2, 0, 3), (2, 4, 0, 3)]),
        # balanced by the keys attended (plus 32 per row): the long row alone; each row goes where most of
        # it falls (4 rows over 3 threads)
        ([[0], [1], [2], [3]], [1000, 10, 10, 10], 2, [(0, 1, 0, 3), (1, 4, 0, 3)]),
        # drafts of three sequences (3, 4 and 3 rows, each with its sequence's table): the halfway row lies
        # inside the second sequence, whose rows all stay on the first thread
        (
            [[5, 6]] * 3 + [[7, 8]] * 4 + [[9, 4]] * 3,
            [6, 7, 8, 6, 7, 8, 9, 6, 7, 8],
            2,
            [(0, 7, 0, 3), (7, 10, 0, 3)],
        ),
        ([[0], [1], [2], [3]], [9, 9, 9, 9], 3, [(0, 1, 0, 3), (1, 3, 0, 3), (3, 4, 0, 3)]),
        # fewer rows than threads, or one sequence's drafts: every row, a run of query heads
        ([[0]], [9], 2, [(0, 1, 0, 1), (0, 1, 1, 3)]),
        ([[3, 1]] * 5, [5, 6, 7, 8, 9], 2, [(0, 5, 0, 1), (0, 5, 1, 3)]),
        ([[0], [1], [2], [3]], [9, 9, 9, 9], 1, [(0, 4, 0, 3)]),
    ],
)
def test_attention_takes_whole_sequences_balanced_by_their_keys(
    need_kernels, tables, kv_lens, threads, expected
):
    """With rows enough, each thread attends whole rows (its own cache blocks), never splitting one
    sequence's rows (a draft row reads the keys its sequence's earlier rows wrote in the same step);
    otherwise every thread takes a run of query heads of every row."""
    assert _attention_share(tables, kv_lens, 3, threads) == expected


@pytest.mark.parametrize(
    ("q_heads", "expected"), [(9, [(0, 1, 0, 4), (0, 1, 4, 9)]), (4, [(0, 1, 0, 2), (0, 1, 2, 4)])]
)
def test_batch_1_attention_is_cut_by_query_heads(need_kernels, q_heads, expected):
    """SmolLM2's 9 query heads over 3 kv heads split 4 / 5 on two threads (by kv heads it was 1 / 2: one
    thread took twice the other's time), and Gemma 3 270M's 4 query heads over its one kv head 2 / 2 (by kv
    heads one thread had none)."""
    assert _attention_share([[0]], [100], q_heads, 2) == expected


@pytest.mark.parametrize("threads", [2, 3])
def test_draft_rows_of_several_sequences_decode_fused_with_the_per_layer_bits(
    tmp_path, need_kernels, threads
):
    """A verification step of three sequences (3, 4 and 2 draft rows) is one fused step whose attention
    keeps each sequence on one thread: its logits and K/V equal the per-layer loop's."""
    model = _gguf_model(tmp_path, "Q4_1")
    runtime, kept, default_threads = model.runtime, model.runtime.fused_decoder, torch.get_num_threads()
    prompts, drafts = PROMPTS[:3], [[5, 6, 7], [8, 9, 10, 11], [12, 13]]
    tables = [list(range(12 * i, 12 * i + 12)) for i in range(len(prompts))]
    results = []
    try:
        for fused in (True, False):
            runtime.fused_decoder = kept if fused else None
            cache = PagedKVCache(model.kv_spec, num_blocks=64, block_size=BLOCK)
            prefill = [SequenceChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
            runtime.forward(pack_step(prefill, block_size=BLOCK), cache)
            torch.set_num_threads(threads)
            chunks = [
                SequenceChunk(d, len(p), t, all_logits=True)
                for p, d, t in zip(prompts, drafts, tables, strict=True)
            ]
            before = decoder_layers.FUSED_STEPS.count
            logits = runtime.forward(pack_step(chunks, block_size=BLOCK), cache)
            assert decoder_layers.FUSED_STEPS.count - before == (1 if fused else 0)
            torch.set_num_threads(default_threads)
            results.append((logits, cache))
    finally:
        runtime.fused_decoder = kept
        torch.set_num_threads(default_threads)
    (fused_logits, fused_cache), (plain_logits, plain_cache) = results
    assert fused_logits.shape[0] == sum(len(d) for d in drafts)
    assert torch.equal(fused_logits, plain_logits)
    for got, expected in zip(
        fused_cache.keys + fused_cache.values, plain_cache.keys + plain_cache.values, strict=True
    ):
        assert torch.equal(got, expected)


@pytest.fixture
def sleeping_barrier(need_kernels):
    """The step's barrier set to sleep at once (no spinning); yields its count of waits that slept."""
    library = native.native_library()
    spin, naps = library.decoder_barrier_spin, library.decoder_barrier_naps
    spin.argtypes, spin.restype = [ctypes.c_int64], None
    naps.argtypes, naps.restype = [], ctypes.c_int64
    spin(0)
    try:
        yield naps
    finally:
        spin(-1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sleeping barrier is Linux's futex")
@pytest.mark.parametrize("threads", [2, 3, 5])
def test_the_fused_step_has_the_per_layer_bits_when_its_threads_sleep_at_every_barrier(
    tmp_path, sleeping_barrier, threads
):
    """A thread that waits too long at one of the step's barriers sleeps until the last one arrives (so that
    a busy core does not cost a scheduler slice per barrier). With no spinning at all every wait takes that
    path, and with more threads than cores (5) threads are also descheduled in between: the results are
    still the per-layer loop's bits, and the waits did sleep."""
    model = _gguf_model(tmp_path, "Q4_1")
    before = sleeping_barrier()
    _assert_same(model, PROMPTS[:2], threads)
    assert sleeping_barrier() > before


def test_reused_buffers_and_cache_pointers_keep_every_step_exact(tmp_path, need_kernels, monkeypatch):
    """The decoder keeps its working buffers (per thread, up to SCRATCH_ROWS rows) and the cache pointers of
    its last call: steps that change the cache, the batch and the thread, or exceed SCRATCH_ROWS (2 here),
    still give the per-layer loop's bits."""
    monkeypatch.setattr(decoder_layers, "SCRATCH_ROWS", 2)
    model = _gguf_model(tmp_path, "Q4_1")
    plain = {batch: _run(model, False, PROMPTS[:batch]) for batch in (1, 4)}

    def check(batch: int) -> None:
        logits, cache = _run(model, True, PROMPTS[:batch])  # a new cache each run
        want_logits, want_cache = plain[batch]
        assert all(torch.equal(a, b) for a, b in zip(logits, want_logits, strict=True))
        got, want = cache.keys + cache.values, want_cache.keys + want_cache.values
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

    for batch in (1, 4, 1, 1, 4):
        check(batch)
    errors: list[BaseException] = []

    def in_thread() -> None:  # a thread of its own: its own buffers
        try:
            check(1)
        except BaseException as error:  # noqa: BLE001 - reported to the test's thread
            errors.append(error)

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert errors == []
    check(1)


@pytest.mark.parametrize("fused", [True, False])
def test_a_decode_step_norms_its_rows_in_place_with_the_gathered_rows_bits(
    tmp_path, need_kernels, monkeypatch, fused
):
    """A decode step's logits rows are every token in order: the final add + norm takes the stream itself
    instead of gathered copies, with the same logits as gathering (prefill steps still gather)."""
    model = _gguf_model(tmp_path, "Q8_0")
    taken, original = [], llama.logits_rows_of

    def gathered(x, delta, inputs):
        taken.append(original(x, delta, inputs)[0] is x)
        rows = inputs.logits_rows
        return x[rows], delta[rows]

    for batch in (1, 4):
        want, want_cache = _run(model, fused, PROMPTS[:batch])
        with monkeypatch.context() as patch:
            patch.setattr(llama, "logits_rows_of", gathered)
            got, got_cache = _run(model, fused, PROMPTS[:batch])
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert taken == [False] + [True] * (len(want) - 1)  # the prefill gathers, each decode step does not
        taken.clear()


def test_biases_are_added_as_the_per_layer_loop_adds_them(tmp_path, need_kernels):
    model = _biased_bf16_model(tmp_path)
    layer = model.runtime.model.layers[0]
    assert layer.self_attn.qkv.bias is not None and layer.mlp.gate_up.bias is not None
    assert model.runtime.fused_decoder is not None
    _assert_same(model, PROMPTS[:3])


def test_decode_steps_take_the_fused_path_and_prefill_or_mixed_steps_do_not(
    tmp_path, need_kernels, monkeypatch
):
    model = _gguf_model(tmp_path, "Q4_1")
    calls = []
    run = decoder_layers.FusedDecoder.run
    monkeypatch.setattr(decoder_layers.FusedDecoder, "run", lambda self, *a: calls.append(1) or run(self, *a))
    cache = PagedKVCache(model.kv_spec, num_blocks=16, block_size=BLOCK)
    prefill = pack_step([SequenceChunk([1, 2, 3], 0, [0, 1])], block_size=BLOCK)
    model.runtime.forward(prefill, cache)
    assert calls == []
    mixed = pack_step([SequenceChunk([4], 3, [0, 1]), SequenceChunk([5, 6], 0, [2])], block_size=BLOCK)
    model.runtime.forward(mixed, cache)
    assert calls == []
    decode = pack_step([SequenceChunk([7], 4, [0, 1]), SequenceChunk([8], 2, [2])], block_size=BLOCK)
    model.runtime.forward(decode, cache)
    assert calls == [1]


def test_rows_above_the_quant_kernels_range_take_the_per_layer_path(tmp_path, need_kernels, monkeypatch):
    model = _gguf_model(tmp_path, "Q8_0")
    cache = PagedKVCache(model.kv_spec, num_blocks=16, block_size=BLOCK)
    step = pack_step([SequenceChunk([7], 0, [0]), SequenceChunk([8], 0, [1])], block_size=BLOCK)
    plan = plan_attention(step, cache.keys[0])
    x = torch.zeros(2, TINY_RAW["hidden_size"])
    assert model.runtime.fused_decoder.supports(x, step, plan)
    monkeypatch.setattr(decoder_layers, "use_quant_kernel", lambda weight, rows: rows < 2)
    assert not model.runtime.fused_decoder.supports(x, step, plan)


def test_float32_weights_and_missing_kernels_build_no_fused_decoder(tmp_path, need_kernels, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_gguf(
        path,
        "llama",
        random_state(TINY_RAW, seed=5),
        TINY_RAW,
        qtype=gguf.GGMLQuantizationType.Q8_0,
        tokenizer=False,
    )
    assert Model(str(path), device="cpu", weights="float32").runtime.fused_decoder is None
    monkeypatch.setattr(decoder_layers, "native_library", lambda: None)
    assert Model(str(path), device="cpu").runtime.fused_decoder is None


def test_a_slot_outside_the_cache_raises_and_writes_nothing(tmp_path, need_kernels):
    model = _gguf_model(tmp_path, "Q4_1")
    cache = PagedKVCache(model.kv_spec, num_blocks=4, block_size=BLOCK)
    model.runtime.forward(pack_step([SequenceChunk([1, 2], 0, [0])], block_size=BLOCK), cache)
    before = [t.clone() for t in cache.keys + cache.values]
    step = pack_step([SequenceChunk([3], 2, [0]), SequenceChunk([4], 0, [1])], block_size=BLOCK)
    step.slot_mapping[1] = 4 * BLOCK  # one past the last slot
    with pytest.raises(IndexError, match="outside the cache"):
        model.runtime.forward(step, cache)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.keys + cache.values, strict=True))


def _windowed_model(tmp_path, extra: dict) -> Model:
    """A bf16 safetensors model with sliding-window layers (``extra``: the config keys that say which)."""
    raw = {**TINY_RAW, "num_hidden_layers": 3, **extra}
    directory = tmp_path / "hf-window"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(raw))
    qkv_bias = raw["model_type"] == "qwen2"
    state = random_state(raw, seed=8, qkv_bias=qkv_bias)
    save_file(
        {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in state.items()},
        str(directory / "model.safetensors"),
    )
    return Model(str(directory), device="cpu")


def _run_rings(model: Model, fused: bool, prompts: list[list[int]], ring_chunk: int | None, steps: int = 12):
    """Like :func:`_run` through :class:`PagedRunner` (shuffled blocks; window rings when ``ring_chunk``)."""
    runtime = model.runtime
    kept = runtime.fused_decoder
    runtime.fused_decoder = kept if fused else None
    try:
        runner = PagedRunner(model, num_blocks=64, block_size=BLOCK, seed=3, ring_chunk=ring_chunk)
        seqs = [PagedSequence(tokens=[]) for _ in prompts]
        outputs = [runner.step(seqs, prompts)]
        for _ in range(steps):
            outputs.append(runner.step(seqs, [[t] for t in outputs[-1].argmax(-1).tolist()]))
        return outputs, runner.cache
    finally:
        runtime.fused_decoder = kept


WINDOWED = {
    "mistral, every layer windowed": {"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
    "qwen2, layers 1 and 2 windowed": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "use_sliding_window": True,
        "max_window_layers": 1,
    },
}


@pytest.mark.parametrize("ring_chunk", [None, 8], ids=["block-tables", "rings"])
@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_sliding_window_layers_decode_fused_as_the_per_layer_loop_does(
    tmp_path, need_kernels, monkeypatch, family, ring_chunk
):
    """Decodes run well past the window (6), in rings or masked block tables, each layer kind in its view."""
    model = _windowed_model(tmp_path, {"sliding_window": 6, **WINDOWED[family]})
    runtime = model.runtime
    assert runtime.windowed and runtime.fused_decoder is not None
    calls = []
    run = decoder_layers.FusedDecoder.run
    monkeypatch.setattr(decoder_layers.FusedDecoder, "run", lambda self, *a: calls.append(1) or run(self, *a))
    prompts = PROMPTS[:3]
    fused_logits, fused_cache = _run_rings(model, True, prompts, ring_chunk)
    assert len(calls) == 12  # every decode step, no prefill
    plain_logits, plain_cache = _run_rings(model, False, prompts, ring_chunk)
    for got, expected in zip(fused_logits, plain_logits, strict=True):
        assert torch.equal(got, expected)
    for got, expected in zip(
        fused_cache.keys + fused_cache.values, plain_cache.keys + plain_cache.values, strict=True
    ):
        assert torch.equal(got, expected)


def test_a_ring_slot_outside_the_window_pool_raises_and_writes_nothing(tmp_path, need_kernels):
    model = _windowed_model(tmp_path, {"sliding_window": 6, **WINDOWED["mistral, every layer windowed"]})
    runner = PagedRunner(model, num_blocks=16, block_size=BLOCK, seed=3, ring_chunk=4)
    seq = PagedSequence(tokens=[])
    runner.step([seq], [[1, 2, 3]])
    before = [t.clone() for t in runner.cache.keys + runner.cache.values]
    runner.reserve(seq, 4)
    step = pack_step(
        [SequenceChunk([4], 3, list(seq.blocks), window_ring=seq.ring)],
        block_size=BLOCK,
        window=runner.window,
    )
    plan = model.runtime._window_plan(step, runner.cache)
    plan.slot_mapping[0] = runner.cache.keys[0].shape[0] * BLOCK  # one past the ring pool's last slot
    full = plan_attention(step, runner.cache.keys[0])
    x = torch.zeros(1, TINY_RAW["hidden_size"])
    rope = model.runtime.model.rotary_emb(step.positions, x.dtype)
    with pytest.raises(IndexError, match="outside"):
        model.runtime.fused_decoder.run(x, rope, step, full, runner.cache.keys, runner.cache.values, plan)
    assert all(
        torch.equal(a, b) for a, b in zip(before, runner.cache.keys + runner.cache.values, strict=True)
    )


# Wide enough for K-quant blocks (256 in): q/k/v/gate/up take hidden in, o Hq D = 256, down inner = 256.
WIDE_RAW = {**TINY_RAW, "hidden_size": 256, "intermediate_size": 256, "head_dim": 64}
Q = gguf.GGMLQuantizationType
MIXES = {
    # llama.cpp's Q4_K_M recipe on a small model: q/k and gate/up in Q5_0, v in Q8_0, o/down in K-quants
    "q4_k_m-like": {
        "q_proj.weight": Q.Q5_0,
        "k_proj.weight": Q.Q5_0,
        "v_proj.weight": Q.Q8_0,
        "o_proj.weight": Q.Q4_K,
        "gate_proj.weight": Q.Q5_0,
        "up_proj.weight": Q.Q5_0,
        "down_proj.weight": Q.Q6_K,
        "lm_head.weight": Q.Q6_K,
    },
    # the low-bit K-quant recipes' formats (Q2_K, Q3_K, Q5_K) and Q5_1, each part of gate/up its own
    "k-quants": {
        "q_proj.weight": Q.Q3_K,
        "k_proj.weight": Q.Q3_K,
        "v_proj.weight": Q.Q5_K,
        "o_proj.weight": Q.Q2_K,
        "gate_proj.weight": Q.Q5_1,
        "up_proj.weight": Q.Q2_K,
        "down_proj.weight": Q.Q5_K,
        "lm_head.weight": Q.Q3_K,
    },
    # every part of q/k/v and of gate/up in its own format
    "all-different": {
        "q_proj.weight": Q.Q4_K,
        "k_proj.weight": Q.Q4_1,
        "v_proj.weight": Q.Q6_K,
        "o_proj.weight": Q.Q8_0,
        "gate_proj.weight": Q.F16,
        "up_proj.weight": Q.BF16,
        "down_proj.weight": Q.Q4_0,
        "lm_head.weight": Q.Q4_K,
    },
}


def _mixed_model(tmp_path, mix: str, weights: str = "native", activations: str = "fp32") -> Model:
    path = tmp_path / f"mixed-{mix}.gguf"
    if not path.exists():
        state = random_state(WIDE_RAW, seed=9)
        qtype = formats_by_suffix(MIXES[mix], Q.Q8_0)
        write_gguf(path, "llama", state, WIDE_RAW, qtype=qtype, tokenizer=False)
    return Model(str(path), device="cpu", weights=weights, activations=activations)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_parts_in_different_formats_stay_on_the_fused_path(tmp_path, need_kernels, mix, batch):
    """q/k/v and gate/up stored in different formats are run as segments of one fused matrix: bit for bit
    the per-layer path, which runs them as separate GEMMs; every decode step takes the fused path."""
    model = _mixed_model(tmp_path, mix)
    runtime = model.runtime
    layer = runtime.model.layers[0]
    gate_up_apart = mix != "q4_k_m-like"  # which stores gate and up alike: one weight
    assert layer.self_attn.qkv is None and (layer.mlp.gate_up is None) == gate_up_apart
    assert runtime.fused_decoder is not None
    c_layer = runtime.fused_decoder._c_layers[0]
    assert (c_layer.qkv.num_segments, c_layer.gate_up.num_segments) == (3, 2 if gate_up_apart else 1)
    before = decoder_layers.FUSED_STEPS.count
    _assert_same(model, PROMPTS[:batch])
    assert decoder_layers.FUSED_STEPS.count - before == 5  # the five decode steps of the fused run


def test_a_mixed_model_matches_its_dequantised_float32_model(tmp_path, need_kernels):
    """The fused mixed-format decode computes the file's model: the float32 load of the same file (every
    weight dequantised at load, per-layer path) gives the same logits up to summation order."""
    native, dense = _mixed_model(tmp_path, "q4_k_m-like"), _mixed_model(tmp_path, "q4_k_m-like", "float32")
    assert native.runtime.fused_decoder is not None and dense.runtime.fused_decoder is None
    got, _ = _run(native, True, PROMPTS[:3])
    expected, _ = _run(dense, False, PROMPTS[:3])
    for g, e in zip(got, expected, strict=True):
        assert (g - e).abs().max().item() <= 1e-4


# ---- activations="q8": the 8-bit-activation kernels on the same one-region path ----

Q8_FLAG = 0x100  # kernels/quant_gemm.c QT_Q8_ACTIVATIONS


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_a_q8_model_decodes_fused_with_the_per_layer_bits(tmp_path, need_kernels, qtype, batch, threads):
    """With 8-bit activations every thread rounds each GEMM's x itself and runs its columns of the integer
    kernel: bit for bit the per-layer path (whole q8 GEMMs over all threads) at 1, 2 and 3 threads (3:
    uneven column slices, one thread without a kv head), and every decode step takes the fused path."""
    model = _gguf_model(tmp_path, qtype, activations="q8")
    c_layer = model.runtime.fused_decoder._c_layers[0]
    assert all(getattr(c_layer, w).segments[0].qtype & Q8_FLAG for w in ("qkv", "o", "gate_up", "down"))
    before = decoder_layers.FUSED_STEPS.count
    _assert_same(model, PROMPTS[:batch], threads)
    assert decoder_layers.FUSED_STEPS.count - before == 5
    exact, _ = _run(_gguf_model(tmp_path, qtype), True, PROMPTS[:batch])
    q8, _ = _run(model, True, PROMPTS[:batch])
    assert not torch.equal(exact[-1], q8[-1])  # the integer kernels ran


# Which segments of each fused matrix run the 8-bit-activation kernels in a mix loaded with activations="q8".
Q8_SEGMENTS = {
    # every format has a kernel: the 32-blocks (Q5_0, Q8_0) and the K-quants' 256-blocks (Q4_K, Q6_K)
    "q4_k_m-like": {"qkv": [True, True, True], "o": [True], "gate_up": [True], "down": [True]},
    # Q2_K and Q3_K stay exact beside Q5_K and Q5_1 in the same matrices
    "k-quants": {"qkv": [False, False, True], "o": [False], "gate_up": [True, False], "down": [True]},
    # q/k/v rounds its x to both block sizes (Q4_K, Q4_1, Q6_K); f16 / bf16 stay exact
    "all-different": {"qkv": [True, True, True], "o": [True], "gate_up": [False, False], "down": [True]},
}


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("mix", sorted(Q8_SEGMENTS))
def test_a_q8_model_with_k_quants_mixes_q8_and_exact_segments_in_one_step(
    tmp_path, need_kernels, mix, batch, threads
):
    """Mixed files with activations="q8": the segments with an integer kernel (32-block formats and Q4_K /
    Q5_K / Q6_K) run it, the others (Q2_K, Q3_K, f16, bf16) stay exact, in one fused step; bit for bit the
    per-layer path."""
    model = _mixed_model(tmp_path, mix, activations="q8")
    c_layer = model.runtime.fused_decoder._c_layers[0]
    flagged = {
        name: [bool(s.qtype & Q8_FLAG) for s in w.segments[: w.num_segments]]
        for name in ("qkv", "o", "gate_up", "down")
        for w in [getattr(c_layer, name)]
    }
    assert flagged == Q8_SEGMENTS[mix]
    before = decoder_layers.FUSED_STEPS.count
    _assert_same(model, PROMPTS[:batch], threads)
    assert decoder_layers.FUSED_STEPS.count - before == 5
