"""Adding workers to a running ``psctl local --elastic`` job: the run folder the launcher shares
(``run.json``, and ``add-*.json`` requests it answers), and ``psctl local add`` that asks.

The launcher starts each added worker itself, so it is supervised, prefixed and stopped like the
first ones. Requests are files renamed into place (never read half-written); each is answered
with ``<request>.done`` naming the worker started, or why none was.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

RUN_FILE = "run.json"
DEFAULT_ADD_TIMEOUT_S = 30.0
_POLL_S = 0.05


def _write(path: Path, data: dict) -> None:
    """Writes JSON to ``path`` atomically (a reader sees all of it or nothing)."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(data))
    os.replace(part, path)


class AddRequests:
    """The launcher's side: announces the run in ``folder`` and answers add requests with
    ``start(count)``, which starts that many workers and returns their names and pids."""

    def __init__(self, folder: Path, info: dict) -> None:
        self.folder = folder
        _write(folder / RUN_FILE, {**info, "pid": os.getpid()})

    def poll(self, start: Callable[[int], list[tuple[str, int]]]) -> None:
        """Answers every request waiting; ``start`` raising ValueError refuses one."""
        for request in sorted(self.folder.glob("add-*.json")):
            try:
                count = int(json.loads(request.read_text()).get("count", 1))
                answer: dict = {"started": start(count)}
            except (ValueError, OSError) as exc:
                answer = {"error": str(exc)}
            request.unlink(missing_ok=True)
            _write(request.with_suffix(".done"), answer)


def find_run(given: str | None) -> Path:
    """The run folder of the ``psctl local --elastic`` to add to: ``given``, else the one
    running on this machine for this user.

    Raises:
        ValueError: none running, several (name one with --run), or ``given`` is not one.
    """
    if given:
        folder = Path(given)
        if not (folder / RUN_FILE).is_file():
            raise ValueError(f"--run {given}: no running psctl local --elastic there ({RUN_FILE})")
        return folder
    found = []
    for run in Path(tempfile.gettempdir()).glob(f"psctl-*/{RUN_FILE}"):
        try:
            pid = int(json.loads(run.read_text())["pid"])
            if run.stat().st_uid == os.getuid() and _alive(pid):
                found.append(run.parent)
        except (OSError, ValueError, KeyError):
            continue
    if not found:
        raise ValueError("no psctl local --elastic is running on this machine (for this user)")
    if len(found) > 1:
        raise ValueError(
            f"several psctl local --elastic runs: {sorted(map(str, found))}; name one with --run"
        )
    return found[0]


def request_add(folder: Path, count: int, timeout: float) -> list[tuple[str, int]]:
    """Asks the launcher of ``folder`` for ``count`` more workers; returns (name, pid) of each.

    Raises:
        ValueError: the launcher refused (the job is full, it is stopping).
        TimeoutError: no answer within ``timeout`` seconds.
    """
    request = folder / f"add-{uuid.uuid4().hex[:12]}.json"
    _write(request, {"count": count})
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
