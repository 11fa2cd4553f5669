"""``pagedgen serve --tensor-parallel-size 2`` on the default model: the flag reaches the engine config, and
the two-rank server answers greedy chat and completion requests with exactly the one-rank server's text
(the session's live server, same model, same requests)."""

from __future__ import annotations

import openai
import pytest

import pagedgen as pg
from pagedgen import cli
from pagedgen.engine.config import TENSOR_PARALLEL_LAUNCHERS, TENSOR_PARALLEL_PLACEMENTS
from pagedgen.server.app import ServerOptions, build_app
from tests.server.live import API_KEY, MODEL_NAME, LiveServer

pytestmark = [pytest.mark.model, pytest.mark.cpu]

CHATS = (
    [{"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
)


def test_the_flag_reaches_the_engine_config():
    args = cli.build_parser().parse_args(["serve", "--tensor-parallel-size", "2"])
    assert cli.engine_config(args).tensor_parallel_size == 2
    assert cli.engine_config(cli.build_parser().parse_args(["serve"])).tensor_parallel_size == 1


def test_the_launcher_flags_take_every_value_the_engine_config_accepts():
    for launcher in TENSOR_PARALLEL_LAUNCHERS:
        args = cli.build_parser().parse_args(["serve", "--tensor-parallel-launcher", launcher])
        assert cli.engine_config(args).tensor_parallel_launcher == launcher
    for placement in TENSOR_PARALLEL_PLACEMENTS:
        args = cli.build_parser().parse_args(["serve", "--tensor-parallel-placement", placement])
        assert cli.engine_config(args).tensor_parallel_placement == placement


def test_the_launcher_flags_reach_the_engine_config():
    argv = ["serve", "--tensor-parallel-launcher", "ray", "--tensor-parallel-placement", "SPREAD"]
    config = cli.engine_config(cli.build_parser().parse_args(argv))
    assert (config.tensor_parallel_launcher, config.tensor_parallel_placement) == ("ray", "SPREAD")
    config = cli.engine_config(cli.build_parser().parse_args(["serve"]))
    assert (config.tensor_parallel_launcher, config.tensor_parallel_placement) == ("local", "STRICT_PACK")


@pytest.mark.parametrize("flag", ["--tensor-parallel-launcher", "--tensor-parallel-placement"])
def test_an_unknown_launcher_or_placement_is_a_usage_error(flag, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", flag, "mp"])
    assert info.value.code == 2 and f"{flag}: invalid choice: 'mp'" in capsys.readouterr().err


def test_a_zero_size_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--tensor-parallel-size", "0"])
    assert info.value.code == 2 and "tensor-parallel-size" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tp_client(default_model):
    config = pg.EngineConfig(max_batch_size=4, num_blocks=128, tensor_parallel_size=2, debug_invariants=True)
    server = LiveServer(
        build_app(default_model, config, ServerOptions(model_name=MODEL_NAME, api_key=API_KEY))
    )
    server.start()
    yield openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=900)
    server.stop()


def test_two_ranks_serve_the_one_rank_greedy_text(client, tp_client):
    for messages in CHATS:
        want = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=24, temperature=0
        )
        got = tp_client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=24, temperature=0
        )
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.usage.completion_tokens == want.usage.completion_tokens > 0
    prompt = "The three primary colours are"
    want = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0)
    got = tp_client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0)
    assert got.choices[0].text == want.choices[0].text and want.choices[0].text
