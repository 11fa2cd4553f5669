"""Sliding-window models (Mistral, Qwen2 with its max_window_layers / layer_types mix) against transformers.

Tiny random-weight checkpoints written by transformers, window 6-8, sequences of 100+ tokens (over ten
windows): fp32 logits within 1e-4 at every position on every attention path (one prefill over block tables,
chunked prefill and decode through window rings, decode over block tables); through the engine, greedy
tokens equal transformers' while the window layers' blocks stay flat; a mixed batch equals each request
alone; chunked prefill equals unchunked; a rolled-back step at every phase leaves the state exact.
"""

from __future__ import annotations

import pytest
import torch

import pagedgen as pg
from pagedgen.core.window import ring_blocks
from tests.helpers import drain, engine_snapshot, event_key, record_steps, submit, tokens_of
from tests.model.hf_cases import RECOVERABLE, RECOVERABLE_IDS, greedy_by_forwards, ids_of, small_engine
from tests.model.paged_runner import chunked_logits, prompt_logits, stepwise_logits
from tests.model.tiny_checkpoints import hf_state, tiny_hf_model, write_gguf

pytestmark = pytest.mark.model

TOL = 1e-4
INIT = 0.3  # engine tests: large enough weights that greedy continuations do not collapse into a repeat
LOGITS_INIT = 0.1  # logits tests: transformers' scale of the other tiny checkpoints, where 1e-4 is fp32 noise

CASES = {  # name: (family, config overrides, windowed layers, what turns the window off)
    "mistral": ("mistral", {"sliding_window": 8}, (0, 1), {"sliding_window": None}),
    "qwen2-max-window-layers": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "num_hidden_layers": 3},
        (1, 2),
        {"use_sliding_window": False},
    ),
    "qwen2-layer-types": (
        "qwen2",
        {
            "use_sliding_window": True,
            "sliding_window": 6,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
        (0, 2),
        {"use_sliding_window": False, "layer_types": None},
    ),
}


class Case:
    def __init__(self, name, tmp_path_factory, init=INIT):
        family, overrides, self.windowed, off = CASES[name]
        self.hf = tiny_hf_model(family, initializer_range=init, **overrides)
        self.hf_full = tiny_hf_model(family, initializer_range=init, **{**overrides, **off})  # same weights
        path = tmp_path_factory.mktemp(name)
        self.hf.save_pretrained(path)
        self.model = pg.Model(str(path), device="cpu")
        self.window = overrides["sliding_window"]

    def reference(self, ids, full=False):
        with torch.no_grad():
            return (self.hf_full if full else self.hf)(torch.tensor([ids])).logits[0].float()

    def greedy(self, ids, n):
        """Greedy continuation by whole-sequence forwards (no cache). Not ``generate()``: on the Qwen2 mix of
        full and sliding layers transformers 5.24's ``generate`` returns first-step logits that differ from
        its own forward over the same prompt, while every forward agrees with ours."""
        return greedy_by_forwards(self.hf, ids, n)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory) -> Case:
    return Case(request.param, tmp_path_factory)


@pytest.fixture(params=list(CASES))
def logits_case(request, tmp_path_factory) -> Case:
    return Case(request.param, tmp_path_factory, init=LOGITS_INIT)


def test_the_manifest_names_the_configs_windowed_layers(case):
    assert case.model.state_manifest.window_layers == case.windowed
    assert case.model.kv_spec.window_layers == case.windowed and case.model.max_context == 256


def test_logits_match_transformers_far_past_the_window(logits_case):
    case = logits_case
    ids = ids_of(120)
    ref = case.reference(ids)
    # The window matters here: without it the later positions' logits are far off.
    assert (ref[2 * case.window :] - case.reference(ids, full=True)[2 * case.window :]).abs().max() > 0.1
    for logits in (
        prompt_logits(case.model, ids),  # one prefill, windowed layers masked over block tables
        chunked_logits(
            case.model, ids, chunk=5
        ),  # chunked prefill through rings, wrapping every 12 positions
        chunked_logits(case.model, ids, chunk=1),  # decode through rings (the native windowed kernel)
        stepwise_logits(case.model, ids, prefill=13),  # decode over block tables
    ):
        assert (logits - ref).abs().max().item() <= TOL


def test_engine_greedy_equals_transformers_and_window_blocks_stay_flat(case):
    prompt, n = ids_of(24, seed=1), 96
    eng = small_engine(case.model)
    request = submit(eng, prompt, n, ignore_eos=True)
    cache = eng._scheduler.cache
    rings, window_free, full_blocks, tokens = [], [], [], []
    buffer = eng.create_event_buffer(16)
    while eng.has_pending_requests():
        tokens += [e.token for e in eng.run(buffer) if e.flags & pg.EngineEventFlags.TOKEN]
        if cache.is_resident(request.id):
            rings.append(cache.window_ring(request.id))
            window_free.append(eng.stats().window_free_blocks)
            full_blocks.append(len(cache.block_table(request.id)))
    assert tokens == case.greedy(prompt, n)
    r = ring_blocks(5, case.window, 4)
    assert len(set(rings)) == 1 and len(rings[0]) == r  # one ring, never grown, never replaced
    stats = eng.stats()
    assert set(window_free) == {stats.window_total_blocks - r} and stats.window_total_blocks == 4 * r
    assert full_blocks[-1] == 30 > full_blocks[0]  # the full pool grows with the sequence (120 tokens / 4)
    request.close()
    stats = eng.stats()
    assert (stats.free_blocks, stats.window_free_blocks) == (stats.total_blocks, stats.window_total_blocks)


PROMPTS = [(3, 40), (17, 25), (41, 12)]  # (prompt length, generated tokens)


def test_a_mixed_batch_equals_each_request_alone(case):
    prompts = [ids_of(length, seed=10 + i) for i, (length, _) in enumerate(PROMPTS)]
    alone = []
    for prompt, (_, n) in zip(prompts, PROMPTS, strict=True):
        eng = small_engine(case.model)
        request = submit(eng, prompt, n, ignore_eos=True)
        alone.append(tokens_of(drain(eng))[request])
    eng = small_engine(case.model, max_scheduled_tokens=12)  # chunked, mixed prefill + decode steps
    steps = record_steps(eng)
    requests = [submit(eng, p, n, ignore_eos=True) for p, (_, n) in zip(prompts, PROMPTS, strict=True)]
    together = tokens_of(drain(eng))
    assert [together[r] for r in requests] == alone
    assert any(len(q_lens) == 3 and max(q_lens) > 1 and min(q_lens) == 1 for q_lens, _ in steps)
    assert alone[2] == case.greedy(prompts[2], PROMPTS[2][1])


def test_chunked_prefill_equals_unchunked(case):
    prompt = ids_of(50, seed=3)
    outputs = []
    for chunk in (3, None):  # None: C is the token budget, the prompt runs in one step
        eng = small_engine(case.model, chunk_size=chunk, max_batch_size=2)
        steps = record_steps(eng)
        request = submit(eng, prompt, 20, ignore_eos=True)
        outputs.append(tokens_of(drain(eng))[request])
        assert steps[0][0] == [3 if chunk else 50]
    assert outputs[0] == outputs[1] == case.greedy(prompt, 20)


def scenario(case: Case) -> tuple[pg.Engine, list[pg.Request]]:
    """A decoding request well past its window and a partial prefill, both resident."""
    eng = small_engine(case.model, max_scheduled_tokens=8)
    requests = [submit(eng, ids_of(10, seed=4), 30, ignore_eos=True)]
    for _ in range(12):
        eng.run(max_events=64)
    requests.append(submit(eng, ids_of(23, seed=5), 6, ignore_eos=True))
    eng.run(max_events=64)
    assert 0 < requests[1].processed_length < 23 and requests[0].processed_length > 2 * case.window
    return eng, requests


@pytest.mark.parametrize("phase, error", RECOVERABLE, ids=RECOVERABLE_IDS)
def test_a_rollback_at_every_phase_leaves_the_state_exact(case, phase, error):
    reference, _ = scenario(case)
    expected = [event_key(e) for e in drain(reference)]
    eng, requests = scenario(case)
    before = engine_snapshot(eng)
    assert before["free_window_blocks"] and all(len(t[2]) for t in before["tables"].values())
    eng._faults.arm(phase, error)
    (event,) = eng.run(max_events=64)
    assert event.request is None and event.flags & (
        pg.EngineEventFlags.RETRYABLE | pg.EngineEventFlags.CAPACITY_BLOCKED
    )
    assert engine_snapshot(eng) == before and eng.check_invariants() == []
    assert [event_key(e) for e in drain(eng)] == expected  # the retry writes the ring exactly as before


@pytest.mark.parametrize("phase", ["plan", "reserve", "execute", "commit_request", "commit_cache", "publish"])
def test_a_fatal_step_fails_every_turn_and_every_block_of_both_pools_returns(case, phase):
    eng, requests = scenario(case)
    eng._faults.arm(phase)
    drain(eng)
    assert not eng.stats().healthy
    assert all(r.status is pg.RequestStatus.TURN_COMPLETE for r in requests)
    for request in requests:
        request.close()
    stats = eng.stats()
    assert (stats.free_blocks, stats.window_free_blocks) == (stats.total_blocks, stats.window_total_blocks)


def test_the_static_path_keeps_windowed_layers_in_its_one_pool_and_masks_them(case):
    prompt = ids_of(30, seed=6)
    eng = small_engine(case.model, dynamic_batching=False, num_blocks=64)
    request = submit(eng, prompt, 40, ignore_eos=True)
    assert tokens_of(drain(eng))[request] == case.greedy(prompt, 40)
    assert eng.stats().window_total_blocks == 0


@pytest.mark.parametrize("windowed", [True, False], ids=["window-key", "no-window-key"])
def test_a_mistral_gguf_attends_within_the_window_its_metadata_gives(tmp_path, windowed):
    """llama.cpp converts Mistral to its ``llama`` architecture; ``llama.attention.sliding_window``, when the
    file has it, windows every layer (as HF Mistral's ``sliding_window``), and a file without it attends
    over the whole context, as llama.cpp runs it."""
    hf = tiny_hf_model("mistral", initializer_range=LOGITS_INIT, sliding_window=8)
    hf_full = tiny_hf_model("mistral", initializer_range=LOGITS_INIT, sliding_window=None)  # same weights
    path = tmp_path / "mistral.gguf"
    config = hf.config.to_dict()
    write_gguf(path, "llama", hf_state(hf), config, tokenizer=False, sliding_window=8 if windowed else None)
    model = pg.Model(str(path), device="cpu", weights="float32")
    assert model.state_manifest.window_layers == ((0, 1) if windowed else ())
    ids = ids_of(40)
    with torch.no_grad():
        ref = (hf if windowed else hf_full)(torch.tensor([ids])).logits[0].float()
        other = (hf_full if windowed else hf)(torch.tensor([ids])).logits[0].float()
    assert (other - ref).abs().max().item() > 1e-2  # the window changes the logits: the check can fail
    for logits in (prompt_logits(model, ids), chunked_logits(model, ids, chunk=3)):
        assert (logits - ref).abs().max().item() <= TOL
