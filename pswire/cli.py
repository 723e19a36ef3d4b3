"""Command-line precedence shared by every daemon: argument, then PS_* environment, then default;
and the port file a daemon writes once it serves."""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pswire.errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_default(env: str, default: Any = None, convert: Callable[[str], Any] = str) -> Any:
    """The value of ``$env`` converted by ``convert``, or ``default`` when unset or empty.

    Raises:
        ConfigError: the variable is set but ``convert`` rejects it; the message names it.
    """
    text = os.environ.get(env)
    if not text:
        return default
    try:
        return convert(text)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"${env}={text!r} is not a valid value: {exc}") from exc


def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off``, any case.

    Raises:
        ConfigError: anything else.
    """
    lowered = text.strip().lower()
    if lowered in _TRUE or lowered in _FALSE:
        return lowered in _TRUE
    raise ConfigError(f"expected one of {_TRUE + _FALSE}, got {text!r}")


def add(
    parser: argparse.ArgumentParser,
    *flags: str,
    env: str,
    help: str,
    default: Any = None,
    **kwargs: Any,
) -> argparse.Action:
    """``parser.add_argument`` whose default comes from ``$env`` when that is set.

    The flag wins over the variable, the variable over ``default``; ``--help`` shows both
    twins. A set variable is handed to argparse as a string default, so argparse converts it
    with ``type`` and reports a bad value like a bad flag (torch's ``argparse_util.env``).
    A ``required`` flag stops being required when its variable is set; a ``store_true`` flag
    reads the variable as a boolean.

    Raises:
        ConfigError: a ``store_true`` flag's variable is not a boolean word.
    """
    text = os.environ.get(env)
    note = f"env {env}; default {default!r}"
    if text:
        note += f"; now {text!r} from {env}"
        if kwargs.get("action") == "store_true":
            default = env_default(env, default, parse_bool)
        else:
            default = text
            kwargs["type"] = _naming_env(kwargs.get("type"), kwargs.get("choices"), env, text)
        kwargs["required"] = False
    # argparse %-formats help text; a literal % in a value must not break --help.
    note = note.replace("%", "%%")
    return parser.add_argument(*flags, default=default, help=f"{help} [{note}]", **kwargs)


def _naming_env(
    convert: Callable[[str], Any] | None, choices: Any, env: str, text: str
) -> Callable[[str], Any]:
    """Wraps ``convert`` so a bad value taken from ``$env`` names the variable.

    argparse checks no ``choices`` on defaults, so a value from the variable is checked here.
    """

    def checked(value: str) -> Any:
        # argparse passes the default object itself when the flag is absent: only then did the
        # value come from the environment.
        from_env = value is text
        try:
            result = convert(value) if convert is not None else value
        except (TypeError, ValueError) as exc:
            if from_env:
                raise argparse.ArgumentTypeError(f"${env}={text!r} is not valid: {exc}") from exc
            raise
        if from_env and choices is not None and result not in choices:
            raise argparse.ArgumentTypeError(
                f"${env}={text!r} is not one of {', '.join(map(str, choices))}"
            )
        return result

    checked.__name__ = getattr(convert, "__name__", "value")
    return checked


def write_port_file(path: Path, port: int) -> None:
    """Writes ``port`` to ``path`` so a reader sees either nothing or the whole number."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{port}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def wait_for_stop(stop: threading.Event, poll_s: float = 0.1) -> None:
    """Waits, in a daemon's main thread, until ``stop`` is set (by its SIGINT/SIGTERM handler).

    It polls ``is_set()`` rather than calling ``stop.wait()``: a signal handler runs in the
    main thread between two bytecodes, and one that interrupted ``wait()`` while it held the
    event's lock would wait for that lock forever in ``stop.set()``. (Seen once: a
    ``psserver`` given SIGINT just after it came up never stopped.)
    """
    while not stop.is_set():
        time.sleep(poll_s)
