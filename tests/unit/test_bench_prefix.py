"""``pagedgen bench prefix`` on the synthetic model: the workloads, both runs, the comparison, the CLI."""

from __future__ import annotations

import json

import pytest

import pagedgen as pg
from pagedgen.bench.cli import main
from pagedgen.bench.prefix import (
    MULTI_TURN,
    SHARED_PROMPT,
    build_prefix_workload,
    compare_caching,
    markdown_table,
)
from pagedgen.models.synthetic import SyntheticModel, synthetic_greedy

MODEL = SyntheticModel()
SIZES = {"concurrency": 2, "system_len": 64, "requests": 6, "turns": 3, "question_len": 8, "output_len": 5}


def config() -> pg.EngineConfig:
    return pg.EngineConfig(max_batch_size=4, block_size=8, num_blocks=128, debug_invariants=True)


def test_workloads_are_deterministic_and_shaped_as_named():
    shared = build_prefix_workload(SHARED_PROMPT, MODEL.tokenizer, **SIZES)
    assert shared == build_prefix_workload(SHARED_PROMPT, MODEL.tokenizer, **SIZES)
    assert len(shared.system) == 64 and shared.num_requests == 6 and not shared.keep_history
    questions = [ids for client in shared.clients for ids, _ in client]
    assert len(set(questions)) == 6 and all(len(q) == 8 for q in questions)
    multi = build_prefix_workload(MULTI_TURN, MODEL.tokenizer, **SIZES)
    assert multi.keep_history and [len(c) for c in multi.clients] == [3, 3]
    with pytest.raises(ValueError, match="unknown prefix workload"):
        build_prefix_workload("nope", MODEL.tokenizer)


@pytest.mark.parametrize("name", [SHARED_PROMPT, MULTI_TURN])
def test_caching_computes_less_prefill_and_generates_the_same_tokens(name):
    workload = build_prefix_workload(name, MODEL.tokenizer, **SIZES)
    result = compare_caching(MODEL, workload, config(), log=lambda _: None)
    assert result.identical and len(result.on.ttft_s) == workload.num_requests
    assert result.off.prefill_computed == result.off.prompt_tokens == result.on.prompt_tokens
    assert result.on.prefill_computed < result.off.prefill_computed
    # Every output is the closed formula of its prompt (the history re-sent for multi-turn).
    client = workload.clients[0]
    history = list(workload.system)
    for turn, (ids, n) in enumerate(client):
        prompt = history + list(ids)
        assert result.on.outputs[turn] == synthetic_greedy(prompt, n, MODEL.vocab_size)
        if workload.keep_history:
            history = prompt + result.on.outputs[turn]
    row = result.to_dict()
    assert row["identical_tokens"] and row["prefill_tokens_ratio"] > 1
    assert "| TTFT p50 off/on |" in markdown_table([result])


def test_cli_writes_both_runs(tmp_path, capsys):
    path = tmp_path / "prefix.json"
    argv = ["prefix", "--model", "synthetic", "--system-len", "32", "--requests", "4", "--turns", "2"]
    argv += ["--question-len", "6", "--output-len", "3", "--num-blocks", "128", "--json", str(path)]
    assert main(argv) == 0
    document = json.loads(path.read_text())
    assert [r["workload"] for r in document["results"]] == [SHARED_PROMPT, MULTI_TURN]
    assert all(r["identical_tokens"] for r in document["results"])
    assert "prefill computed off/on" in capsys.readouterr().out
