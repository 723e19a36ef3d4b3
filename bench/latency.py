"""Per-step round trip of a 1,000-parameter model: ours vs a torch RPC PS vs a raw gRPC echo."""

from __future__ import annotations

import argparse
import contextlib
import queue
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent import futures
from multiprocessing.connection import Connection
from pathlib import Path

import grpc

from bench import peers, torchps
from bench.report import Ratio, Table, check, median, p90, print_table
from bench.throughput import OURS, TORCH_DEFAULT, TORCH_TCP, ours_step
from bench.timing import Step, interleave

SHAPES: dict[str, tuple[int, ...]] = {"w": (30, 30), "b": (100,)}  # 1,000 float32 parameters
ECHO = "raw gRPC unary echo"
ECHO_METHOD = "/bench.Echo/Echo"
STREAM_ECHO = "raw gRPC echo on an open stream"
STREAM_METHOD = "/bench.Echo/Stream"


def _serve_echo(conn: Connection) -> None:
    """Child process: a gRPC server whose one unary method sends the request bytes back."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    handler = grpc.method_handlers_generic_handler(
        "bench.Echo",
        {
            "Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req),
            "Stream": grpc.stream_stream_rpc_method_handler(lambda reqs, ctx: iter(reqs)),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    conn.send(f"127.0.0.1:{port}")
    try:
        with contextlib.suppress(EOFError):
            conn.recv()
    finally:
        server.stop(0.5)


@contextlib.contextmanager
def echo_steps(nbytes: int) -> Iterator[tuple[Step, Step]]:
    """(a unary echo call, an echo on one open bidirectional stream), ``nbytes`` each way."""
    address, stop = peers.start_child(_serve_echo)
    requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    try:
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=peers.START_TIMEOUT_S)
            call = channel.unary_unary(ECHO_METHOD)
            payload = bytes(nbytes)
            replies = channel.stream_stream(STREAM_METHOD)(
                iter(requests.get, None), timeout=peers.RPC_TIMEOUT_S * 10
            )

            def check(reply: bytes) -> None:
                if len(reply) != nbytes:
                    raise RuntimeError("echo returned the wrong number of bytes")

            def unary() -> None:
                check(call(payload, timeout=peers.RPC_TIMEOUT_S))

            def streamed() -> None:
                requests.put(payload)
                check(next(replies))

            yield unary, streamed
            requests.put(None)
    finally:
        stop()


def measure(quick: bool, steps: int | None = None) -> Table:
    t0 = time.perf_counter()
    rounds = steps or (50 if quick else 200)
    nbytes = 4 * 1000
    with tempfile.TemporaryDirectory(prefix="bench_lat_") as tmp, contextlib.ExitStack() as st:
        systems: dict[str, Step] = {OURS: st.enter_context(ours_step(SHAPES, 1, Path(tmp)))}
        systems[TORCH_DEFAULT] = st.enter_context(torchps.torch_ps(SHAPES, 1, torchps.DEFAULT))
        systems[TORCH_TCP] = st.enter_context(torchps.torch_ps(SHAPES, 1, torchps.TCP))
        systems[ECHO], systems[STREAM_ECHO] = st.enter_context(echo_steps(nbytes))
        print(f"latency: {len(systems)} systems, {rounds} steps", flush=True)
        times = interleave(systems, rounds, warmup=5)
    med = {k: median(v) for k, v in times.items()}
    rows = [
        [
            name,
            median(ts) * 1e3,
            p90(ts) * 1e3,
            min(ts) * 1e3,
            med[name] / med[OURS] if name != OURS else None,
        ]
        for name, ts in times.items()
    ]
    ratios = [
        Ratio(
            "latency",
            "1,000 params, 1 shard, median",
            OURS,
            peer,
            med[peer] / med[OURS],
            goal=goal,
            met=check(med[peer] / med[OURS], goal),
        )
        for peer, goal in (
            (TORCH_TCP, ">= 1.0"),
            (TORCH_DEFAULT, ">= 1.0"),
            (ECHO, ""),
            (STREAM_ECHO, ""),
        )
    ]
    return Table(
        name="latency",
        title="push+pull round trip of a 1,000-parameter model (4 KB), 1 worker, 1 shard",
        columns=["system", "median ms", "p90 ms", "min ms", "peer/ours time"],
        rows=rows,
        notes=[
            f"{rounds} interleaved steps after 5 warm-up. ours: client.push_pull, one "
            "PushPullRequest and its reply on the data port's step exchange kept open across "
            "steps (ps.step/1); "
            "torch RPC PS: one fused update_and_fetch RPC; echoes: 4 KB each way, a unary "
            "call, or one message each way on an open bidirectional stream (grpcio's floor; "
            "Flight's open exchange is ~half of it, bench/NOTES.md 36).",
            "peer/ours time > 1: ours faster.",
        ],
        ratios=ratios,
        raw={"times_s": times},
        elapsed_s=time.perf_counter() - t0,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="50 steps")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 200)")
    args = parser.parse_args(argv)
    print_table(measure(args.quick, args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
