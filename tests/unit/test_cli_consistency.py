"""The commands keep the README's promises: every flag has a PS_* twin, shared flags share
defaults, and the help of commands that call shards names the security variables."""

from __future__ import annotations

import argparse

import pytest

from psctl import main as psctl_main
from psworker import main as psworker_main

SECURITY_VARIABLES = ("PS_TLS_CA", "PS_TLS_CERT", "PS_TLS_KEY", "PS_TOKEN", "PS_TOKEN_FILE")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def flags_without_twin(parser: argparse.ArgumentParser) -> list[str]:
    return [
        action.option_strings[0]
        for action in parser._actions
        if action.option_strings
        and not isinstance(action, argparse._HelpAction)
        and "[env PS_" not in (action.help or "")
    ]


COMMANDS = {
    **{f"psctl {n}": p for n, p in subcommands(psctl_main.build_parser()).items()},
    **{f"psworker {n}": p for n, p in subcommands(psworker_main.build_parser()).items()},
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_has_a_ps_twin(command: str) -> None:
    assert flags_without_twin(COMMANDS[command]) == []


@pytest.mark.parametrize("command", ["psctl status", "psctl checkpoint", "psctl export"])
def test_help_of_commands_calling_shards_lists_the_security_variables(command: str) -> None:
    text = COMMANDS[command].format_help()
    for name in SECURITY_VARIABLES:
        assert f"${name}" in text, name


def test_local_and_demo_share_the_staleness_default() -> None:
    local = COMMANDS["psctl local"].parse_args(["--", "true"])
    demo = COMMANDS["psctl demo"].parse_args([])
    assert local.staleness == demo.staleness == 1


def test_env_twins_reach_the_local_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PS_SERVERS", "3")
    monkeypatch.setenv("PS_WORKERS", "4")
    monkeypatch.setenv("PS_RUN_TIMEOUT", "9")
    parser = psctl_main.build_parser()
    args = parser.parse_args(["local", "--", "true"])
    config = psctl_main._local_config(parser, args, ["true"])
    assert (config.servers, config.workers, config.timeout_s) == (3, 4, 9.0)


@pytest.mark.parametrize("command", ["local", "demo"])
def test_mode_local_with_two_workers_is_refused_by_local_and_demo(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    tail = ["--", "true"] if command == "local" else []
    with pytest.raises(SystemExit) as info:
        psctl_main.main([command, "--mode", "local", "--workers", "2", *tail])
    assert info.value.code == 2
    assert "--mode local runs one worker process, got --workers 2" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["local", "demo"])
def test_mode_local_defaults_to_one_worker(command: str) -> None:
    parser = psctl_main.build_parser()
    args = parser.parse_args([command, "--mode", "local"])
    assert psctl_main._local_config(parser, args, ["true"]).workers == 1


def test_psworker_run_takes_every_client_mode() -> None:
    parser = psworker_main.build_parser()
    for mode in ("sync", "async", "ssp", "allreduce", "local"):
        assert parser.parse_args(["run", "--mode", mode, "x.py"]).mode == mode
