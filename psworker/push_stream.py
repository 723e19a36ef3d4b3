"""A step's push streamed to the shards while backward produces it (``overlap=True``, steps
on the Flight data port).

At a step's first gradient, every shard whose step goes on its data port is sent the step's
header: the manifest of every tensor the push will carry (the gradients the previous step
pushed, in the order backward produced them, then the buffers). A thread per shard then writes
each gradient's bytes as soon as backward produces it, in manifest order (one that comes early
waits for those before it). The last tensor with bytes waits until ``step()`` has checked that
nothing changed the gradients already written: a shard applies nothing before it has a step's
every byte, so a cancelled stream leaves every shard as it was. ``step()`` then either lets the
last tensor go (``StepStreams.finish``), or cancels the stream and the step is sent whole (the
gradients are not the manifest's: a parameter unused this step) or refused (a clip after the
gradients left). A stream that fails before its last tensor (the shard unreachable, restarted
or busy; its deadline passed while the script had not reached ``step()``) is sent again whole
once ``step()`` completes it, through the link's retry and replay rules; after its last tensor,
the link's rules for a step apply unchanged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence, Set
from typing import TYPE_CHECKING

import grpc
import numpy as np

from pscore.optspec import StepOptions
from pswire import flightwire as fw
from pswire.proto import ps_pb2
from psworker.outgoing import split_push, wire_dtype
from psworker.placement import ShardMap, copy_in
from psworker.transport import Reply

if TYPE_CHECKING:
    from psworker.link import ShardLink
    from psworker.transport_flight import StreamedStep

__all__ = ["ShardStream", "StepStreams"]

# A stream that fails with one of these before its last tensor is sent again whole: the
# shard is unreachable or restarted (the link's own retry rule), busy (--max-inflight-bytes:
# a stream holds its bytes longer than a whole step), or the stream's deadline passed (or it
# was cancelled) before the script reached step(). Nothing of it was applied.
_RESEND = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
# After its last tensor, only these: the link's retry rule (a step is applied once), and a
# refusal (a refused push is never applied). A deadline there is the step's own, as ever.
_AFTER_LAST = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.RESOURCE_EXHAUSTED}
)


class ShardStream:
    """One shard's push of one step, streamed on its data port as backward produces it.

    ``add`` and ``finish`` come from the training thread, ``run`` runs on a thread of its own
    (it writes, then reads the reply), ``abort`` from any thread.
    """

    def __init__(
        self,
        link: ShardLink,
        step: int,
        entries: Sequence[ps_pb2.TensorChunk],
        into: Mapping[str, np.ndarray],
        options: StepOptions | None,
        placed: Callable[[str], None] | None = None,
    ) -> None:
        self.link = link
        self.step = step
        self._placed = placed
        # Pieces of this stream's reply that landed (``placed``): the next forward may have
        # used them, and changed a buffer in place (BatchNorm's running stats), so a reply to
        # the step sent again whole must not land on them.
        self._landed: set[str] = set()
        self._entries = list(entries)
        self._into = into
        self._options = options
        self._index = {e.name: i for i, e in enumerate(self._entries)}
        # The last tensor with bytes: the shard has the whole step once it has it.
        self._held = max((i for i, e in enumerate(self._entries) if e.total_bytes), default=-1)
        self.pieces: dict[str, np.ndarray] = {}  # every tensor added, by key (as checked)
        self._added: set[int] = set()  # manifest indices added
        self._ready: dict[int, np.ndarray] = {}  # manifest index -> its bytes, not written yet
        self._stray: list[str] = []  # added, but not as the manifest announced them
        self._cond = threading.Condition()
        self._state = "open"  # -> "finished" (by step()), "aborted" or "expired"
        self._stream: StreamedStep | None = None

    @property
    def state(self) -> str:
        """``open``, ``finished``, ``aborted`` or ``expired`` (its deadline came first)."""
        return self._state

    def add(self, key: str, piece: np.ndarray) -> None:
        """A tensor of the push (a checked, compressed piece), to be written in its turn."""
        entry, raw = fw.encode_tensor(key, piece)
        with self._cond:
            self.pieces[key] = piece
            i = self._index.get(key, -1)
            if (
                i < 0
                or i in self._added
                or (self._entries[i].dtype, tuple(self._entries[i].shape))
                != (entry.dtype, tuple(entry.shape))
            ):
                self._stray.append(key)  # not as announced: the step is sent whole instead
                return
            self._added.add(i)
            self._ready[i] = raw
            self._cond.notify()

    def finish(self) -> bool:
        """Every tensor of the push is added: lets the last one go. True when ``run`` carries
        the step (its reply, or its error); False when the stream cannot (cancelled, its
        deadline passed, or the tensors are not the manifest's: it is cancelled now, and the
        caller sends the step whole)."""
        with self._cond:
            if self._state != "open":
                return False
            stream = self._stream
            if self._stray or len(self.pieces) != len(self._entries):
                self._state = "aborted"
                self._cond.notify()
            elif stream is not None and time.monotonic() >= stream.deadline:
                # The writing thread has not woken to its deadline yet: the shard may have
                # dropped the stream already, so its last tensor must not be written to it.
                self._state = "expired"
                self._cond.notify()
            else:
                self._state = "finished"
                self._cond.notify()
                if stream is not None:
                    # Backward is over: the reply may land in the parameters from now on.
                    stream.read_reply()
                return True
        self._cancel()
        return False

    def abort(self) -> None:
        """Cancels the stream unless ``finish`` let it go: the shard applies nothing of it."""
        with self._cond:
            if self._state != "open":
                return
            self._state = "aborted"
            self._cond.notify()
        self._cancel()

    def run(self) -> Reply | None:
        """Writes the step as its tensors come, then reads the reply (decoded into ``into``).
        None: the stream was cancelled or expired, nothing of it applied (the caller sends the
        step whole, or not at all).

        Raises:
            PSError: the shard refused the step, or as ``ShardLink.push_pull``.
        """
        link = self.link
        failure: grpc.RpcError | None = None
        try:
            stream = link.begin_stream(
                self.step, self._entries, self._into, self._options, self._landing
            )
            with self._cond:
                self._stream = stream
                if self._state == "finished":  # finish() came first
                    stream.read_reply()
        except grpc.RpcError as exc:
            failure = exc
        deadline = time.monotonic() + link.timeout
        written = 0  # manifest entries written
        noted = False  # the push is in the replay log (before the shard can have it whole)
        link.streaming = self
        try:
            if self._stream is not None:
                deadline = self._stream.deadline
                if self._state == "aborted":  # cancelled before the stream existed
                    self._stream.cancel()
            while True:
                with self._cond:
                    ready = self._next(written, failure is None, deadline)
                    if ready is None:
                        return None  # aborted or expired
                if not ready:
                    break  # finished: every tensor written, or the stream failed
                if not noted and written + len(ready) > self._held:
                    link.note_push(self.step, self.pieces, self._options)
                    noted = True
                if failure is None:
                    assert self._stream is not None
                    try:
                        self._stream.write(ready)
                    except grpc.RpcError as exc:
                        failure = exc
                written += len(ready)
            if failure is None:
                assert self._stream is not None
                try:
                    return self._copied_in(link.stream_ended(self._stream.end()))
                except grpc.RpcError as exc:
                    failure = exc
            # Sent whole when the shard cannot have applied the stream: it failed before the
            # last tensor, or the shard refused it (busy). Past the last tensor, the link's
            # retry rule (unreachable, restarted) holds: a step is applied once.
            code = failure.code()
            whole = written > self._held  # the shard may hold every byte
            if link.closed or code not in (_AFTER_LAST if whole else _RESEND):
                raise link.error(failure, "PushPull")
            if not noted:
                link.note_push(self.step, self.pieces, self._options)
            # The same step's weights (sync; async: the shard's newest) for the pieces that
            # have not landed; those that have keep what landed.
            into = {k: a for k, a in self._into.items() if k not in self._landed}
            return self._copied_in(link.resend_step(self.step, self.pieces, into, self._options))
        finally:
            if link.streaming is self:
                link.streaming = None
            if self._stream is not None:
                self._stream.close()
                self._stream = None

    def _copied_in(self, reply: Reply) -> Reply:
        """``reply`` once its pieces not decoded straight into ``into`` are copied there
        (``copy_in``), except those that landed: the next forward may have used them."""
        copy_in(reply[1], self._into, skip=self._landed)
        return reply

    def _landing(self, key: str) -> None:
        """A piece of the reply landed in ``into`` (the thread reading the reply)."""
        self._landed.add(key)
        if self._placed is not None:
            self._placed(key)

    def _next(self, written: int, writing: bool, deadline: float) -> list[np.ndarray] | None:
        """(lock held) Waits for the tensors to write next, in manifest order: ``[]`` once
        ``finish`` came and nothing is left to write (or ``writing`` is False: the stream
        failed, only ``finish`` is awaited), None when aborted or expired."""
        while True:
            if self._state in ("aborted", "expired"):
                return None
            finished = self._state == "finished"
            ready: list[np.ndarray] = []
            if writing:
                i = written
                while i in self._ready and (i != self._held or finished):
                    ready.append(self._ready.pop(i))
                    i += 1
            if ready:
                return ready
            if finished and (not writing or written >= len(self._entries)):
                return []
            left = deadline - time.monotonic()
            if left <= 0:
                # step() did not come within the stream's deadline (the script is elsewhere):
                # the shard has dropped it; step() will send the step whole.
                self._state = "expired"
                return None
            self._cond.wait(left)

    def _cancel(self) -> None:
        stream = self._stream
        if stream is not None:
            stream.cancel()


class StepStreams:
    """Every shard's push of one step streamed from backward, for the shards whose step goes
    on a data port (``shards``); the others' steps go whole, as without streams. ``placed``
    is told each piece key of a streamed reply as it lands in ``into`` (a step sent whole
    tells nothing: it has landed when ``run`` returns)."""

    def __init__(
        self,
        links: Sequence[ShardLink],
        shard_map: ShardMap,
        step: int,
        order: Sequence[str],
        buffers: Sequence[str],
        into: Mapping[str, np.ndarray],
        options: StepOptions | None,
        compression: str | None,
        pushed: Callable[[int, list[ps_pb2.PushResponse]], object],
        placed: Callable[[str], None] | None = None,
    ) -> None:
        self.step = step
        self._shard_map = shard_map
        self._buffers: Set[str] = frozenset(buffers)
        self._compression = compression
        self._pushed = pushed
        entries: list[list[ps_pb2.TensorChunk]] = [[] for _ in links]
        for name in [*order, *buffers]:
            info = shard_map.infos[name]
            dtype = info.dtype if name in self._buffers else wire_dtype(info.dtype, compression)
            for p in shard_map.pieces_of(name):
                entries[p.shard].append(fw.manifest_entry(p.key, dtype, p.shape))
        self.streams = {
            shard: ShardStream(link, step, entries[shard], into, options, placed)
            for shard, link in enumerate(links)
            # A step of no bytes would be whole with its header: it goes whole, at step().
            if any(e.total_bytes for e in entries[shard]) and link.streams(entries[shard], into)
        }
        self.added: set[str] = set()  # the variables added (each once, to all its shards)

    @property
    def shards(self) -> frozenset[int]:
        return frozenset(self.streams)

    def add(self, name: str, array: np.ndarray) -> None:
        """A gradient (or buffer value) ready: checked and compressed as every push is
        (``split_push``), each of its pieces to its shard's stream.

        Raises:
            UnknownVariableError, ShapeMismatchError, InvalidRequestError: as ``push``.
        """
        pieces = split_push({name: array}, self._shard_map, {}, self._buffers, self._compression)
        self.added.add(name)
        for shard, stream in self.streams.items():
            for key, piece in pieces[shard].items():
                assert isinstance(piece, np.ndarray)  # dense: no tables with overlap
                stream.add(key, piece)

    def finish(self, late: Mapping[str, np.ndarray]) -> set[int]:
        """Adds ``late`` (the push's tensors not added yet: buffers, gradients no hook
        reported), then lets each stream's last tensor go; the shards whose stream carries the
        step (the others' streams are cancelled: send those steps whole).

        Raises:
            as ``add`` (the streams are then still open: ``abort`` them).
        """
        for name, array in late.items():
            self.add(name, array)
        return {shard for shard, stream in self.streams.items() if stream.finish()}

    def abort(self) -> None:
        """Cancels every stream ``finish`` did not let go: no shard applies any of them."""
        for stream in self.streams.values():
            stream.abort()

    def run(self, shard: int) -> bool | None:
        """``shard``'s stream to its end (a pool thread): whether the step was skipped (a
        worker's GradScaler), or None if the stream was cancelled or expired.

        Raises:
            PSError: as ``ShardStream.run``.
        """
        reply = self.streams[shard].run()
        if reply is None:
            return None
        self._pushed(self.step, [reply[0]])
        return bool(reply[0].skipped)
