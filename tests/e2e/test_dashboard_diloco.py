"""``psctl dashboard`` on a DiLoCo job: 2 shard daemons and 2 torch workers taking local steps,
the dashboard's JSON (and its page, where Chromium is installed) read while the job runs and
after it ends. It says its steps are outer steps, and each worker's bytes per outer step and
totals are what the worker's reports and the worker itself count."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from dashboard_pages import browse, metered_shards, series, start_dashboard, wait_for
from e2e_support import REPO, Lines, Processes, child_env

WORKER = str(REPO / "tests" / "e2e" / "diloco_reporting_worker.py")
H, STEPS, PACE = 4, 48, 0.1  # 12 outer steps in about 5 s
OUTER = STEPS // H
# The worker's model, Linear(8, 16) and Linear(16, 1), in float32: every outer step sends its
# pseudo-gradient and receives its weights, this many bytes each way.
MODEL_BYTES = (8 * 16 + 16 + 16 * 1 + 1) * 4


def report_lines(folder: Path, worker: int) -> list[dict[str, Any]]:
    path = folder / f"worker{worker}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(180)
def test_the_dashboard_of_a_diloco_job_counts_outer_steps_and_each_workers_bytes(
    procs: Processes, tmp_path: Path
) -> None:
    shards, metrics = metered_shards(procs)
    addresses = ",".join(shards)
    reports = tmp_path / "reports"
    env = child_env(PS_REPORT_DIR=str(reports))
    workers = [
        Lines(procs.start([sys.executable, WORKER, addresses, str(w), "2", str(H), str(STEPS),
                           str(PACE)], env))
        for w in (0, 1)
    ]  # fmt: skip
    url = start_dashboard(procs, shards, metrics, reports, tmp_path)

    # While the job runs: both workers live, with a step report and a loss each.
    def running() -> dict[str, Any] | None:
        data = series(url)
        rows = {r["worker"]: r for r in data["workers"]}
        loss = next(c for c in data["charts"] if c["id"] == "loss")["series"]
        live = len(rows) == 2 and all(r["live"] and r["bytes_sent"] for r in rows.values())
        reported = all(any(v is not None for v in loss.get(f"worker {w}", [])) for w in (0, 1))
        return data if live and reported else None

    data = wait_for(running, 60.0, f"both workers' reports at {url}api/series")
    assert data["step_unit"] == "outer steps"
    assert data["diloco"] == {
        "local_steps": H,
        "outer_sync": True,
        "dynamic_local_steps": False,
        "fragments": 1,
        "between": f"H={H} inner steps",
    }
    units = {c["id"]: c["unit"] for c in data["charts"]}
    assert (units["steps"], units["staleness"]) == ("outer steps/s", "outer steps")
    for row in data["workers"]:
        # The bytes of one outer step, as the worker's own report lines say.
        lines = [line for line in report_lines(reports, row["worker"]) if "bytes_sent" in line]
        assert {line["bytes_sent"] for line in lines} == {row["bytes_sent"]} == {MODEL_BYTES}
        assert {line["bytes_received"] for line in lines} == {row["bytes_received"]}
        assert row["bytes_received"] == MODEL_BYTES

    # After it: each worker's totals and steps as the worker counted them.
    done = {}
    for w, lines in enumerate(workers):
        assert lines.proc.wait(timeout=60) == 0, lines.text()
        done[w] = json.loads(lines.text().splitlines()[-1])
        assert (done[w]["step"], done[w]["outer_step"]) == (STEPS, OUTER), done[w]

    def finished() -> dict[str, Any] | None:
        data = series(url)
        rows = {r["worker"]: r for r in data["workers"]}
        over = all(
            rows[w]["live"] is False and rows[w]["bytes_sent_total"] == done[w]["bytes_sent"]
            for w in (0, 1)
        )
        return data if over else None

    try:
        data = wait_for(finished, 30.0, "the workers' final reports on the dashboard")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {series(url)['workers']}; they counted {done}") from None
    assert data["steps"] == OUTER  # the header counts outer steps, not the inner STEPS
    for row in data["workers"]:
        w = row["worker"]
        assert (row["clock"], row["step"]) == (OUTER, STEPS)
        assert row["bytes_sent_total"] == done[w]["bytes_sent"] == OUTER * MODEL_BYTES
        assert row["bytes_received_total"] == done[w]["bytes_received"] == OUTER * MODEL_BYTES
        assert any(f"worker {w} left at outer step {OUTER}" in e["text"] for e in data["events"])
    assert not data["errors"], data["errors"]

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is not None:  # the page says so too (tests/e2e/test_dashboard.py draws charts)
        dom = browse(browser, tmp_path / "profile", url, "--dump-dom")
        assert re.search(rf'id="step-unit">outer steps</span>: <b id="steps">{OUTER}<', dom)
        assert "<th>inner steps</th>" in dom and "<th>sent per outer step</th>" in dom
        assert "DiLoCo, synchronous outer steps, each after H=4 inner steps" in dom
