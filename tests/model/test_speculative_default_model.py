"""Speculative decoding on the default model: the prompt-lookup proposer changes nothing but the speed.

pg.LLM with ``speculative="ngram"`` must generate exactly the tokens of pg.LLM without it, greedy and
sampled (same seed: the verifier draws every row with the stream index its token has without drafts), for
prompts whose output copies the prompt (drafts mostly accepted: verification rows run on the multi-token path
instead of the single-token decode path, so their logits must pick the same tokens) and for ordinary chat
questions (drafts mostly rejected), batched together.
"""

from __future__ import annotations

import pytest

import pagedgen as pg
from pagedgen.bench.workloads import BENCH_TEXT, REPEAT_INSTRUCTION

pytestmark = pytest.mark.model

QUESTIONS = [
    "What is the capital of France?",
    "Explain what a hash table is in one sentence.",
    "List three primary colors.",
]


def prompts(tokenizer) -> list[list[int]]:
    paragraphs = [p.replace("\n", " ") for p in BENCH_TEXT.split("\n\n")][:3]
    texts = [REPEAT_INSTRUCTION + p for p in paragraphs] + QUESTIONS
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}])) for t in texts]


def generate(model, ids, params, **speculative) -> tuple[list[pg.CompletionOutput], pg.LLM]:
    config = pg.EngineConfig(max_batch_size=8, num_blocks=8 * 24, debug_invariants=True)
    llm = pg.LLM(model, config, **speculative)
    if llm.drafter is not None:  # propose in the whole batch too: verification rows beside plain decodes
        llm.drafter.max_batch = 8
    return llm.generate(ids, params, use_tqdm=False), llm


@pytest.mark.parametrize(
    "params",
    [
        pg.SamplingParams(max_tokens=64, temperature=0.0),
        pg.SamplingParams(max_tokens=48, temperature=0.7, seed=3),
    ],
    ids=["greedy", "sampled"],
)
def test_ngram_speculation_generates_exactly_the_same_tokens(default_model, params):
    ids = prompts(pg.Tokenizer(default_model))
    plain, _ = generate(default_model, ids, params)
    drafted, llm = generate(default_model, ids, params, speculative="ngram", num_speculative_tokens=5)
    for i, (a, b) in enumerate(zip(plain, drafted, strict=True)):
        assert b.token_ids == a.token_ids, f"prompt {i} diverged: {a.text!r} vs {b.text!r}"
        assert b.finish_reason == a.finish_reason
    stats = llm.engine.stats()
    assert stats.drafts_proposed == sum(o.drafts_proposed for o in drafted)
    repeats = drafted[:3]
    assert sum(o.drafts_accepted for o in repeats) > 0.5 * sum(o.drafts_proposed for o in repeats)
    assert stats.free_blocks == stats.total_blocks and stats.healthy
