"""The site's command-line reference is generated from the parsers (docs/hooks/generated.py):
every subcommand and every flag, with its PS_* variable, and the markers that pages use."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from psctl.main import build_parser as psctl_parser
from psserver.config import build_parser as psserver_parser

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("generated", REPO / "docs/hooks/generated.py")
assert spec is not None and spec.loader is not None
generated = importlib.util.module_from_spec(spec)
spec.loader.exec_module(generated)


def flags(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def test_every_psctl_subcommand_and_psserver_flag_is_in_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PS_MAX_WORKERS", "7")  # the build's environment is not the reference
    psctl = generated.cli_markdown("psctl")
    commands = next(a for a in psctl_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in commands.choices:
        assert f"### `psctl {name}`" in psctl, name
    psserver = generated.cli_markdown("psserver")
    for flag in flags(psserver_parser()):
        assert f"`{flag}`" in psserver, flag
    row = next(line for line in psserver.splitlines() if line.startswith("| `--max-workers`"))
    assert "`$PS_MAX_WORKERS`" in row and "now" not in row and "7" not in row
    assert "| `--metrics-port` | `$PS_METRICS_PORT` |" in psserver


def test_markers_expand_to_the_reference_and_included_files() -> None:
    page = "x\n<!-- cli: psctl-local-add -->\n<!-- include: deploy/README.md -->\n"
    out = generated.on_page_markdown(page)
    assert "## `psctl local add`" in out and "`--count`" in out
    assert (REPO / "deploy" / "README.md").read_text() in out
