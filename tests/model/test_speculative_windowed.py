"""Speculative drafts on tiny sliding-window models (Mistral, Qwen2) against transformers' greedy oracle.

Verification rows attend token by token through the window rings, each token from its own window start; with
right, wrong and partly right drafts the output is still transformers' greedy continuation.
"""

from __future__ import annotations

import pytest

import pagedgen as pg
from tests.helpers import submit
from tests.model.hf_cases import ids_of, small_engine
from tests.model.windowed_cases import CASES, Case

pytestmark = pytest.mark.model


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory) -> Case:
    return Case(request.param, tmp_path_factory)


def test_drafts_verified_through_the_rings_keep_the_greedy_tokens(case):
    """Verification rows attend token by token through the window rings (each token's own window start);
    with right, wrong and partly right drafts the output is still transformers' greedy continuation."""
    prompt, n = ids_of(24, seed=1), 60
    oracle = case.greedy(prompt, n)
    eng = small_engine(case.model)
    assert eng.max_draft_tokens_per_proposal() == 4  # chunk_size 5 is the rings' C
    request = submit(eng, prompt, n, ignore_eos=True)
    buffer = eng.create_event_buffer(16)
    tokens, proposals = [], 0
    while eng.has_pending_requests():
        if request.ready_for_drafts:
            done = request.sequence_length - len(prompt)
            right = oracle[done : done + 4]
            drafts = [right, right[:2] + [(t + 1) % 260 for t in right[2:]], [(t + 1) % 260 for t in right]]
            request.set_draft_tokens(drafts[proposals % 3])
            proposals += 1
        tokens += [e.token for e in eng.run(buffer) if e.flags & pg.EngineEventFlags.TOKEN]
    assert tokens == oracle
    assert 0 < request.drafts_accepted < request.drafts_proposed
    request.close()
