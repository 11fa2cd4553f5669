"""``pagedgen serve --max-queued-requests``: default, bounds, and where it lands."""

from __future__ import annotations

import pytest

from pagedgen import cli
from pagedgen.server.admission import DEFAULT_MAX_QUEUED_REQUESTS
from pagedgen.server.app import ServerOptions


def test_max_queued_requests_defaults_to_the_server_default():
    args = cli.build_parser().parse_args(["serve"])
    assert args.max_queued_requests == DEFAULT_MAX_QUEUED_REQUESTS == ServerOptions().max_queued_requests
    assert cli.build_parser().parse_args(["serve", "--max-queued-requests", "0"]).max_queued_requests == 0


def test_a_negative_max_queued_requests_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--max-queued-requests", "-1"])
    assert info.value.code == 2
    assert "non-negative" in capsys.readouterr().err


def test_server_options_refuse_a_negative_queue():
    with pytest.raises(ValueError, match="max_queued_requests"):
        ServerOptions(max_queued_requests=-1)


def test_speculative_options_default_off_and_reach_the_server_options():
    args = cli.build_parser().parse_args(["serve"])
    assert (args.speculative, args.num_speculative_tokens) == (None, 4)
    args = cli.build_parser().parse_args(["serve", "--speculative", "ngram", "--num-speculative-tokens", "6"])
    assert (args.speculative, args.num_speculative_tokens) == ("ngram", 6)
    for command in ("generate", "chat"):
        assert (
            cli.build_parser()
            .parse_args([command, "--speculative", "ngram"] + (["x"] if command == "generate" else []))
            .speculative
            == "ngram"
        )


def test_an_unknown_speculative_method_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--speculative", "eagle"])
    assert info.value.code == 2
    assert "ngram" in capsys.readouterr().err


def test_parse_special_in_content_is_off_unless_asked_on_every_command():
    assert cli.build_parser().parse_args(["serve"]).parse_special_in_content is False
    assert ServerOptions().parse_special_in_content is False
    for argv in (["serve"], ["generate", "x"], ["chat"]):
        args = cli.build_parser().parse_args([*argv, "--parse-special-in-content"])
        assert args.parse_special_in_content is True
