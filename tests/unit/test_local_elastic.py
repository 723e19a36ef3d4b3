"""psctl local --elastic and psctl local add, without processes: the configuration's checks,
the add flags' PS_* twins, and the request/answer files between `add` and the launcher."""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

import pytest

from psctl import local_add
from psctl import main as psctl_main
from psctl.launch import LocalConfig
from psctl.run_folder import RUN_FILE, RunFolder


def test_elastic_local_configs_are_checked():
    assert LocalConfig(("x",), workers=2, elastic="2:4").elastic == "2:4"
    for kwargs, message in (
        ({"elastic": "4:2"}, "needs 1 <= MIN <= MAX"),
        ({"elastic": "2:3", "workers": 4}, "--workers 4 is over --elastic's MAX 3"),
        ({"elastic": "1:2", "mode": "allreduce"}, "needs a parameter-server mode"),
    ):
        with pytest.raises(ValueError, match=message):
            LocalConfig(("x",), **kwargs)


def test_every_flag_of_local_add_has_a_ps_twin():
    parser = psctl_main.build_add_parser()
    flags = [
        a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]
    assert flags and all("[env PS_" in (a.help or "") for a in flags)
    local = psctl_main.build_parser().parse_args(["local", "--elastic", "2:4", "--", "true"])
    assert local.elastic == "2:4"


def test_add_asks_the_launcher_and_returns_what_it_started(tmp_path: Path):
    run = RunFolder(tmp_path)  # this process plays the launcher: it holds the run's lock
    run.publish(shards=["127.0.0.1:1"], elastic="1:3")
    requests = local_add.AddRequests(run.path)
    assert local_add.find_run(str(run.path)) == run.path
    tmp_path = run.path
    asked: list[int] = []

    def start(count: int) -> list[tuple[str, int]]:
        asked.append(count)
        if count > 1:
            raise ValueError("cannot add 2 worker(s): 2 of at most 3 are running")
        return [("worker2", 4242)]

    stop = threading.Event()

    def launcher() -> None:
        while not stop.is_set():
            requests.poll(start)
            stop.wait(0.02)

    thread = threading.Thread(target=launcher, daemon=True)
    thread.start()
    try:
        assert local_add.request_add(tmp_path, 1, timeout=10) == [("worker2", 4242)]
        with pytest.raises(ValueError, match="2 of at most 3 are running"):
            local_add.request_add(tmp_path, 2, timeout=10)
    finally:
        stop.set()
        thread.join(5)
    assert asked == [1, 2]
    assert not list(tmp_path.glob("add-*"))  # requests and answers are cleaned up


def test_add_without_a_launcher_says_so(tmp_path: Path):
    with pytest.raises(ValueError, match="no running psctl local job there"):
        local_add.find_run(str(tmp_path))
    (tmp_path / RUN_FILE).write_text('{"pid": 1}')
    with pytest.raises(TimeoutError, match=r"did not answer within 0\.2s"):
        local_add.request_add(tmp_path, 1, timeout=0.2)
    assert not list(tmp_path.glob("add-*.json"))
