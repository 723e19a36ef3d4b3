"""Cluster administration for ``psctl``: checkpoint every shard, export the model's state_dict."""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np

from pscore.tables import IDS_SUFFIX, slot_key
from pswire import cli
from pswire.cluster import ClusterSpec
from pswire.codec import ChunkAssembler
from pswire.errors import InvalidRequestError, ModelMismatchError, NotInitializedError, PSError
from pswire.optstate import split_state
from pswire.piecekey import parse_piece_key
from pswire.proto import ps_pb2, ps_pb2_grpc
from pswire.rpc_errors import from_rpc_error
from pswire.security import ClientSecurity
from psworker import launchers

log = logging.getLogger(__name__)
T = TypeVar("T")
NO_IDS = np.empty(0, np.int64)

# Must equal psworker.torch.BUFFER_PREFIX; not imported from there because that module needs
# torch, and exporting must work without it.
BUFFER_PREFIX = "buffer:"
COMMANDS = ("checkpoint", "export")
DEFAULT_OUT = "model.pt"
# Read from the environment by every command that calls the shards (no flags: command lines
# are visible to other users).
SECURITY_EPILOG = (
    "TLS and token, from the environment as for workers: $PS_TLS_CA (CA that signed the "
    "shards' certificates; turns TLS on), $PS_TLS_CERT and $PS_TLS_KEY (this client's "
    "certificate, for shards demanding mutual TLS), $PS_TOKEN or $PS_TOKEN_FILE (the shared "
    "token)."
)


@dataclass(frozen=True)
class ShardCheckpoint:
    """Where one shard saved its checkpoint, and at which shard clock."""

    address: str
    path: str
    step: int


@dataclass(frozen=True)
class Export:
    """A written state_dict: its file, format, tensors, and each shard's clock when read."""

    path: Path
    format: str  # "torch" or "safetensors"
    tensors: dict[str, np.ndarray]
    clocks: list[int]


def checkpoint_all(
    addresses: Sequence[str], timeout: float = 60.0, security: ClientSecurity | None = None
) -> list[ShardCheckpoint]:
    """Asks every shard to save a checkpoint now (in parallel); results in address order.

    ``security`` defaults to the ``$PS_TLS_*`` / ``$PS_TOKEN`` settings.

    Raises:
        PSError: a shard failed or did not answer within ``timeout``; the message names every
            failed shard (the others still saved theirs).
    """
    security = security or ClientSecurity.from_env()

    def one(index: int) -> ShardCheckpoint:
        address = addresses[index]
        reply = _call(
            address,
            security,
            f"Checkpoint on shard {index} ({address})",
            lambda stub: stub.Checkpoint(ps_pb2.CheckpointRequest(), timeout=timeout),
        )
        return ShardCheckpoint(address, reply.path, int(reply.step))

    return _all_or_raise(len(addresses), one)


def export_state_dict(
    addresses: Sequence[str],
    out_path: str | Path,
    timeout: float = 120.0,
    security: ClientSecurity | None = None,
) -> Export:
    """Pulls the whole model from the shards and writes it as one state_dict file.

    Fixed-size embedding tables are written whole under their table name; a dynamic table
    as the rows every shard holds under its name and their int64 ids under its name plus
    ``.ids`` (``pscore.tables.IDS_SUFFIX``; each shard's least recently used first, in shard
    order); beside a table's rows, their optimizer slots in the same order, and its counts
    (``pscore.tables.slot_key``): what ``Table(..., init_from=...)`` reads. Split variables
    are joined, buffer names lose their ``buffer:`` prefix, so the file loads into the
    module with ``model.load_state_dict(torch.load(path))``. It is a torch file
    (tensors only: ``torch.load(..., weights_only=True)`` reads it) unless ``out_path`` ends
    in ``.safetensors`` or torch is not installed; then it is safetensors, with that suffix.
    The file appears atomically. While training runs, shards may be read at different steps:
    ``clocks`` says at which.

    Raises:
        NotInitializedError: a shard holds no values yet.
        ModelMismatchError: the shards hold parts of different models.
        InvalidRequestError: the pieces do not join into whole variables.
        PSError: a shard failed or did not answer within ``timeout``.
        OSError: the file could not be written.
    """
    security = security or ClientSecurity.from_env()
    pieces, clocks = pull_pieces(addresses, timeout, security)
    tensors = join_pieces(pieces)
    if len(set(clocks)) > 1:
        log.warning("shards were read at different clocks %s: training is still running", clocks)
    path, fmt = save_state_dict(tensors, Path(out_path))
    return Export(path, fmt, tensors, clocks)


def pull_pieces(
    addresses: Sequence[str], timeout: float, security: ClientSecurity
) -> tuple[list[dict[str, np.ndarray]], list[int]]:
    """Every variable (piece) each shard holds, and each shard's clock, in address order; a
    table's rows with their optimizer state (``pscore.tables.slot_key``).

    Raises:
        NotInitializedError: a shard holds no values yet.
        ModelMismatchError: shards disagree on the model digest.
        PSError: a call failed.
    """

    def one(index: int) -> tuple[dict[str, np.ndarray], int, str, dict[str, int]]:
        address = addresses[index]
        where = f"shard {index} ({address})"
        st = _call(
            address,
            security,
            f"Status on {where}",
            lambda stub: stub.Status(ps_pb2.StatusRequest(), timeout=timeout),
        )
        if not st.initialized or not st.HasField("job"):
            raise NotInitializedError(f"{where} holds no model yet: nothing to export")
        keys = [v.name for v in st.job.variables if not v.HasField("table")]
        # Tables come as slices joined in shard order: a fixed one's id range on this shard,
        # a dynamic one's every row (least recently used first) and their ids beside.
        tables = [v for v in st.job.variables if v.HasField("table")]
        rows = [
            ps_pb2.RowQuery(table=v.name, every=True, slots=True)
            if not v.table.num_rows
            else ps_pb2.RowQuery(
                table=v.name,
                ids=np.arange(v.table.row_start, v.table.row_end, dtype="<i8").tobytes(),
                slots=True,
            )
            for v in tables
        ]
        if not keys and not rows:
            return {}, int(st.clock), st.job.model_digest, {}
        # Step 0 never waits in any mode once values exist, so this reads the current weights.
        # worker_id -1 marks an observer: the shard does not count it as a worker's sign of life.
        request = ps_pb2.PullRequest(worker_id=-1, step=0, names=keys, rows=rows)

        n = len(addresses)

        def pull(stub: ps_pb2_grpc.ParameterServerStub) -> tuple[dict[str, np.ndarray], int]:
            assembler = ChunkAssembler()
            clock = int(st.clock)
            for reply in stub.Pull(request, timeout=timeout):
                assembler.add(reply.chunk)
                clock = int(reply.clock)
            arrays, slots = split_state(assembler.finish())
            for v in tables:
                # As the slices of a split variable, so join_pieces concatenates them: the
                # rows, a dynamic table's ids (none sent when the shard holds none) and the
                # rows' optimizer state; a count (Adam's step) stays whole (pull_pieces).
                table = {v.name: arrays.pop(v.name)} if v.name in arrays else {}
                if not v.table.num_rows:
                    table[v.name + IDS_SUFFIX] = assembler.indices.get(v.name, NO_IDS)
                table |= {slot_key(v.name, k): a for k, a in slots.get(v.name, {}).items()}
                for key, array in table.items():
                    if array.ndim:
                        arrays[f"{key}/part{index}of{n}"] = array
                    else:
                        counts[key] = int(array)
            return arrays, clock

        counts: dict[str, int] = {}
        arrays, clock = _call(address, security, f"Pull on {where}", pull)
        return arrays, clock, st.job.model_digest, counts

    results = _all_or_raise(len(addresses), one)
    digests = {digest for _, _, digest, _ in results}
    if len(digests) > 1:
        raise ModelMismatchError(
            "the shards hold parts of different models (digests "
            + ", ".join(f"{a}: {d}" for a, (_, _, d, _) in zip(addresses, results, strict=True))
            + ")"
        )
    pieces = [r[0] for r in results]
    # A table's count is the same on every shard (each update steps every slice), unless
    # training goes on while the shards are read (then clocks differ too): the largest.
    counts: dict[str, int] = {}
    for _, _, _, shard_counts in results:
        for key, count in shard_counts.items():
            counts[key] = max(count, counts.get(key, count))
    pieces[0].update({k: np.asarray(c, np.int64) for k, c in counts.items()})
    return pieces, [r[1] for r in results]


def join_pieces(pieces: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Whole variables from every shard's pieces, named as the module names them.

    Raises:
        InvalidRequestError: a key on two shards, missing or inconsistent slices, or two
            variables with one name once the buffer prefix is dropped.
    """
    merged: dict[str, np.ndarray] = {}
    for shard in pieces:
        for key, array in shard.items():
            if key in merged:
                raise InvalidRequestError(f"variable '{key}' is held by two shards")
            merged[key] = array
    slices: dict[str, dict[int, np.ndarray]] = {}
    counts: dict[str, set[int]] = {}
    whole: dict[str, np.ndarray] = {}
    for key, array in merged.items():
        piece = parse_piece_key(key)  # workers refuse whole variables named like this
        if piece is None:
            whole[key] = array
            continue
        var, index, count = piece
        slices.setdefault(var, {})[index] = array
        counts.setdefault(var, set()).add(count)
    for var, parts in slices.items():
        (k, *more) = sorted(counts[var])
        if more or sorted(parts) != list(range(k)):
            raise InvalidRequestError(
                f"variable '{var}' has slices {sorted(parts)} of {sorted(counts[var])}; "
                "a shard is missing or holds another model"
            )
        if var in whole:
            raise InvalidRequestError(f"variable '{var}' is stored both whole and in slices")
        whole[var] = np.concatenate([parts[i] for i in range(k)], axis=0)
    out: dict[str, np.ndarray] = {}
    for key, array in whole.items():
        name = key.removeprefix(BUFFER_PREFIX)
        if name in out:
            raise InvalidRequestError(f"'{name}' is both a parameter and a buffer")
        out[name] = array
    return out


def save_state_dict(tensors: Mapping[str, np.ndarray], path: Path) -> tuple[Path, str]:
    """Writes ``tensors`` atomically as a torch state_dict, or safetensors (see export).

    Returns the path written (its suffix becomes ``.safetensors`` when torch is missing) and
    the format.

    Raises:
        OSError: the file could not be written.
    """
    fmt = "safetensors" if path.suffix == ".safetensors" else "torch"
    if fmt == "torch":
        try:
            import torch
        except ImportError:
            fmt, path = "safetensors", path.with_suffix(".safetensors")
            log.warning("torch is not installed: writing safetensors to %s instead", path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        if fmt == "torch":
            # Copies: the pulled arrays may be read-only views of the received messages.
            state = {name: torch.from_numpy(np.array(a, copy=True)) for name, a in tensors.items()}
            torch.save(state, tmp)
        else:
            import safetensors.numpy

            contiguous = {n: a if a.flags.c_contiguous else a.copy() for n, a in tensors.items()}
            safetensors.numpy.save_file(contiguous, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path, fmt


# -- psctl commands -------------------------------------------------------------------------


def add_parsers(commands: argparse._SubParsersAction) -> None:
    """Adds ``checkpoint`` and ``export`` to ``psctl``'s subcommands."""
    checkpoint = commands.add_parser(
        "checkpoint",
        help="make every shard save a checkpoint now",
        description="Calls Checkpoint on each shard (started with --checkpoint-dir) in parallel.",
        epilog=SECURITY_EPILOG,
    )
    add_target_flags(checkpoint, timeout=60.0)
    export = commands.add_parser(
        "export",
        help="write the whole model as one torch state_dict file",
        description=(
            "Pulls every variable from the shards, joins split ones, drops the buffer: prefix, "
            "and writes a file for model.load_state_dict(torch.load(PATH)). An embedding "
            "table's rows come with their optimizer state (NAME.exp_avg, ...) and a dynamic "
            "one's ids (NAME.ids), what Table(..., init_from=PATH) reads. A path ending in "
            ".safetensors (or no torch installed) writes safetensors instead."
        ),
        epilog=SECURITY_EPILOG,
    )
    add_target_flags(export, timeout=120.0)
    cli.add(export, "--out", env="PS_EXPORT_OUT", default=DEFAULT_OUT, help="output file")


def main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Runs ``psctl checkpoint`` or ``psctl export``; returns the exit code."""
    addresses = shard_addresses(parser, args)
    try:
        if args.command == "checkpoint":
            for saved in checkpoint_all(addresses, args.timeout):
                print(f"{saved.address}: checkpoint at step {saved.step} in {saved.path}")
            return 0
        done = export_state_dict(addresses, args.out, args.timeout)
    except (PSError, OSError, ValueError) as exc:
        print(f"psctl {args.command}: {exc}")
        return 1
    size = sum(a.nbytes for a in done.tensors.values())
    print(
        f"wrote {len(done.tensors)} tensors ({size} bytes, {done.format}) to {done.path}; "
        f"shard clocks {done.clocks}"
    )
    return 0


def add_target_flags(parser: argparse.ArgumentParser, timeout: float) -> None:
    """ADDR..., --cluster and --timeout: which shards a psctl subcommand talks to."""
    cli.add(
        parser,
        "--cluster",
        env="PS_CLUSTER",
        help="TF_CONFIG JSON or file whose cluster.ps lists the shards, when no ADDR is given "
        "(else $TF_CONFIG)",
    )
    parser.add_argument("addresses", nargs="*", metavar="ADDR", help="shard host:port")
    cli.add(
        parser,
        "--timeout",
        env="PS_SHARD_TIMEOUT",
        type=float,
        default=timeout,
        help="seconds each shard has to answer",
    )


def shard_addresses(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The shards a psctl subcommand talks to: its ADDR arguments, else --cluster, else
    $PS_SHARDS, $PS_SHARDS_FILE or $TF_CONFIG (as a worker finds them)."""
    addresses = list(args.addresses)
    if not addresses:
        if args.cluster is not None:
            try:
                spec = ClusterSpec.load(args.cluster)
            except ValueError as exc:
                parser.error(str(exc))
            found = (list(spec.ps), "--cluster") if spec is not None else None
        else:
            try:
                found = launchers.shard_addresses()
            except ValueError as exc:
                parser.error(str(exc))
        if found is None:
            parser.error("give shard addresses, --cluster, $PS_SHARDS, or set $TF_CONFIG")
        addresses = found[0]
    if not addresses:
        parser.error("the cluster spec lists no parameter servers (cluster.ps)")
    return addresses


def _call(
    address: str,
    security: ClientSecurity,
    where: str,
    fn: Callable[[ps_pb2_grpc.ParameterServerStub], T],
) -> T:
    with security.channel(address) as channel:
        try:
            return fn(ps_pb2_grpc.ParameterServerStub(channel))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, where) from None


def _all_or_raise(n: int, fn: Callable[[int], T]) -> list[T]:
    """``fn`` on 0..n-1 in parallel; every call finishes before the first failure is raised."""
    if n == 0:
        return []
    with ThreadPoolExecutor(max_workers=min(n, 32), thread_name_prefix="psctl") as pool:
        futures = [pool.submit(fn, i) for i in range(n)]
        errors = [f.exception() for f in futures]
    failed = [e for e in errors if e is not None]
    if not failed:
        return [f.result() for f in futures]
    if len(failed) == 1:
        raise failed[0]
    first = failed[0]
    message = "; ".join(str(e) for e in failed)
    if isinstance(first, PSError):
        combined = type(first)(message)
        combined.status = first.status  # type: ignore[misc]
        raise combined from first
    raise first
