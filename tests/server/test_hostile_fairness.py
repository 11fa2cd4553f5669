"""Hostile input, latency fairness: one long prompt arriving beside a running stream must not freeze it.

The probe: a 2,750-token prompt sent while a stream decodes, on a server with the default engine budgets.
Before ``max_mixed_step_tokens`` the prompt was prefilled in one 2,048-token step (on the default model on
two CPU cores, a 25.8 s gap in the stream). Here the synthetic model is paced: each forward waits for a
permit from the test, so the test knows which step the long prompt joins (one where the stream decodes)
and nothing depends on timing. The assertions are on structure: the exact rows of every step (the prompt
in chunks of the mixed budget, each beside the stream's decode), both texts exactly, every block free after.
"""

from __future__ import annotations

import threading

import pytest
import torch

import pagedgen as pg
from pagedgen.engine.config import resolve_mixed_step_tokens
from pagedgen.models.synthetic import SyntheticModel, SyntheticTokenizer
from pagedgen.server.app import ServerOptions, build_app
from tests.server.doubles import VOCAB, app_state, client_of, expected_text, settled_metrics, wait_until
from tests.server.live import LiveServer

LONG_PROMPT = [(7 * i + 5) % (VOCAB - 3) + 3 for i in range(2750)]  # the probe's length
STREAM_PROMPT = [4, 5, 6]
STREAM_TOKENS = 60
NUM_BLOCKS = 256


class PacedModel(SyntheticModel):
    """Each forward waits for a permit until ``run_free()``; ``steps`` records every forward's query rows."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.permits = threading.Semaphore(0)
        self.free = threading.Event()
        self.steps: list[list[int]] = []

    def forward(self, inputs, kv_cache):
        if not self.free.is_set():
            self.permits.acquire()
        self.steps.append([int(n) for n in inputs.query_lens.tolist()])
        return super().forward(inputs, kv_cache)

    def step_once(self) -> None:
        """Let one forward run and wait until it has."""
        done = len(self.steps) + 1
        self.permits.release()
        wait_until(lambda: len(self.steps) >= done, "a paced step ran")

    def run_free(self) -> None:
        self.free.set()
        self.permits.release()  # the forward waiting now


@pytest.fixture
def paced():
    """A server with the default budgets (``pagedgen serve``'s), on the paced synthetic model."""
    model = PacedModel(vocab_size=VOCAB)
    config = pg.EngineConfig(max_batch_size=8, num_blocks=NUM_BLOCKS, debug_invariants=True)
    app = build_app(model, config, ServerOptions(model_name="synthetic"), tokenizer=SyntheticTokenizer(VOCAB))
    server = LiveServer(app).start()
    yield server, model, resolve_mixed_step_tokens(config, torch.device(model.device))
    model.run_free()
    server.stop()


def _complete(server, prompt: list[int], max_tokens: int, out: dict, key: str) -> None:
    stream = client_of(server).completions.create(
        model="synthetic", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    out[key] = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)


def test_a_long_prompt_beside_a_stream_is_prefilled_in_chunks_between_its_tokens(paced):
    server, model, budget = paced
    assert budget == 512  # the CPU default: the synthetic model runs on the CPU
    worker = app_state(server).worker
    texts: dict[str, str] = {}
    stream = threading.Thread(target=_complete, args=(server, STREAM_PROMPT, STREAM_TOKENS, texts, "stream"))
    stream.start()
    wait_until(lambda: worker.snapshot.jobs == 1, "the stream was submitted")
    model.step_once()  # the stream's prefill: it decodes from now on
    long = threading.Thread(target=_complete, args=(server, LONG_PROMPT, 2, texts, "long"))
    long.start()
    while worker.snapshot.jobs < 2:  # the worker applies the submission between two steps
        assert len(model.steps) < STREAM_TOKENS // 2, "the long prompt never reached the engine"
        model.step_once()
    model.run_free()
    stream.join()
    long.join()

    assert texts == {
        "stream": expected_text(STREAM_PROMPT, STREAM_TOKENS),
        "long": expected_text(LONG_PROMPT, 2),
    }
    steps = model.steps
    assert steps[0] == [len(STREAM_PROMPT)]
    join = next(i for i, rows in enumerate(steps) if i > 0 and len(rows) > 1)  # the long prompt's first
    assert steps[1:join] == [[1]] * (join - 1)  # the stream alone, decoding
    chunk = budget - 1  # what the stream's decode row leaves of the mixed budget
    full, last = divmod(len(LONG_PROMPT), chunk)
    prefill = [[1, chunk]] * full + [[1, last]]
    assert steps[join : join + len(prefill)] == prefill
    # The stream got a token in every chunk's step: 5 before the long prompt's first one.
    assert full == 5 and max(sum(rows) for rows in steps) == budget
    after = steps[join + len(prefill) :]
    assert after == [[1, 1]] + [[1]] * (STREAM_TOKENS - join - len(prefill) - 1)
    settled_metrics(server)
    snapshot = worker.snapshot
    assert (snapshot.free_blocks, snapshot.jobs) == (NUM_BLOCKS, 0)
