"""Memory a long job gives back: a shard after rejected large pushes, and a worker whose shard
checkpoints only when asked (issue 14, items 13 and 14). RSS from /proc/PID/status."""

from __future__ import annotations

import re
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest
from e2e_support import Lines, Processes, child_env, numpy_worker, rss_bytes

import psworker
from pscore.optim import SGD
from pswire.proto import ps_pb2
from pswire.stubs import ParameterServerStub
from pswire.write import push_stream

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc RSS")

MiB = 1 << 20
BIG = 256 * MiB // 4  # float32s in the large variable: 256 MiB
REJECTED_PUSHES = 6
RETURN_WITHIN_S = 15.0  # the bound
SLACK = 300 * MiB  # the bound: back within this of the baseline


class Sampler:
    """Samples a process's RSS every ``every`` seconds in a thread; keeps the peak."""

    def __init__(self, pid: int, every: float = 0.05) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak


@pytest.mark.timeout(240)
def test_shard_memory_returns_after_rejected_large_pushes(procs: Processes) -> None:
    daemon = procs.psserver("--max-request-bytes", str(1 << 30))
    log = Lines(daemon.proc)  # drained, so the daemon never blocks on a full pipe
    with psworker.connect(
        [daemon.address], worker_id=0, num_workers=1, mode="async", timeout=120
    ) as client:
        client.init(
            {"big": np.zeros(BIG, np.float32), "small": np.zeros(4, np.float32)}, SGD(lr=0.1)
        )
    baseline = rss_bytes(daemon.proc.pid)
    sampler = Sampler(daemon.proc.pid)
    big = np.ones(BIG, np.float32)
    with grpc.insecure_channel(daemon.address) as channel:
        stub = ParameterServerStub(channel)
        for i in range(REJECTED_PUSHES):
            if i % 2:  # NaN in the large tensor
                big[-1] = np.nan
                pieces = {"big": big, "small": np.ones(4, np.float32)}
            else:  # every byte of the large tensor, then a wrong shape on the last one
                big[-1] = 1.0
                pieces = {"big": big, "small": np.ones(5, np.float32)}
            with pytest.raises(grpc.RpcError) as refused:
                stub.Push(push_stream(0, 0, pieces, 4 * MiB), timeout=120)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
        status = stub.Status(ps_pb2.StatusRequest(), timeout=10)
    del big, pieces
    peak = sampler.stop()
    assert status.pushes_applied == 0, status
    # The pushes did reach the shard in full (else this test would show nothing).
    assert peak - baseline > 200 * MiB, (baseline // MiB, peak // MiB)
    deadline = time.monotonic() + RETURN_WITHIN_S
    samples = []
    while True:
        rss = rss_bytes(daemon.proc.pid)
        samples.append(rss // MiB)
        if rss <= baseline + SLACK:
            break
        assert time.monotonic() < deadline, (
            f"shard RSS {rss // MiB} MiB, baseline {baseline // MiB} MiB, peak {peak // MiB} MiB "
            f"after {REJECTED_PUSHES} rejected pushes of {BIG * 4 // MiB} MiB; samples (MiB) "
            f"over {RETURN_WITHIN_S}s: {samples[::10]}\nshard log:\n{log.text()}"
        )
        time.sleep(0.1)
    print(f"baseline {baseline // MiB} MiB, peak {peak // MiB} MiB, back to {rss // MiB} MiB")


WORKER_STEPS = 1000
MODEL_FLOATS = 1 << 20  # 4 MiB of float32s
GROWTH_LIMIT = 200 * MiB  # the bound over 1,000 steps


@pytest.mark.timeout(600)
def test_worker_memory_stays_flat_with_a_checkpoint_dir_and_no_periodic_checkpoints(
    procs: Processes, tmp_path: Path
) -> None:
    # A checkpoint folder, no interval: the shard saves only when a worker asks.
    daemon = procs.psserver("--checkpoint-dir", str(tmp_path / "ckpt"))
    log = Lines(daemon.proc)
    worker = numpy_worker(
        procs,
        [daemon.address],
        0,
        1,
        *("--mode", "async", "--steps", str(WORKER_STEPS), "--floats", str(MODEL_FLOATS)),
        *("--pieces", "4", "--report-every", "10", "--timeout", "120"),
    )
    worker.wait_for(lambda: worker.latest("ready") is not None, 60, "init")
    pid = worker.proc.pid
    baseline = rss_bytes(pid)
    samples: list[tuple[int, int]] = []  # (step, MiB)
    while worker.proc.poll() is None:
        try:
            rss = rss_bytes(pid)
        except (FileNotFoundError, AssertionError):
            break  # it just ended
        samples.append((worker.latest("step") or 0, rss // MiB))
        assert rss - baseline < GROWTH_LIMIT, (
            f"worker RSS grew {(rss - baseline) // MiB} MiB (from {baseline // MiB} MiB) by step "
            f"{samples[-1][0]}; samples (step, MiB): {samples[::20]}\nworker:\n{worker.text()}"
        )
        time.sleep(0.2)
    assert worker.proc.wait(timeout=60) == 0, worker.text() + "\nshard:\n" + log.text()
    assert worker.latest("done") == WORKER_STEPS, worker.text()
    top = max(mib for _, mib in samples)
    print(f"worker baseline {baseline // MiB} MiB, peak {top} MiB; (step, MiB): {samples[::25]}")
    # The samples cover the run, not just its start.
    assert samples and samples[-1][0] >= WORKER_STEPS * 0.8, samples[-5:]


@pytest.mark.timeout(240)
def test_workers_asking_for_a_checkpoint_together_get_one_save(
    procs: Processes, tmp_path: Path
) -> None:
    workers = 4
    daemon = procs.psserver("--checkpoint-dir", str(tmp_path / "ckpt"))
    log = Lines(daemon.proc)
    env = child_env(PS_REPLAY_BYTES=str(4 * MiB))  # a 1 MiB model: full every 4 steps
    running = [
        numpy_worker(
            procs,
            [daemon.address],
            i,
            workers,
            *("--steps", "40", "--floats", str(MiB // 4), "--timeout", "60"),
            env=env,
        )
        for i in range(workers)
    ]
    for i, worker in enumerate(running):
        assert worker.proc.wait(timeout=180) == 0, f"worker {i}:\n{worker.text()}"
    saved = re.findall(r"checkpoint at shard clock (\d+) written", log.text(last=1 << 20))
    assert saved, log.text()
    repeated = {clock: n for clock, n in Counter(saved).items() if n > 1}
    assert not repeated, f"checkpoints written more than once at the same clock: {repeated}"
