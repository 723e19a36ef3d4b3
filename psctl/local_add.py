"""Adding workers to a running ``psctl local --elastic`` job: the add requests its launcher
answers (``add-*.json`` in its run folder, ``psctl.run_folder``), and ``psctl local add`` that
asks.

The launcher starts each added worker itself, so it is supervised, prefixed and stopped like the
first ones. Requests are files renamed into place (never read half-written); each is answered
with ``<request>.done`` naming the worker started, or why none was.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from psctl.run_folder import Run, live_runs, read_run, write_json

DEFAULT_ADD_TIMEOUT_S = 30.0
_POLL_S = 0.05


class AddRequests:
    """The launcher's side: answers the add requests left in its run folder with
    ``start(count)``, which starts that many workers and returns their names and pids."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def poll(self, start: Callable[[int], list[tuple[str, int]]]) -> None:
        """Answers every request waiting; ``start`` raising ValueError refuses one."""
        for request in sorted(self.folder.glob("add-*.json")):
            try:
                count = int(json.loads(request.read_text()).get("count", 1))
                answer: dict = {"started": start(count)}
            except (ValueError, OSError) as exc:
                answer = {"error": str(exc)}
            request.unlink(missing_ok=True)
            write_json(request.with_suffix(".done"), answer)


def find_run(given: str | None, parent: Path | None = None) -> Path:
    """The run folder of the ``psctl local --elastic`` job to add to: ``given``, else the one
    live elastic job of this user under ``parent`` (default ``$TMPDIR``). Never a guess: with
    none or several, it refuses and lists what it found.

    Raises:
        ValueError: ``given`` is not a live elastic job; none or several are running.
    """
    if given:
        run = read_run(Path(given))
        if run is None:
            raise ValueError(f"--run {given}: no running psctl local job there")
        if not run.info.get("elastic"):
            raise ValueError(f"--run {given}: {run.describe()} is not elastic (--elastic)")
        return run.folder
    runs = live_runs(parent)
    elastic = [r for r in runs if r.info.get("elastic")]
    if len(elastic) == 1:
        return elastic[0].folder
    if not elastic:
        others = _listing(runs)
        raise ValueError(
            "no psctl local --elastic job is running on this machine (for this user)"
            + (f"; running, but not elastic: {others}" if others else "")
        )
    raise ValueError(
        f"{len(elastic)} psctl local --elastic jobs are running; name one with --run:"
        f"{_listing(elastic)}"
    )


def _listing(runs: list[Run]) -> str:
    return "".join(f"\n  --run {r.folder}  # {r.describe()}" for r in runs)


def request_add(folder: Path, count: int, timeout: float) -> list[tuple[str, int]]:
    """Asks the launcher of ``folder`` for ``count`` more workers; returns (name, pid) of each.

    Raises:
        ValueError: the launcher refused (the job is full, it is stopping).
        TimeoutError: no answer within ``timeout`` seconds.
    """
    request = folder / f"add-{uuid.uuid4().hex[:12]}.json"
    write_json(request, {"count": count})
    done = request.with_suffix(".done")
    deadline = time.monotonic() + timeout
    while not done.exists():
        if time.monotonic() >= deadline:
            request.unlink(missing_ok=True)
            raise TimeoutError(f"the launcher ({folder}) did not answer within {timeout:g}s")
        time.sleep(_POLL_S)
    answer = json.loads(done.read_text())
    done.unlink(missing_ok=True)
    if "error" in answer:
        raise ValueError(answer["error"])
    return [(str(name), int(pid)) for name, pid in answer["started"]]
