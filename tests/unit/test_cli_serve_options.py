"""``pagedgen serve`` options: defaults, bounds, and where they land (queue, speculation, connections and
shutdown, the Host allow-list)."""

from __future__ import annotations

import pytest

from pagedgen import cli
from pagedgen.server.admission import DEFAULT_MAX_QUEUED_REQUESTS, Admission
from pagedgen.server.app import ServerOptions
from pagedgen.server.guard import host_allowed


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


# ---------------------------------------------------------------- connections and shutdown


def _serve_args(monkeypatch, *flags: str):
    monkeypatch.delenv("PAGEDGEN_API_KEY", raising=False)
    return cli.build_parser().parse_args(["serve", *flags])


def test_connection_and_shutdown_flags_default_to_the_server_defaults(monkeypatch):
    options = cli.server_options(_serve_args(monkeypatch))
    defaults = ServerOptions()
    assert (options.shutdown_timeout, options.header_timeout, options.body_timeout) == (30.0, 10.0, 30.0)
    assert options.keep_alive_timeout == 5.0 and options.docs is True
    for name in ("shutdown_timeout", "header_timeout", "body_timeout", "keep_alive_timeout", "docs"):
        assert getattr(options, name) == getattr(defaults, name)
    assert options.allowed_hosts == frozenset()  # the default bind is loopback and keyless: Host is checked


def test_connection_flags_reach_the_server_options(monkeypatch):
    args = _serve_args(
        monkeypatch,
        *("--shutdown-timeout", "0", "--header-timeout", "2.5", "--body-timeout", "7"),
        *("--keep-alive-timeout", "1", "--no-docs", "--allowed-host", "Box.LAN", "--allowed-host", "b."),
    )
    options = cli.server_options(args)
    assert (options.shutdown_timeout, options.header_timeout, options.body_timeout) == (0.0, 2.5, 7.0)
    assert options.keep_alive_timeout == 1.0 and options.docs is False
    assert options.allowed_hosts == frozenset({"box.lan", "b"})


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ((), frozenset()),
        (("--host", "localhost"), frozenset()),
        (("--host", "::1"), frozenset()),
        (("--host", "127.0.0.2"), frozenset()),
        (("--api-key", "K"), None),  # the key protects the server; a browser page cannot send it
        (("--host", "0.0.0.0"), None),
        (("--host", "0.0.0.0", "--allowed-host", "gpu.lan"), frozenset({"gpu.lan"})),
        (("--api-key", "K", "--allowed-host", "gpu.lan"), frozenset({"gpu.lan"})),
    ],
)
def test_the_host_check_is_on_for_a_keyless_loopback_bind_or_named_hosts(monkeypatch, flags, expected):
    assert cli.server_options(_serve_args(monkeypatch, *flags)).allowed_hosts == expected


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--shutdown-timeout", "-1", "non-negative"),
        ("--shutdown-timeout", "nan", "non-negative"),
        ("--header-timeout", "0", "positive"),
        ("--body-timeout", "inf", "positive"),
        ("--keep-alive-timeout", "-0.5", "positive"),
    ],
)
def test_a_bad_timeout_is_a_usage_error(capsys, flag, value, message):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and message in err and value in err


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("shutdown_timeout", -1.0),
        ("header_timeout", 0.0),
        ("body_timeout", float("nan")),
        ("keep_alive_timeout", -2),
    ],
)
def test_server_options_refuse_a_bad_timeout(field, value):
    with pytest.raises(ValueError, match=f"ServerOptions.{field}"):
        ServerOptions(**{field: value})


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        (b"localhost", True),
        (b"localhost:8000", True),
        (b"LocalHost.:1", True),
        (b"127.0.0.1", True),
        (b"127.0.0.1:65535", True),
        (b"127.9.9.9", True),
        (b"[::1]", True),
        (b"[::1]:8000", True),
        (b"box.lan:80", True),  # added below
        (None, False),
        (b"", False),
        (b"evil.example", False),
        (b"evil.example:8000", False),
        (b"localhost.evil.example", False),
        (b"127.0.0.1.evil.example", False),
        (b"localhost:80x", False),
        (b"[::1]x", False),
        (b"10.0.0.1", False),
        (b"::1", False),  # an IPv6 address in Host needs its brackets
        (b"\xff", False),
    ],
)
def test_host_allowed(host, allowed):
    assert host_allowed(host, frozenset({"box.lan"})) is allowed


def test_admission_refuses_once_closed_and_held_tickets_still_release():
    admission = Admission(max_running=2, max_queued=0)
    held = admission.admit()
    admission.close()
    assert admission.admit() is None and admission.in_flight == 1
    held.release()
    assert admission.in_flight == 0 and admission.admit() is None


def test_parse_special_in_content_is_off_unless_asked_on_every_command():
    assert cli.build_parser().parse_args(["serve"]).parse_special_in_content is False
    assert ServerOptions().parse_special_in_content is False
    for argv in (["serve"], ["generate", "x"], ["chat"]):
        args = cli.build_parser().parse_args([*argv, "--parse-special-in-content"])
        assert args.parse_special_in_content is True


def test_response_store_flags_default_to_the_store_defaults_and_reach_the_server_options(monkeypatch):
    from pagedgen.server.responses_api.store import StoreLimits

    assert cli.server_options(_serve_args(monkeypatch)).response_store == StoreLimits()
    assert ServerOptions().response_store == StoreLimits()
    args = _serve_args(
        monkeypatch,
        "--responses-max-stored",
        "3",
        "--responses-max-bytes",
        "4096",
        "--responses-max-age",
        "9",
    )
    assert cli.server_options(args).response_store == StoreLimits(3, 4096, 9.0)


def test_a_zero_response_age_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--responses-max-age", "0"])
    assert info.value.code == 2
    assert "positive number of seconds" in capsys.readouterr().err


def test_tool_call_flags_default_to_auto_on_and_a_detected_format():
    from pagedgen.server.tool_parsers import TOOL_CALL_PARSERS

    options = cli.server_options(cli.build_parser().parse_args(["serve"]))
    assert (options.enable_auto_tool_choice, options.tool_call_parser) == (True, None)
    assert (ServerOptions().enable_auto_tool_choice, ServerOptions().tool_call_parser) == (True, None)
    flags = ["serve", "--no-enable-auto-tool-choice", "--tool-call-parser", "mistral"]
    options = cli.server_options(cli.build_parser().parse_args(flags))
    assert (options.enable_auto_tool_choice, options.tool_call_parser) == (False, "mistral")
    assert cli.build_parser().parse_args(["serve", "--enable-auto-tool-choice"]).enable_auto_tool_choice
    serve = cli.build_parser().subcommands["serve"]
    (choices,) = [a.choices for a in serve._actions if a.dest == "tool_call_parser"]
    assert tuple(choices) == TOOL_CALL_PARSERS  # the flag lists every parser there is


def test_an_unknown_tool_call_parser_is_a_usage_error_and_refused_by_the_options(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--tool-call-parser", "qwen"])
    assert info.value.code == 2 and "qwen" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerOptions(tool_call_parser="qwen")
