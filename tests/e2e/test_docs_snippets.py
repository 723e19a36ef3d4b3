"""Every code block in docs/ runs, or says why it does not.

A block is runnable when it is ``python`` or ``bash``; it runs as written, alone, in a fresh
folder (``python`` blocks with this interpreter, ``bash`` blocks with ``set -euo pipefail``
and this environment's ``psctl``/``psserver`` on PATH). A block that cannot run here (it needs
GPUs, a Kubernetes cluster, an hour, or is not a command at all) carries a marker on the line
before it, ``<!-- not-run: REASON -->``, and every other block must run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2e_support import REPO, child_env

DOCS = REPO / "docs"
RUNNABLE = {"python": [sys.executable], "bash": ["bash", "-euo", "pipefail"]}
SUFFIX = {"python": ".py", "bash": ".sh"}
MARK = re.compile(r"^<!-- not-run: (.*?) -->$")
INCLUDE = re.compile(r"<!-- include: ([\w./-]+) -->")  # docs/hooks/generated.py expands it
FENCE = re.compile(r"^(`{3,})([\w+-]*)\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    not_run: str | None  # the marker's reason

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def pages() -> list[Path]:
    """The site's pages, and the repository files they include."""
    found = sorted(p for p in DOCS.rglob("*.md") if "hooks" not in p.relative_to(DOCS).parts)
    included = {REPO / m for p in found for m in INCLUDE.findall(p.read_text())}
    return found + sorted(included)


def blocks_of(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, each with the marker before it, if any.

    Raises:
        AssertionError: an unclosed fence, or a marker not followed by a block.
    """
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        mark = MARK.match(lines[i].strip())
        if mark:
            assert i + 1 < len(lines) and FENCE.match(lines[i + 1].strip()), (
                f"{path}:{i + 1}: a not-run marker must sit on the line before a code block"
            )
        fence = FENCE.match(lines[i].strip())
        if not fence:
            i += 1
            continue
        ticks, lang = fence.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks), None)
        assert end is not None, f"{path}:{i + 1}: unclosed code block"
        before = MARK.match(lines[i - 1].strip()) if i else None
        code = "\n".join(lines[i + 1 : end]) + "\n"
        found.append(Block(path, i + 1, lang, code, before.group(1) if before else None))
        i = end + 1
    return found


BLOCKS = [b for p in pages() for b in blocks_of(p)]
RUN = [b for b in BLOCKS if b.not_run is None and b.lang in RUNNABLE]


def test_every_block_runs_or_is_marked_with_a_reason() -> None:
    unmarked = [b.name for b in BLOCKS if b.not_run is None and b.lang not in RUNNABLE]
    assert not unmarked, f"blocks neither runnable (python, bash) nor marked not-run: {unmarked}"
    empty = [b.name for b in BLOCKS if b.not_run is not None and len(b.not_run.strip()) < 10]
    assert not empty, f"not-run markers without a reason: {empty}"
    assert len(RUN) >= 10  # the docs' examples really are tested


def test_blocks_of_reads_markers_and_fences(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n<!-- not-run: needs a GPU -->\n```python\nx = 1\n```\n\n```bash\necho hi\n```\n"
    )
    first, second = blocks_of(page)
    assert (first.lang, first.code, first.not_run, first.line) == (
        "python",
        "x = 1\n",
        "needs a GPU",
        3,
    )
    assert (second.lang, second.not_run) == ("bash", None)
    page.write_text("<!-- not-run: a reason -->\ntext\n")
    with pytest.raises(AssertionError, match="must sit on the line before a code block"):
        blocks_of(page)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("block", RUN, ids=[b.name for b in RUN])
def test_docs_block_runs(block: Block, tmp_path: Path) -> None:
    script = tmp_path / f"snippet{SUFFIX[block.lang]}"
    script.write_text(block.code)
    env = child_env()
    # This interpreter's psctl, psserver, python first on PATH, as an activated venv would be.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["MPLBACKEND"] = "Agg"
    done = subprocess.run(
        [*RUNNABLE[block.lang], str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, (
        f"{block.name} ({block.lang}) exited {done.returncode}:\n{done.stdout[-3000:]}\n"
        f"{done.stderr[-3000:]}"
    )
