"""How a dim-0 slice of a split variable is named on its shard: ``name/part{i}of{k}``.

Shards store pieces by key, pulls merge every shard's pieces by key and exports rebuild
variables by parsing keys, so a key must name one piece only: a variable (or table) whose own
name has this form is refused before anything is sent, whether or not some variable is split.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# A slice's key; group "var" is the variable's name, "i" the slice, "k" the slice count.
PIECE_KEY = re.compile(r"(?P<var>.+)/part(?P<i>\d+)of(?P<k>\d+)")


def piece_key(var: str, index: int, count: int) -> str:
    """The key of slice ``index`` of ``count`` of variable ``var``."""
    return f"{var}/part{index}of{count}"


def parse_piece_key(key: str) -> tuple[str, int, int] | None:
    """(variable, slice, slice count) of a slice's key; None for any other name."""
    match = PIECE_KEY.fullmatch(key)
    if match is None:
        return None
    return match["var"], int(match["i"]), int(match["k"])


def check_names(names: Iterable[str], what: str = "variable") -> None:
    """Refuses names that read as a slice's key.

    Raises:
        ValueError: naming every such name.
    """
    bad = sorted(n for n in names if PIECE_KEY.fullmatch(n))
    if bad:
        raise ValueError(
            f"{what} names {bad} have the form 'name/part<i>of<k>' that the shards give the "
            "slices of a split variable: rename them (a slice of another variable could "
            "carry the same key)"
        )
