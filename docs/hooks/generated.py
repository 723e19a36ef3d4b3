"""MkDocs hook: pages made from the code, so they cannot drift from it.

``<!-- cli: psctl -->`` (or ``psserver``, ``psworker``) becomes the reference of that command,
generated from its argparse parser (every subcommand, flag, ``PS_*`` variable and default);
``<!-- include: deploy/README.md -->`` becomes that file of the repository, so one text serves
both the repository and the site; ``<!-- settings: psworker -->`` becomes the table of
``psworker.ClientSettings``'s fields (meaning, ``PS_*`` variable, default), from the dataclass.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
_MARKER = re.compile(r"<!-- (cli|include|settings): ([\w./-]+) -->")


def _parsers() -> dict[str, Callable[[], argparse.ArgumentParser]]:
    from psctl.main import build_add_parser
    from psctl.main import build_parser as psctl_parser
    from psserver.config import build_parser as psserver_parser
    from psworker.main import build_parser as psworker_parser

    return {
        "psctl": psctl_parser,
        "psctl local add": build_add_parser,
        "psserver": psserver_parser,
        "psworker": psworker_parser,
    }


def cli_markdown(name: str) -> str:
    """The reference of command ``name``: its usage, description and flags, then each
    subcommand's, as Markdown.

    Raises:
        KeyError: no command of that name.
    """
    return "\n".join(_parser_markdown(name, _parsers()[name](), level=2))


def _parser_markdown(name: str, parser: argparse.ArgumentParser, level: int) -> list[str]:
    parser.prog = name
    out = [f"{'#' * level} `{name}`", ""]
    out += ["```text", parser.format_usage().strip(), "```", ""]
    if parser.description:
        out += [_escape(parser.description), ""]
    rows = [a for a in parser._actions if not isinstance(a, argparse._SubParsersAction)]
    rows = [a for a in rows if a.help != argparse.SUPPRESS]
    if rows:
        out += ["| argument | variable | default | meaning |", "| --- | --- | --- | --- |"]
        out += [_row(a) for a in rows]
        out.append("")
    if parser.epilog:
        out += [_escape(parser.epilog), ""]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                out += _parser_markdown(f"{name} {sub_name}", sub, level + 1)
    return out


# pswire.cli.add appends "[env PS_X; default D]" to a flag's help: shown as columns here.
_ENV_NOTE = re.compile(r"\s*\[env (PS_\w+); default (.*?)(?:; now .*)?\]$")


def _row(action: argparse.Action) -> str:
    names = ", ".join(f"`{o}`" for o in action.option_strings)
    names = names or f"`{action.metavar or action.dest}`"
    text = " ".join((action.help or "").split())
    env, default = "", ""
    note = _ENV_NOTE.search(text)
    if note:
        text = text[: note.start()]
        env, default = f"`${note.group(1)}`", note.group(2)
    elif action.default not in (None, argparse.SUPPRESS) and not isinstance(action.default, bool):
        default = repr(action.default)
    default = "" if default in ("", "None", "''", "False", "[]") else f"`{default}`"
    if action.choices and not isinstance(action.choices, dict):
        text += " (one of " + ", ".join(f"`{c}`" for c in action.choices) + ")"
    return f"| {names} | {env} | {default} | {_escape(text)} |"


# What the environment of the build says (``now 'x' from PS_X``) is no part of the reference.
_NOW = re.compile(r"; now .*? from PS_\w+")


def _escape(text: str) -> str:
    text = _NOW.sub("", " ".join(text.split()))
    for plain, escaped in (("|", "\\|"), ("<", "&lt;"), (">", "&gt;"), ("[", "\\["), ("]", "\\]")):
        text = text.replace(plain, escaped)
    return text


def settings_markdown() -> str:
    """The table of ``psworker.ClientSettings``'s fields, as Markdown."""
    from psworker.settings import fields_table

    out = ["| field | variable (or where `connect()` finds it) | default | meaning |"]
    out.append("| --- | --- | --- | --- |")
    for name, where, default, doc in fields_table():
        cells = [f"`{name}`", where, default, doc]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out)


def on_page_markdown(markdown: str, **_: Any) -> str:
    """Replaces the markers (see the module's docstring) in a page's Markdown."""

    def expand(match: re.Match[str]) -> str:
        kind, arg = match.groups()
        if kind == "cli":
            return cli_markdown(arg.replace("-", " "))
        if kind == "settings":
            return settings_markdown()
        return (REPO / arg).read_text()

    return _MARKER.sub(expand, markdown)
