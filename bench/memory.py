"""Peak memory of a shard daemon against the state it holds, and of a worker during a push."""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from bench import peers, torchps
from bench.report import Ratio, Table, check, print_table
from bench.throughput import FULL_SHAPES, QUICK_SHAPES, nbytes_of

PUSHES = 3
MIB = 1 << 20


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS and VmHWM (peak resident set) of a process, in bytes, from /proc/PID/status."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak(pid: int | str = "self") -> bool:
    """Resets VmHWM to the current RSS (Linux 4.0+: '5' to clear_refs); False if not allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


@contextlib.contextmanager
def daemon(workdir: Path) -> Iterator[tuple[str, int]]:
    """One ``python -m psserver`` on loopback; yields its address and PID."""
    port_file = workdir / "port"
    command = [sys.executable, "-m", "psserver", "--host", "127.0.0.1", "--port", "0"]
    with open(workdir / "log", "wb") as log:
        proc = subprocess.Popen(
            [*command, "--port-file", str(port_file)], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + peers.START_TIMEOUT_S
        while True:
            text = port_file.read_text() if port_file.exists() else ""
            address = peers.address_from_port_file(text)
            if address is not None:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"psserver wrote no port (exit {proc.returncode})")
            time.sleep(0.05)
        yield address, proc.pid
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)


def _worker(
    conn: Connection,
    address: str,
    shapes: dict[str, tuple[int, ...]],
    mode: str = "async",
    worker_id: int = 0,
    num_workers: int = 1,
) -> None:
    """Child process: a worker with the model and its gradients; measures its pushes' peak."""
    import psworker

    model = torchps.model_arrays(shapes)
    grads = {k: np.full_like(v, 1e-4) for k, v in model.items()}
    client = psworker.connect(
        [address], worker_id=worker_id, num_workers=num_workers, mode=mode, timeout=120.0
    )
    with client:
        client.init(model, psworker.SGD(lr=1e-3, momentum=0.9))
        client.push(grads)  # warm-up: channels, first allocations
        client.pull()
        before = proc_status()["VmRSS"]
        was_reset = reset_peak()
        for _ in range(PUSHES - 1):
            client.push(grads)
            if mode == "sync":
                client.pull()  # the step's pulls: every worker reads as the step closes
        peak = proc_status()["VmHWM"]
    conn.send({"rss_before_push": before, "hwm": peak, "peak_reset": was_reset})


def _shard_peak(
    shapes: dict[str, tuple[int, ...]], mode: str, workers: int
) -> tuple[dict[str, int], int, dict]:
    """(the shard daemon's VmRSS/VmHWM after the workers' pushes, its idle RSS, worker 0's
    report) for ``workers`` worker processes in ``mode``."""
    with (
        tempfile.TemporaryDirectory(prefix="bench_mem_") as tmp,
        daemon(Path(tmp)) as (address, pid),
    ):
        idle = proc_status(pid)["VmRSS"]
        pipes, procs = [], []
        for i in range(workers):
            parent, child = torchps.SPAWN.Pipe()
            args = (child, address, shapes, mode, i, workers)
            procs.append(torchps.SPAWN.Process(target=_worker, args=args, daemon=True))
            procs[-1].start()
            child.close()
            pipes.append(parent)
        reports = []
        for parent, proc in zip(pipes, procs, strict=True):
            if not parent.poll(300.0):
                for p in procs:
                    p.kill()
                raise RuntimeError(f"memory worker ({mode}) reported nothing in 300 s")
            reports.append(parent.recv())
            proc.join(30.0)
        return proc_status(pid), idle, reports[0]


def measure(quick: bool) -> Table:
    t0 = time.perf_counter()
    shapes = QUICK_SHAPES if quick else FULL_SHAPES
    nbytes = nbytes_of(shapes)
    shard, idle, worker = _shard_peak(shapes, "async", 1)
    state = 2 * nbytes  # the variables and one SGD momentum buffer of the same size
    shard_ratio = shard["VmHWM"] / state
    extra = worker["hwm"] - worker["rss_before_push"]
    # Sync keeps each worker's push until its step closes (summed in worker order, so a step
    # is bit-reproducible): the shard's peak grows with the workers.
    sync_rows, sync_raw = [], {}
    for workers in (1, 2) if quick else (1, 4):
        peak = _shard_peak(shapes, "sync", workers)[0]["VmHWM"]
        sync_rows.append([f"shard: peak RSS, sync, {workers} worker(s)", peak / MIB, peak / state])
        sync_raw[workers] = peak
    rows = [
        ["shard: variables + momentum", state / MIB, None],
        ["shard: idle RSS before init", idle / MIB, None],
        ["shard: peak RSS (VmHWM), async, 1 worker", shard["VmHWM"] / MIB, shard_ratio],
        ["shard: peak minus idle", (shard["VmHWM"] - idle) / MIB, (shard["VmHWM"] - idle) / state],
        *sync_rows,
        ["worker: model bytes", nbytes / MIB, None],
        ["worker: RSS before push (model+grads+pulled)", worker["rss_before_push"] / MIB, None],
        ["worker: peak RSS during pushes", worker["hwm"] / MIB, worker["hwm"] / nbytes],
        ["worker: push peak over RSS before", extra / MIB, extra / nbytes],
    ]
    return Table(
        name="memory",
        title=f"peak memory, {nbytes / 1e6:.0f} MB float32 model, SGD momentum, 1 shard daemon",
        columns=["quantity", "MiB", "x state/model"],
        rows=rows,
        notes=[
            f"shard: VmHWM of `python -m psserver` after init, 1 warm-up push and {PUSHES - 1} "
            "more (sync: each followed by a pull); state = variables + momentum buffers (2 x "
            "model bytes); each row its own daemon and worker processes.",
            "worker: a spawned process; VmHWM reset (clear_refs 5) after a warm-up push+pull, "
            f"then {PUSHES - 1} pushes"
            + ("" if worker["peak_reset"] else " (reset refused: the peak includes init)")
            + "; the ratio column divides by the model bytes.",
        ],
        ratios=[
            Ratio(
                "memory",
                "shard peak RSS / (variables + optimizer state)",
                "shard, async, 1 worker",
                "-",
                shard_ratio,
                meaning="lower is better",
                goal="<= 1.5",
                met=check(shard_ratio, "<= 1.5"),
                target="" if quick else "shard peak RSS / state",  # the issue's: 25M
            ),
            *(
                Ratio(
                    "memory",
                    "shard peak RSS / (variables + optimizer state)",
                    f"shard, sync, {w} worker(s)",
                    "-",
                    peak / state,
                    meaning="lower is better",
                )
                for w, peak in sync_raw.items()
            ),
            Ratio(
                "memory",
                "worker push peak above its RSS / model bytes",
                "worker",
                "-",
                extra / nbytes,
                meaning="lower is better",
            ),
        ],
        raw={
            "shard": shard,
            "shard_idle_rss": idle,
            "shard_sync_hwm": sync_raw,
            "worker": worker,
            "model_bytes": nbytes,
        },
        elapsed_s=time.perf_counter() - t0,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="6.4M params")
    args = parser.parse_args(argv)
    print_table(measure(args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
