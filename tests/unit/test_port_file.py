"""A daemon's port file (psserver, psctl dashboard) is written whole or not at all: a reader
polling for it never finds it empty, and no temporary file is left beside it."""

from __future__ import annotations

from pathlib import Path

from pswire.cli import write_port_file


def test_the_port_file_holds_the_whole_number_and_nothing_is_left_beside_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "daemon.port"
    write_port_file(path, 43125)
    assert path.read_text() == "43125\n"
    write_port_file(path, 7)  # a restart on another port replaces it whole
    assert int(path.read_text()) == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["daemon.port"]
