"""The one list of PS_* variables: every name the project reads is in it, and an unknown one is
named with its closest known name."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from pswire import envnames

REPO = Path(__file__).resolve().parents[2]
# Where PS_* names are read or set: the packages, the set-up and deploy scripts, the tests.
SOURCES = ("psworker", "psserver", "psctl", "pswire", "scripts", "deploy", "tests", "bench")
NAME = re.compile(r"\bPS_[A-Z0-9_]*[A-Z0-9]\b")
# Names used only as examples of a misspelling (the tests of this module).
MISSPELT = {"PS_SHRADS", "PS_WORKER_IDD", "PS_NO_SUCH_THING_AT_ALL"}


def test_every_ps_name_in_the_sources_is_in_the_one_list() -> None:
    found: dict[str, str] = {}
    for top in SOURCES:
        for path in (REPO / top).rglob("*"):
            if not path.is_file() or path.suffix not in {
                ".py",
                ".sh",
                ".yml",
                ".yaml",
                ".sbatch",
                "",
            }:
                continue
            if "proto" in path.parts or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                continue
            for name in NAME.findall(text):
                found.setdefault(name, path.relative_to(REPO).as_posix())
    missing = {n: where for n, where in found.items() if n not in envnames.KNOWN | MISSPELT}
    assert not missing, f"add these to pswire/envnames.py: {missing}"


def test_a_misspelt_name_is_reported_with_the_closest_known_one() -> None:
    env = {
        "PS_SHRADS": "127.0.0.1:1",
        "PS_SHARDS": "x",
        "PATH": "/bin",
        "PS_NO_SUCH_THING_AT_ALL": "1",
    }
    assert envnames.unknown(env) == [("PS_NO_SUCH_THING_AT_ALL", None), ("PS_SHRADS", "PS_SHARDS")]


def test_the_warning_names_the_closest_name_once_per_process(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(envnames, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="pswire.envnames"):
        first = envnames.warn_unknown({"PS_WORKER_IDD": "1"}, who="psserver")
        again = envnames.warn_unknown({"PS_WORKER_IDD": "1"}, who="psserver")
    assert first == [
        "psserver: $PS_WORKER_IDD is not a variable psgrpc reads (ignored); "
        "did you mean $PS_WORKER_ID?"
    ]
    assert again == []
    assert "did you mean $PS_WORKER_ID?" in caplog.text
