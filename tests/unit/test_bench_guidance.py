"""``pagedgen bench guidance`` on the synthetic model: the timed phase, the mask counters, the report."""

from __future__ import annotations

import json

import jsonschema
import pytest

import pagedgen as pg
from pagedgen.bench.cli import main
from pagedgen.bench.guidance import (
    DEFAULT_SCHEMA,
    compare_guidance,
    guidance_prompts,
    markdown_table,
    run_guidance_batch,
)
from pagedgen.errors import EngineError
from pagedgen.models.synthetic import SyntheticModel

MODEL = SyntheticModel()


class ChatTokenizer:
    """The synthetic codec plus a chat template that is just the user's text."""

    def __init__(self, model: SyntheticModel):
        self.codec = model.tokenizer

    def apply_chat_template(self, messages, tokenize=False):
        text = "".join(m["content"] for m in messages)
        return self.codec.encode(text) if tokenize else text


def config() -> pg.EngineConfig:
    return pg.EngineConfig(max_batch_size=4, block_size=8, num_blocks=256, debug_invariants=True)


def test_prompts_differ_and_come_from_the_chat_template():
    prompts = guidance_prompts(ChatTokenizer(MODEL), 4)
    assert len({tuple(p) for p in prompts}) == 4
    assert MODEL.tokenizer.decode(prompts[1]).startswith("List the people of a hospital (#1)")


@pytest.mark.parametrize("guided", [False, True])
def test_a_run_times_every_full_batch_decode_step(guided):
    prompts = guidance_prompts(ChatTokenizer(MODEL), 3)
    run = run_guidance_batch(MODEL, prompts, config(), DEFAULT_SCHEMA if guided else None, 9)
    assert run.guided is guided
    assert [len(out) for out in run.outputs] == [9, 9, 9]
    # The prompts share full blocks, so the first step prefills one of them and the next the others (the
    # shared prefix is computed once): the second step gives two first tokens, and the last request ends a
    # step after the first one. Timed: steps 3..9, while all three decode.
    assert len(run.step_s) == 7
    assert all(s > 0 for s in run.step_s)
    if guided:
        assert run.mask_s > 0
        text = MODEL.tokenizer.decode(run.outputs[0])
        assert text == '{"people"'  # one character per synthetic token, none free yet
    else:
        assert run.mask_s == 0 and run.wait_s == 0


def test_the_default_schema_cannot_complete_within_a_short_run():
    smallest = {"people": [{"name": "abc", "age": 0, "city": "", "role": "farmer"}] * 6}
    jsonschema.validate(smallest, DEFAULT_SCHEMA)
    assert len(json.dumps(smallest, separators=(",", ":"))) > 64 * 2  # over two characters per token


def test_a_grammar_that_completes_early_is_reported_not_timed():
    prompts = guidance_prompts(ChatTokenizer(MODEL), 2)
    with pytest.raises(EngineError, match="ended early with eos"):
        run_guidance_batch(MODEL, prompts, config(), {"enum": ["a"]}, 8)


def test_compare_alternates_modes_and_reports_the_overhead():
    result = compare_guidance(MODEL, ChatTokenizer(MODEL), config(), batch=2, output_len=5, repeats=2)
    assert [run.guided for run in result.runs] == [False, True, False, True]
    d = result.to_dict()
    assert d["repeats"] == 2 and d["batch"] == 2 and d["output_len"] == 5
    assert d["overhead"] == pytest.approx(d["guided_step_ms_p50"] / d["unguided_step_ms_p50"] - 1)
    assert d["mask_ms_per_step"] > 0
    assert "| 2 | 5 |" in markdown_table(result)


def test_the_cli_writes_the_comparison(tmp_path, capsys):
    out = tmp_path / "guidance.json"
    args = ["guidance", "--model", "synthetic", "--batch", "2", "--output-len", "4", "--repeats", "1"]
    assert main([*args, "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    assert document["command"].startswith("pagedgen bench guidance --model synthetic")
    assert document["result"]["batch"] == 2 and document["result"]["repeats"] == 1
    assert "guided step p50" in capsys.readouterr().out


def test_plain_prompts_without_a_chat_template():
    assert guidance_prompts(MODEL.tokenizer, 1) == [
        MODEL.tokenizer.encode(
            "List the people of a small village (#0) as JSON with name, age, city and role."
        )
    ]
