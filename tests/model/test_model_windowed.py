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
from tests.helpers import RECOVERABLE, RECOVERABLE_IDS, drain, submit, tokens_of
from tests.model.hf_cases import (
    check_chunked_equals_unchunked,
    check_fatal_step,
    check_greedy_with_flat_window,
    check_mixed_batch,
    check_rollback_at,
    greedy_by_forwards,
    ids_of,
    resident_pair,
    small_engine,
)
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
    check_greedy_with_flat_window(case, case.window)


PROMPTS = [(3, 40), (17, 25), (41, 12)]  # (prompt length, generated tokens)


def test_a_mixed_batch_equals_each_request_alone(case):
    check_mixed_batch(case, PROMPTS)


def test_chunked_prefill_equals_unchunked(case):
    check_chunked_equals_unchunked(case)


def scenario(case: Case) -> tuple[pg.Engine, list[pg.Request]]:
    """A decoding request well past its window and a partial prefill, both resident."""
    return resident_pair(case.model, generate=30, steps=12, past=2 * case.window)


@pytest.mark.parametrize("phase, error", RECOVERABLE, ids=RECOVERABLE_IDS)
def test_a_rollback_at_every_phase_leaves_the_state_exact(case, phase, error):
    def holds_rings_and_tables(before: dict) -> None:
        assert before["free_window_blocks"] and all(len(t[2]) for t in before["tables"].values())

    check_rollback_at(lambda: scenario(case), phase, error, holds_rings_and_tables)


@pytest.mark.parametrize("phase", ["plan", "reserve", "execute", "commit_request", "commit_cache", "publish"])
def test_a_fatal_step_fails_every_turn_and_every_block_of_both_pools_returns(case, phase):
    check_fatal_step(lambda: scenario(case), phase, ("window_free_blocks", "window_total_blocks"))


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
