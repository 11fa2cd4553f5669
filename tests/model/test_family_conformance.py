"""What every family runs through the engine, against transformers on its tiny checkpoint: one module,
parametrized over the families.

Every family: a mixed batch equals each request alone, chunked prefill equals unchunked, and a rolled-back
step at every phase leaves every committed byte as it was and the retry's tokens exact. The families with
fixed (conv / recurrent) state (LFM2, Bamba): greedy tokens equal transformers' while the state slot is held
and returned on close, a second turn continues the state, a fatal step fails every turn and returns every
slot, and the static path refuses them. The sliding-window families (Gemma 2 / 3, Mistral, Qwen2): the
static path keeps their windowed layers in its one pool and masks them; the windowed configs also fail a
fatal step at every phase with both pools returned. What is particular to a family stays in its own module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

import pagedgen as pg
from tests.helpers import RECOVERABLE, RECOVERABLE_IDS, drain, submit, tokens_of
from tests.model.family_cases import FamilyCase
from tests.model.hf_cases import (
    check_chunked_equals_unchunked,
    check_fatal_step,
    check_greedy_and_slot_returns,
    check_mixed_batch,
    check_rollback_at,
    check_second_turn,
    ids_of,
    resident_pair,
    small_engine,
)
from tests.model.windowed_cases import CASES as WINDOWED_CASES
from tests.model.windowed_cases import Case as WindowedCase

pytestmark = pytest.mark.model

GEMMA_WINDOW = 8  # the sliding window of the tiny Gemma configs
FIXED_PROMPTS = [(3, 30), (17, 20), (41, 10)]  # (prompt length, generated tokens)
WINDOWED_PROMPTS = [(3, 40), (17, 25), (41, 12)]


def holds_both_states(before: dict) -> None:
    assert len(before["fixed"]["owners"]) == 2


def holds_both_states_mid_stream(before: dict) -> None:
    owners = before["fixed"]["owners"]
    assert len(owners) == 2
    assert all(any(v != 0 for v in state["mamba_ssm.3"]) for *_, state in owners.values())  # mid-stream


def holds_rings_and_tables(before: dict) -> None:
    assert before["free_window_blocks"] and all(len(t[2]) for t in before["tables"].values())


@dataclass(frozen=True)
class Family:
    """One family's case and what its engine checks need: a window (None: fixed state instead), its
    prompts, and what the rollback scenario's snapshot must hold before the fault."""

    name: str
    build: Callable[[Any], Any]
    window: int | None
    holds_state: Callable[[dict], None]

    @property
    def prompts(self) -> list[tuple[int, int]]:
        return FIXED_PROMPTS if self.window is None else WINDOWED_PROMPTS


FAMILIES = {
    "lfm2": Family("lfm2", lambda tmp: FamilyCase("lfm2", tmp), None, holds_both_states),
    "bamba": Family("bamba", lambda tmp: FamilyCase("bamba", tmp), None, holds_both_states_mid_stream),
    **{
        kind: Family(
            kind,
            functools.partial(FamilyCase, kind, tie_word_embeddings=False),
            GEMMA_WINDOW,
            holds_rings_and_tables,
        )
        for kind in ("gemma2", "gemma3")
    },
    **{
        name: Family(
            name,
            functools.partial(WindowedCase, name),
            WINDOWED_CASES[name][1]["sliding_window"],
            holds_rings_and_tables,
        )
        for name in WINDOWED_CASES
    },
}
FIXED_STATE = [name for name, family in FAMILIES.items() if family.window is None]
SLIDING_WINDOW = [name for name, family in FAMILIES.items() if family.window is not None]
WINDOWED_CONFIGS = list(WINDOWED_CASES)  # Mistral's and Qwen2's sliding-window configs


@pytest.fixture(scope="session")
def build_case(tmp_path_factory) -> Callable[[str], Any]:
    """Each family's case, built once per session whichever tests ask for it."""
    return functools.cache(lambda name: FAMILIES[name].build(tmp_path_factory))


@pytest.fixture(params=list(FAMILIES))
def family(request, build_case) -> tuple[Family, Any]:
    return FAMILIES[request.param], build_case(request.param)


def scenario(family: Family, model: pg.Model) -> tuple[pg.Engine, list[pg.Request]]:
    """A decoding request and a partial prefill, both resident: the fixed state mid-stream, or the decode
    well past its window."""
    if family.window is None:
        return resident_pair(model, generate=20, steps=6, past=10)
    return resident_pair(model, generate=30, steps=12, past=2 * family.window)


def test_a_mixed_batch_equals_each_request_alone(family):
    traits, case = family
    check_mixed_batch(case, traits.prompts)


def test_chunked_prefill_equals_unchunked(family):
    check_chunked_equals_unchunked(family[1])


@pytest.mark.parametrize("phase, error", RECOVERABLE, ids=RECOVERABLE_IDS)
def test_a_rollback_at_every_phase_leaves_the_state_exact(family, phase, error):
    traits, case = family
    check_rollback_at(lambda: scenario(traits, case.model), phase, error, traits.holds_state)


# ---- families with fixed (conv / recurrent) state ---------------------------------------------------


@pytest.mark.parametrize("family", FIXED_STATE, indirect=True)
def test_engine_greedy_equals_transformers_and_the_slot_returns_on_close(family):
    check_greedy_and_slot_returns(family[1])


@pytest.mark.parametrize("family", FIXED_STATE, indirect=True)
def test_a_second_turn_continues_the_fixed_state(family):
    check_second_turn(family[1])


@pytest.mark.parametrize("phase", ["execute", "prepare", "commit_cache"])
@pytest.mark.parametrize("family", FIXED_STATE, indirect=True)
def test_a_fatal_step_fails_every_turn_and_the_slots_return_on_close(family, phase):
    traits, case = family
    check_fatal_step(lambda: scenario(traits, case.model), phase, ("fixed_free_slots", "fixed_total_slots"))


@pytest.mark.parametrize("family", FIXED_STATE, indirect=True)
def test_the_static_path_refuses_a_fixed_state_model(family):
    with pytest.raises(pg.EngineError, match="needs dynamic_batching=True"):
        pg.Engine(family[1].model, pg.EngineConfig(num_blocks=16, dynamic_batching=False))


# ---- sliding-window families ------------------------------------------------------------------------


@pytest.mark.parametrize("family", SLIDING_WINDOW, indirect=True)
def test_the_static_path_keeps_windowed_layers_in_its_one_pool_and_masks_them(family):
    case = family[1]
    prompt = ids_of(30, seed=6)
    eng = small_engine(case.model, dynamic_batching=False, num_blocks=64)
    request = submit(eng, prompt, 40, ignore_eos=True)
    assert tokens_of(drain(eng))[request] == case.greedy(prompt, 40)
    assert eng.stats().window_total_blocks == 0


@pytest.mark.parametrize("phase", ["plan", "reserve", "execute", "commit_request", "commit_cache", "publish"])
@pytest.mark.parametrize("family", WINDOWED_CONFIGS, indirect=True)
def test_a_fatal_step_fails_every_turn_and_every_block_of_both_pools_returns(family, phase):
    traits, case = family
    check_fatal_step(
        lambda: scenario(traits, case.model), phase, ("window_free_blocks", "window_total_blocks")
    )
