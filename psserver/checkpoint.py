"""Shard checkpoints: atomic safetensors files, the newest valid one restored, saves scheduled."""

from __future__ import annotations

import fcntl
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import safetensors
import safetensors.numpy

from psserver.checkpoint_codec import decode_state, digest, encode_state
from psserver.records import ShardState
from psserver.shard import Shard
from pswire.errors import CorruptCheckpointError, NotInitializedError, PSError

log = logging.getLogger(__name__)

_STATE_KEY = "psgrpc.state"
_DIGEST_KEY = "psgrpc.sha256"
_NAME = re.compile(r"ckpt-(\d{10,})\.safetensors")
_TMP_PREFIX = ".ckpt-"
# The shard's counters a state's signature holds, in ``_status_signature``'s order.
COUNTED = ("applied", "duplicate", "late")
_TMP_SUFFIX = ".tmp"
_LOCK_FILE = ".lock"
# safetensors writes a file through a temporary one of its own in the same folder (Rust's
# tempfile crate: ".tmp" and six letters or digits), which a crash mid-write leaves behind.
_SAFETENSORS_TMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")


def checkpoint_name(updates: int) -> str:
    """The file name of the checkpoint taken at shard clock ``updates``."""
    return f"ckpt-{updates:010d}.safetensors"


class Checkpointer:
    """Saves shard states into ``directory`` atomically and finds the newest valid one.

    A save writes a temporary file in the same directory, fsyncs it, renames it over
    ``ckpt-<updates>.safetensors`` and fsyncs the directory: a crash at any point leaves either
    the old set of files or the new one, never a torn checkpoint under a real name. Each file
    holds every array (``var/<key>``, ``slot/<key>/<slot>``) and, in the safetensors header,
    the job, clocks and counters as JSON with a SHA-256 over all of it, so bit rot is caught
    on load too. Nothing is pickled. Saves are serialized; ``keep`` bounds the files kept.
    """

    def __init__(self, directory: str | Path, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self._lock = threading.Lock()
        self._dir_lock: int | None = None

    def lock(self) -> None:
        """Claims the directory for this process and removes temp files a crashed save left.

        Two shards writing one directory would overwrite each other's checkpoints (the names
        carry only the clock), so a second daemon on the same directory must not start.

        Raises:
            RuntimeError: another process holds the directory.
            OSError: the directory cannot be created or locked.
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(
                f"checkpoint directory {self.directory} is in use by another process "
                "(give each shard its own --checkpoint-dir)"
            ) from None
        self._dir_lock = fd
        # Only now, holding the directory, is no other save writing these: our own temp names,
        # and the ones safetensors writes through before renaming (".tmp" + 6 characters).
        for path in self.directory.iterdir():
            ours = path.name.startswith(_TMP_PREFIX) and path.name.endswith(_TMP_SUFFIX)
            if ours or _SAFETENSORS_TMP.fullmatch(path.name):
                log.warning("removing %s, left by a save that did not finish", path)
                path.unlink(missing_ok=True)

    def unlock(self) -> None:
        """Releases the directory claimed by ``lock`` (also released when the process exits)."""
        if self._dir_lock is not None:
            os.close(self._dir_lock)
            self._dir_lock = None

    def paths(self) -> list[Path]:
        """Checkpoint files in the directory, newest (highest clock) first."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.iterdir():
            match = _NAME.fullmatch(path.name)
            if match:
                found.append((int(match[1]), path.name, path))
        return [path for _, _, path in sorted(found, reverse=True)]

    def save(self, state: ShardState, incarnation: str = "") -> Path:
        """Writes ``state`` as ``ckpt-<updates>.safetensors``, durably; returns its path.

        Raises:
            OSError: the file could not be written; any earlier checkpoint is untouched.
            ValueError: a slot holds a value that is neither an array nor a JSON number.
        """
        tensors, text = encode_state(state, incarnation)
        metadata = {_STATE_KEY: text, _DIGEST_KEY: digest(text, tensors)}
        final = self.directory / checkpoint_name(state.updates)
        with self._lock:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=_TMP_SUFFIX, dir=self.directory)
            os.close(fd)
            try:
                safetensors.numpy.save_file(tensors, tmp, metadata=metadata)
                _fsync(tmp, os.O_RDONLY)
                os.replace(tmp, final)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            # The rename is durable only once the directory entry is.
            _fsync(self.directory, os.O_RDONLY | os.O_DIRECTORY)
            self._prune(final)
        return final

    def set_aside(self) -> Path | None:
        """Moves every checkpoint file into a new subfolder ``before-fresh-<UTC time>`` (never
        deleting one), so the next start finds none and begins a new job; returns the
        subfolder, or None when there was nothing to move. Call with the directory locked."""
        found = self.paths()
        if not found:
            return None
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = self.directory / f"before-fresh-{stamp}"
        n = 1
        while aside.exists():
            n += 1
            aside = self.directory / f"before-fresh-{stamp}-{n}"
        aside.mkdir()
        for path in found:
            os.replace(path, aside / path.name)
        _fsync(aside, os.O_RDONLY | os.O_DIRECTORY)
        _fsync(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        return aside

    def load(self, path: str | Path) -> ShardState:
        """Reads and fully validates one checkpoint file.

        Raises:
            CorruptCheckpointError: unreadable, truncated, altered or inconsistent.
        """
        try:
            with safetensors.safe_open(str(path), framework="numpy") as f:
                metadata = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        except (OSError, safetensors.SafetensorError, ValueError) as exc:
            raise CorruptCheckpointError(f"{path}: unreadable safetensors file: {exc}") from exc
        text = metadata.get(_STATE_KEY)
        if text is None:
            raise CorruptCheckpointError(f"{path}: no {_STATE_KEY} entry in its header")
        if metadata.get(_DIGEST_KEY) != digest(text, tensors):
            raise CorruptCheckpointError(f"{path}: SHA-256 mismatch; the file was altered")
        try:
            return decode_state(text, tensors)
        except (KeyError, TypeError, ValueError, PSError) as exc:
            raise CorruptCheckpointError(f"{path}: inconsistent contents: {exc}") from exc

    def load_latest(self) -> ShardState | None:
        """The newest checkpoint that loads and validates; older ones cover for corrupt ones.

        Returns None when the directory holds no checkpoint file. Every file skipped is
        logged with the reason.

        Raises:
            CorruptCheckpointError: there are checkpoint files and none is valid. Starting
                empty instead would let worker 0's init restart a trained job from step 0,
                silently; the operator decides (moves the files aside to start fresh).
        """
        skipped: list[str] = []
        for path in self.paths():
            try:
                state = self.load(path)
            except CorruptCheckpointError as exc:
                log.error("skipping checkpoint: %s", exc)
                skipped.append(str(exc))
                continue
            log.info("loaded checkpoint %s (shard clock %d)", path, state.updates)
            return state
        if skipped:
            raise CorruptCheckpointError(
                f"{self.directory} holds {len(skipped)} checkpoint file(s) and none is valid "
                f"({'; '.join(skipped[:3])}); refusing to start empty, which would train the "
                "job again from its initial values. Restore a good copy, or move the files "
                "aside to start this shard fresh"
            )
        return None

    def _prune(self, just_saved: Path) -> None:
        """Keeps the file just written and the ``keep - 1`` newest others."""
        # The new file is kept even when an older run left higher-numbered (invalid or
        # foreign) files: those must not push the only good checkpoint out.
        others = [p for p in self.paths() if p != just_saved]
        for path in others[self.keep - 1 :]:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("could not remove old checkpoint %s: %s", path, exc)


def _fsync(path: str | Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointScheduler:
    """Saves a shard's state every N steps and/or S seconds, on demand, and when closing.

    ``export_state`` copies under the shard's lock; the file is written outside it, so
    training continues during the write; ``mark_checkpoint`` follows once the file is
    durable. One save runs at a time. A failed periodic save is logged and retried with
    backoff; it never stops the shard.
    """

    def __init__(
        self,
        shard: Shard,
        checkpointer: Checkpointer,
        every_steps: int = 0,
        every_secs: float = 0.0,
        poll_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if every_steps < 0 or every_secs < 0:
            raise ValueError(f"intervals must be >= 0, got {every_steps} steps, {every_secs}s")
        self.shard = shard
        # Workers registering hear that this shard checkpoints, so they keep their pushes
        # until a checkpoint holds them (for replay after a restart).
        shard.checkpointing = True
        # By steps: the shard copies its state at each multiple of every_steps, and this
        # writes the copy, so every shard of a job saves the same steps.
        shard.capture_every(every_steps)
        self.checkpointer = checkpointer
        self.every_steps = every_steps
        self.every_secs = every_secs
        self.poll_s = poll_s
        self._now = clock
        self._save_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_clock, self._last_sig = self._status_signature()
        self._last_time = clock()
        self._last_path: Path | None = None
        self._retry_at = 0.0
        self._backoff_s = 1.0

    def resume(self) -> ShardState | None:
        """Restores the shard from the newest valid checkpoint, if any (before serving).

        Raises:
            InvalidRequestError: the checkpoint's state does not fit a shard (never expected:
                loading validates it).
        """
        state = self.checkpointer.load_latest()
        if state is None:
            return None
        self.shard.restore(state)
        self._last_clock, self._last_sig = self._status_signature()
        self._last_time = self._now()
        return state

    def start(self) -> None:
        """Starts the periodic saves (a no-op when neither interval is set)."""
        if self._thread is None and (self.every_steps or self.every_secs):
            self._thread = threading.Thread(target=self._run, name="checkpoint", daemon=True)
            self._thread.start()

    def checkpoint(self) -> tuple[str, int]:
        """Saves now unless the newest checkpoint already holds the shard's state; returns
        (path, shard clock). For the Checkpoint RPC: workers whose replay logs fill together
        ask at once, and get one save.

        Raises:
            NotInitializedError: the shard holds no values yet.
            PSError: the file could not be written.
        """
        try:
            saved = self._save(force=False, level=logging.INFO, need_file=True)
            if saved is None and self._last_path is not None:
                return str(self._last_path), self._last_clock
        except OSError as exc:
            raise PSError(
                f"could not write a checkpoint in {self.checkpointer.directory}: {exc}"
            ) from exc
        if saved is None:
            raise NotInitializedError("this shard holds no values yet: nothing to checkpoint")
        return str(saved[0]), saved[1]

    def close(self, timeout: float = 60.0) -> Path | None:
        """Stops the periodic saves and saves a last time if anything changed since the last.

        Waits at most about ``timeout`` seconds for a save in progress; returns the final
        checkpoint's path, or None when nothing new needed saving or it failed (logged).
        """
        self._stop.set()
        deadline = time.monotonic() + timeout
        if self._thread is not None:
            self._thread.join(timeout)
        if not self._save_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            log.error("a checkpoint save still runs after %.0fs; no final checkpoint", timeout)
            return None
        self._save_lock.release()
        try:
            captured = self.shard.take_captured()  # a step multiple not written yet
            if captured is not None:
                self._save(force=False, level=logging.INFO, state=captured)
            saved = self._save(force=False, level=logging.INFO)
        except Exception:
            log.exception("final checkpoint failed; the previous one is kept")
            return None
        if saved is None:
            log.info("no final checkpoint needed: nothing changed since the last one")
            return None
        return saved[0]

    # -- internals --------------------------------------------------------------------------

    def _status_signature(self) -> tuple[int, tuple]:
        st = self.shard.status()
        sig = (st.initialized, st.clock, st.pushes_applied, st.pushes_duplicate, st.pushes_late)
        return st.clock, sig

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            now = self._now()
            if now < self._retry_at:
                continue
            try:
                captured = self.shard.take_captured()
                if captured is not None:
                    self._save(force=False, level=logging.DEBUG, state=captured)
                sig = self._status_signature()[1]
                secs_due = self.every_secs and now - self._last_time >= self.every_secs
                if sig != self._last_sig and secs_due:
                    self._save(force=False, level=logging.DEBUG)
                self._backoff_s = 1.0
            except Exception:
                log.exception("periodic checkpoint failed; retrying in %.0fs", self._backoff_s)
                self._retry_at = now + self._backoff_s
                self._backoff_s = min(60.0, self._backoff_s * 2)

    def _save(
        self, force: bool, level: int, need_file: bool = False, state: ShardState | None = None
    ) -> tuple[Path, int] | None:
        """Exports, writes and marks one checkpoint; None when there is nothing (new) to save
        (``need_file``: nor does this process need a first file: one was written). ``state``:
        one the shard copied at a step multiple, written unless a newer one was."""
        with self._save_lock:
            if state is not None:
                if self._last_path is not None and state.updates <= self._last_clock:
                    return None
                sig = (True, state.updates, *(state.counters.get(k, 0) for k in COUNTED))
                return self._write(state, sig, level)
            clock, sig = self._status_signature()
            if need_file and self._last_path is not None and clock == self._last_clock:
                # Asked for a file, and the newest holds this clock: in sync, pushes into the
                # open step since are not in any checkpoint, so a new one would be the same.
                return None
            first = need_file and self._last_path is None
            if not force and sig == self._last_sig and not first:
                return None
            state = self.shard.export_state()
            if state is None:
                return None
            return self._write(state, sig, level)

    def _write(self, state: ShardState, sig: tuple, level: int) -> tuple[Path, int]:
        """Writes and marks ``state`` (save lock held)."""
        started = time.monotonic()
        path = self.checkpointer.save(state, incarnation=self.shard.incarnation)
        self.shard.mark_checkpoint(state)
        # The signature read before the export may lag it; a save it missed is only late.
        self._last_clock, self._last_sig, self._last_time = state.updates, sig, self._now()
        self._last_path = path
        log.log(
            level,
            "checkpoint at shard clock %d written to %s in %.2fs",
            state.updates,
            path,
            time.monotonic() - started,
        )
        return path, state.updates
