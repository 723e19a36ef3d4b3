"""Push+pull throughput of our client and shards against raw gRPC and loopback TCP peers."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

import psworker
from bench.peers import (
    IN_PROCESS,
    MIB,
    RAW_OPTIONS,
    RAW_SERVICE,
    RPC_TIMEOUT_S,
    SEPARATE,
    START_TIMEOUT_S,
    raw_grpc_server,
    recv_into,
    serve_tcp,
    shards,
    start_child,
)
from pswire.codec import DEFAULT_CHUNK_BYTES

KIB = 1 << 10
MB = 1e6  # throughput is reported in decimal MB/s, like the DESIGN.md figures
DEFAULT_JSON = "out/bench_pushpull.json"
SWEEP_CHUNKS = (256 * KIB, MIB, 4 * MIB)
ROW_FLOATS = 256


# -- the model -------------------------------------------------------------------------------


def model_shapes(mib: int) -> dict[str, tuple[int, ...]]:
    """Shapes of float32 variables totalling exactly ``mib`` MiB: a 64% embedding plus dense layers.

    Raises:
        ValueError: ``mib`` < 1.
    """
    if mib < 1:
        raise ValueError(f"--mib must be >= 1, got {mib}")
    rows = mib * MIB // (ROW_FLOATS * 4)
    emb, fc1, fc2 = round(rows * 0.64), round(rows * 0.24), round(rows * 0.08)
    # Two bias vectors take one row's worth of bytes each; fc3 takes what is left.
    fc3 = rows - emb - fc1 - fc2 - 2
    return {
        "embedding": (emb, ROW_FLOATS),
        "fc1.weight": (fc1, ROW_FLOATS),
        "fc1.bias": (ROW_FLOATS,),
        "fc2.weight": (fc2, ROW_FLOATS),
        "fc2.bias": (ROW_FLOATS,),
        "fc3.weight": (fc3, ROW_FLOATS),
    }


def make_model(mib: int) -> dict[str, np.ndarray]:
    """Random float32 variables with ``model_shapes(mib)``."""
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal(s, dtype=np.float32) for n, s in model_shapes(mib).items()}


# -- measurements ----------------------------------------------------------------------------


@dataclass
class Measurement:
    """Per-round timings of one configuration; a round is one push plus one pull."""

    config: str
    peer: str  # "ours", "raw-grpc-stream", "raw-grpc-unary" or "raw-tcp"
    layout: str
    shards: int
    chunk_bytes: int | None
    model_bytes: int
    push_s: list[float] = field(default_factory=list)
    pull_s: list[float] = field(default_factory=list)
    ratio: float | None = None  # median MB/s over the raw gRPC stream's, same layout

    def round_mbps(self) -> list[float]:
        return [
            2 * self.model_bytes / (a + b) / MB
            for a, b in zip(self.push_s, self.pull_s, strict=True)
        ]

    @property
    def median(self) -> float:
        return statistics.median(self.round_mbps())

    def direction_mbps(self, times: list[float]) -> float:
        return self.model_bytes / statistics.median(times) / MB

    def to_json(self) -> dict[str, Any]:
        rates = self.round_mbps()
        total_s = sum(self.push_s) + sum(self.pull_s)
        return {
            "config": self.config,
            "peer": self.peer,
            "layout": self.layout,
            "shards": self.shards,
            "chunk_bytes": self.chunk_bytes,
            "mbps_median": self.median,
            "mbps_min": min(rates),
            "mbps_max": max(rates),
            "mbps_overall": 2 * self.model_bytes * len(rates) / total_s / MB,
            "push_mbps_median": self.direction_mbps(self.push_s),
            "pull_mbps_median": self.direction_mbps(self.pull_s),
            "ratio_to_raw_grpc_stream": self.ratio,
            "push_s": self.push_s,
            "pull_s": self.pull_s,
        }


Round = tuple[Callable[[], None], Callable[[], None]]  # (push, pull) of one configuration


def run_interleaved(cases: list[tuple[Measurement, Round]], rounds: int) -> None:
    """Times ``rounds`` push+pull rounds of every case, one round of each case in turn.

    Interleaving means a burst of load from elsewhere on the machine hits every configuration
    alike, so the ratios stay meaningful even when the absolute numbers wander.
    """
    # The warm-up pays for connection setup, first allocations and page faults.
    for _, (push, pull) in cases:
        push()
        pull()
    for r in range(rounds):
        # Rotate the order so no configuration always runs right after the same neighbour.
        for m, (push, pull) in cases[r % len(cases) :] + cases[: r % len(cases)]:
            t0 = time.perf_counter()
            push()
            t1 = time.perf_counter()
            pull()
            t2 = time.perf_counter()
            m.push_s.append(t1 - t0)
            m.pull_s.append(t2 - t1)


def open_ours(
    m: Measurement,
    addresses: list[str],
    model: dict[str, np.ndarray],
    grads: dict[str, np.ndarray],
    stack: contextlib.ExitStack,
) -> Round:
    """Our client, async mode, one worker, SGD: push every gradient, pull every weight."""
    chunk = m.chunk_bytes or DEFAULT_CHUNK_BYTES
    client = stack.enter_context(
        psworker.connect(addresses, worker_id=0, num_workers=1, mode="async", chunk_bytes=chunk)
    )
    client.init(model, psworker.SGD(lr=1e-3))

    def pull() -> None:
        weights = client.pull()
        got = sum(w.nbytes for w in weights.values())
        if got != m.model_bytes:
            raise RuntimeError(f"pull returned {got} bytes, expected {m.model_bytes}")

    return lambda: client.push(grads), pull


def open_raw_grpc(m: Measurement, address: str, blob: bytes, stack: contextlib.ExitStack) -> Round:
    """Raw gRPC: chunks streamed each way, or (chunk_bytes None) one message each way."""
    nbytes = m.model_bytes
    channel = stack.enter_context(grpc.insecure_channel(address, options=RAW_OPTIONS))
    grpc.channel_ready_future(channel).result(timeout=START_TIMEOUT_S)

    def expect(got: int) -> None:
        if got != nbytes:
            raise RuntimeError(f"raw gRPC moved {got} bytes, expected {nbytes}")

    if m.chunk_bytes is None:
        push_whole = channel.unary_unary(f"/{RAW_SERVICE}/PushWhole")
        pull_whole = channel.unary_unary(f"/{RAW_SERVICE}/PullWhole")

        def push() -> None:
            expect(int.from_bytes(push_whole(blob, timeout=RPC_TIMEOUT_S), "little"))

        def pull() -> None:
            expect(len(pull_whole(b"", timeout=RPC_TIMEOUT_S)))

        return push, pull

    step = m.chunk_bytes
    chunks = [blob[i : i + step] for i in range(0, nbytes, step)]
    push_stream = channel.stream_unary(f"/{RAW_SERVICE}/Push")
    pull_stream = channel.unary_stream(f"/{RAW_SERVICE}/Pull")

    def push_chunks() -> None:
        expect(int.from_bytes(push_stream(iter(chunks), timeout=RPC_TIMEOUT_S), "little"))

    def pull_chunks() -> None:
        expect(sum(len(c) for c in pull_stream(b"", timeout=RPC_TIMEOUT_S)))

    return push_chunks, pull_chunks


def open_tcp(m: Measurement, address: str, blob: bytes, stack: contextlib.ExitStack) -> Round:
    """Loopback TCP: the model's bytes to the echo thread (push) and back again (pull)."""
    host, port = address.rsplit(":", 1)
    header = m.model_bytes.to_bytes(8, "little")
    inbox = memoryview(bytearray(m.model_bytes))
    sock = stack.enter_context(socket.create_connection((host, int(port)), RPC_TIMEOUT_S))
    # Small messages: Nagle would hold the payload behind the header until a delayed ACK.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def push() -> None:
        sock.sendall(header)
        sock.sendall(blob)

    def pull() -> None:
        got = recv_into(sock, inbox)
        if got != m.model_bytes:
            raise RuntimeError(f"raw TCP moved {got} bytes, expected {m.model_bytes}")

    return push, pull


# -- servers: in this process or in child processes ------------------------------------------


def fmt_bytes(n: int) -> str:
    return f"{n // MIB} MiB" if n % MIB == 0 else f"{n // KIB} KiB"


def run(args: argparse.Namespace) -> tuple[list[Measurement], dict[str, str]]:
    """Runs every configuration; returns the measurements and how shards were started."""
    model = make_model(args.mib)
    grads = {name: np.full_like(v, 1e-4) for name, v in model.items()}
    nbytes = sum(v.nbytes for v in model.values())
    blob = np.random.default_rng(2).bytes(nbytes)
    chunk = DEFAULT_CHUNK_BYTES
    layouts = [IN_PROCESS, SEPARATE]
    if args.subprocess:
        layouts = [SEPARATE]
    elif args.inprocess:
        layouts = [IN_PROCESS]
    # The chunk sweep runs where the GIL is not shared with the server, when that is measured.
    sweep_layout = None if args.no_chunk_sweep else layouts[-1]
    started: dict[str, str] = {}
    results: list[Measurement] = []

    for layout in layouts:
        cases: list[tuple[Measurement, Round]] = []
        with (
            tempfile.TemporaryDirectory(prefix="bench_pushpull_") as tmp,
            contextlib.ExitStack() as stack,
        ):
            address = stack.enter_context(raw_grpc_server(layout, nbytes, chunk))
            for name, step in (
                (f"{fmt_bytes(chunk)} chunks", chunk),
                (f"one {fmt_bytes(nbytes)} message", None),
            ):
                kind = "stream" if step else "unary"
                m = Measurement(
                    f"raw gRPC {kind}, {name}", f"raw-grpc-{kind}", layout, 1, step, nbytes
                )
                cases.append((m, open_raw_grpc(m, address, blob, stack)))
            configs = [(1, chunk), (2, chunk)]
            if layout == sweep_layout:
                configs += [(1, c) for c in SWEEP_CHUNKS if c != chunk]
            for n, c in configs:
                # Each configuration gets its own shards: clients sharing a shard as the same
                # worker would see each other's steps as duplicates and skip the update.
                addresses, how = stack.enter_context(shards(layout, n, Path(tmp)))
                started[layout] = how
                name = f"ours, {n} shard{'s' if n > 1 else ''}, {fmt_bytes(c)} chunks"
                m = Measurement(name, "ours", layout, n, c, nbytes)
                cases.append((m, open_ours(m, addresses, model, grads, stack)))
            if layout == SEPARATE and not args.no_tcp:
                address, stop = start_child(serve_tcp)
                stack.callback(stop)
                m = Measurement("raw TCP sendall/recv_into", "raw-tcp", layout, 1, None, nbytes)
                cases.append((m, open_tcp(m, address, blob, stack)))
            print(f"{layout}: {len(cases)} configurations, {args.rounds} rounds", flush=True)
            run_interleaved(cases, args.rounds)
        results += [m for m, _ in cases]

    peers = {m.layout: m.median for m in results if m.peer == "raw-grpc-stream"}
    for m in results:
        base = peers.get(m.layout)
        m.ratio = m.median / base if base else None
    return results, started


def print_table(
    results: list[Measurement], started: dict[str, str], args: argparse.Namespace
) -> None:
    nbytes = results[0].model_bytes
    print()
    print(
        f"push+pull of a {nbytes / MIB:.0f} MiB float32 model, async, 1 worker, SGD; "
        f"median of {args.rounds} rounds after 1 warm-up; MB = 1e6 bytes"
    )
    head = (
        f"{'config':<38}{'layout':<11}{'MB/s':>7}{'min-max':>13}"
        f"{'push':>7}{'pull':>7}{'vs raw stream':>15}"
    )
    print(head)
    print("-" * len(head))
    for m in results:
        rates = m.round_mbps()
        ratio = f"{m.ratio:.2f}" if m.ratio is not None else "-"
        print(
            f"{m.config:<38}{m.layout:<11}{m.median:7.0f}"
            f"{f'{min(rates):.0f}-{max(rates):.0f}':>13}"
            f"{m.direction_mbps(m.push_s):7.0f}{m.direction_mbps(m.pull_s):7.0f}{ratio:>15}"
        )
    print(
        "push/pull: MB/s of each direction alone. 'vs raw stream': median MB/s over the raw gRPC "
        "stream's in the same layout (raw TCP: over the processes one)."
    )
    for layout, how in started.items():
        print(f"shards, {layout}: {how}")


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "numpy": np.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pushpull", description=__doc__)
    parser.add_argument("--mib", type=int, default=None, help="model size in MiB (default 100)")
    parser.add_argument("--quick", action="store_true", help="a 16 MiB model unless --mib")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per configuration")
    parser.add_argument("--json", default=DEFAULT_JSON, help=f"output path ({DEFAULT_JSON})")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--subprocess", action="store_true", help="only shards in child processes")
    only.add_argument("--inprocess", action="store_true", help="only shards in this process")
    parser.add_argument("--no-chunk-sweep", action="store_true", help="skip 256 KiB/4 MiB chunks")
    parser.add_argument("--no-tcp", action="store_true", help="skip the raw TCP ceiling")
    args = parser.parse_args(argv)
    if args.mib is None:
        args.mib = 16 if args.quick else 100
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")

    t0 = time.perf_counter()
    results, started = run(args)
    elapsed = time.perf_counter() - t0
    print_table(results, started, args)
    print(f"total {elapsed:.0f}s")

    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "pushpull",
        "unit": "MB/s, 1e6 bytes per second; a round moves the model once each way",
        "model_mib": args.mib,
        "model_bytes": results[0].model_bytes,
        "variables": {k: list(v) for k, v in model_shapes(args.mib).items()},
        "rounds": args.rounds,
        "shards_started_by": started,
        "environment": environment(),
        "elapsed_s": elapsed,
        "results": [m.to_json() for m in results],
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
