"""The peers and servers the throughput benches run against: raw gRPC and loopback TCP
echo servers, and our shard in this process, in a child process or as the daemon."""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from psserver.server import start_server

KIB = 1 << 10
MIB = 1 << 20
RAW_SERVICE = "bench.RawBytes"
# The unary peer moves the whole model in one message, far over gRPC's 4 MiB default.
RAW_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
START_TIMEOUT_S = 60.0
RPC_TIMEOUT_S = 120.0
# fork() after grpc has started its threads can deadlock the child; spawn starts clean.
SPAWN = multiprocessing.get_context("spawn")

IN_PROCESS = "in-process"
SEPARATE = "processes"


def _raw_handler(nbytes: int, chunk_bytes: int) -> grpc.GenericRpcHandler:
    blob = np.random.default_rng(1).bytes(nbytes)
    chunks = [blob[i : i + chunk_bytes] for i in range(0, nbytes, chunk_bytes)]

    def push(request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        return sum(len(c) for c in request_iterator).to_bytes(8, "little")

    def pull(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield from chunks

    def push_whole(request: bytes, context: grpc.ServicerContext) -> bytes:
        return len(request).to_bytes(8, "little")

    def pull_whole(request: bytes, context: grpc.ServicerContext) -> bytes:
        return blob

    # No (de)serializers given: grpc then passes bytes through untouched, the identity codec.
    return grpc.method_handlers_generic_handler(
        RAW_SERVICE,
        {
            "Push": grpc.stream_unary_rpc_method_handler(push),
            "Pull": grpc.unary_stream_rpc_method_handler(pull),
            "PushWhole": grpc.unary_unary_rpc_method_handler(push_whole),
            "PullWhole": grpc.unary_unary_rpc_method_handler(pull_whole),
        },
    )


def start_raw_grpc(nbytes: int, chunk_bytes: int) -> tuple[str, Callable[[], None]]:
    """A raw-bytes gRPC server on a free loopback port; returns its address and a stopper.

    Raises:
        RuntimeError: no port could be bound.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=RAW_OPTIONS)
    server.add_generic_rpc_handlers((_raw_handler(nbytes, chunk_bytes),))
    port = server.add_insecure_port("127.0.0.1:0")
    if port == 0:
        raise RuntimeError("could not bind a loopback port for the raw gRPC server")
    server.start()
    return f"127.0.0.1:{port}", lambda: server.stop(0.5).wait(2.0)


def recv_into(sock: socket.socket, view: memoryview) -> int:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            break
        got += n
    return got


def _echo_connection(listener: socket.socket) -> None:
    sock, _ = listener.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # see pushpull.open_tcp
    with sock:
        buf = bytearray()
        header = memoryview(bytearray(8))
        while recv_into(sock, header) == 8:
            n = int.from_bytes(header, "little")
            if len(buf) < n:
                buf = bytearray(n)
            view = memoryview(buf)[:n]
            if recv_into(sock, view) != n:
                return
            sock.sendall(view)


def serve_tcp(conn: Connection) -> None:
    """Child process: a thread takes each length-prefixed message, then sends it back."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        threading.Thread(target=_echo_connection, args=(listener,), daemon=True).start()
        conn.send(f"127.0.0.1:{listener.getsockname()[1]}")
        with contextlib.suppress(EOFError):
            conn.recv()


class ChildStartError(RuntimeError):
    """A child process did not report its address in time."""


def _serve_shard(conn: Connection) -> None:
    """Child process: one shard server on a free port until the parent says stop."""
    server = start_server()
    conn.send(server.address)
    try:
        with contextlib.suppress(EOFError):
            conn.recv()
    finally:
        server.stop(0.5)


def _serve_raw_grpc(conn: Connection, nbytes: int, chunk_bytes: int) -> None:
    """Child process: the raw-bytes gRPC server until the parent says stop."""
    address, stop = start_raw_grpc(nbytes, chunk_bytes)
    conn.send(address)
    try:
        with contextlib.suppress(EOFError):
            conn.recv()
    finally:
        stop()


def start_child(target: Callable[..., None], *args: Any) -> tuple[str, Callable[[], None]]:
    """Runs ``target(conn, *args)`` in a spawned process; returns the address it sends.

    Raises:
        ChildStartError: the child died or sent nothing within START_TIMEOUT_S.
    """
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    child.close()

    def stop() -> None:
        with contextlib.suppress(OSError):
            parent.send(None)
        parent.close()
        proc.join(10.0)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)

    try:
        if not parent.poll(START_TIMEOUT_S):
            raise ChildStartError(f"{target.__name__} sent no address in {START_TIMEOUT_S}s")
        return parent.recv(), stop
    except (EOFError, ChildStartError) as exc:
        stop()
        raise ChildStartError(f"{target.__name__} failed (exit code {proc.exitcode})") from exc


def daemon_available() -> bool:
    """Whether ``python -m psserver`` can run (psserver/__main__.py exists)."""
    return importlib.util.find_spec("psserver.__main__") is not None


def address_from_port_file(text: str) -> str | None:
    text = text.strip()
    if text.isdigit() and int(text) > 0:
        return f"127.0.0.1:{text}"
    if ":" in text and text.rsplit(":", 1)[1].isdigit():
        return f"127.0.0.1:{text.rsplit(':', 1)[1]}"
    return None


def start_daemon_shard(workdir: Path) -> tuple[str, Callable[[], None]]:
    """Runs ``python -m psserver --port 0 --port-file F``; returns the address and a stopper.

    Raises:
        ChildStartError: the daemon exited or wrote no port within START_TIMEOUT_S.
    """
    # A fresh folder per daemon: a port file left by an earlier one must never be read.
    folder = Path(tempfile.mkdtemp(prefix="shard", dir=workdir))
    port_file, log_path = folder / "port", folder / "log"
    # Loopback only: the daemon's default host is 0.0.0.0.
    command = [sys.executable, "-m", "psserver", "--host", "127.0.0.1", "--port", "0"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*command, "--port-file", str(port_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def stop() -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)

    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        # Only a whole, parseable port counts, however the daemon writes the file.
        text = port_file.read_text() if port_file.exists() else ""
        address = address_from_port_file(text)
        if address is not None:
            return address, stop
        if proc.poll() is not None or time.monotonic() > deadline:
            stop()
            tail = log_path.read_text(errors="replace")[-800:]
            raise ChildStartError(f"psserver daemon wrote no port (exit {proc.returncode}): {tail}")
        time.sleep(0.05)


@contextlib.contextmanager
def shards(layout: str, n: int, workdir: Path) -> Iterator[tuple[list[str], str]]:
    """``n`` shard servers in ``layout``; yields their addresses and how they were started."""
    with contextlib.ExitStack() as stack:
        if layout == IN_PROCESS:
            servers = [start_server() for _ in range(n)]
            for s in servers:
                stack.callback(s.stop, 0.5)
            yield [s.address for s in servers], "start_server in this process"
            return
        addresses, how = [], ""
        if daemon_available():
            try:
                for _ in range(n):
                    address, stop = start_daemon_shard(workdir)
                    stack.callback(stop)
                    addresses.append(address)
                how = "python -m psserver"
            except ChildStartError as exc:
                print(f"note: {exc}; falling back to multiprocessing", file=sys.stderr)
                stack.close()
                addresses = []
        if not addresses:
            for _ in range(n):
                address, stop = start_child(_serve_shard)
                stack.callback(stop)
                addresses.append(address)
            how = "multiprocessing child calling start_server"
        yield addresses, how


@contextlib.contextmanager
def raw_grpc_server(layout: str, nbytes: int, chunk_bytes: int) -> Iterator[str]:
    if layout == IN_PROCESS:
        address, stop = start_raw_grpc(nbytes, chunk_bytes)
    else:
        address, stop = start_child(_serve_raw_grpc, nbytes, chunk_bytes)
    try:
        yield address
    finally:
        stop()


# -- driver ----------------------------------------------------------------------------------
