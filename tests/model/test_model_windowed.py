"""Sliding-window models (Mistral, Qwen2 with its max_window_layers / layer_types mix) against transformers.

Tiny random-weight checkpoints written by transformers, window 6-8, sequences of 100+ tokens (over ten
windows): fp32 logits within 1e-4 at every position on every attention path (one prefill over block tables,
chunked prefill and decode through window rings, decode over block tables); through the engine, greedy
tokens equal transformers' while the window layers' blocks stay flat (the checks every family runs through
the engine are in test_family_conformance.py).
"""

from __future__ import annotations

import pytest
import torch

import pagedgen as pg
from tests.model.hf_cases import (
    check_greedy_with_flat_window,
    ids_of,
)
from tests.model.paged_runner import chunked_logits, prompt_logits, stepwise_logits
from tests.model.tiny_checkpoints import hf_state, tiny_hf_model, write_gguf
from tests.model.windowed_cases import CASES, Case

pytestmark = pytest.mark.model

TOL = 1e-4
LOGITS_INIT = 0.1  # logits tests: transformers' scale of the other tiny checkpoints, where 1e-4 is fp32 noise


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
