"""The exception family both ends raise, each tied to one gRPC status code by name."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar


class PSError(Exception):
    """Base of every error this project raises on purpose.

    ``status`` is the name of the gRPC status code the error travels as; ``code`` gives the
    ``grpc.StatusCode`` itself (grpc is imported lazily so plain-Python modules stay grpc-free).
    """

    status: ClassVar[str] = "INTERNAL"

    @property
    def code(self) -> Any:
        import grpc

        return grpc.StatusCode[self.status]


class UnknownVariableError(PSError):
    """Raised when a request names a variable or table the model (or shard) does not hold."""

    status = "NOT_FOUND"


class InvalidRequestError(PSError):
    """Raised when a request is malformed: wrong dtype or byte count, non-finite values, bad
    row ids, a malformed chunk stream, an argument out of range."""

    status = "INVALID_ARGUMENT"


class ShapeMismatchError(InvalidRequestError):
    """Raised when a tensor's shape differs from the variable's (both shapes named)."""


class ModelMismatchError(PSError):
    """Raised when a worker's job (model, mode, optimizer, worker count) differs from the one
    the shard holds; the message lists the differences."""

    status = "FAILED_PRECONDITION"


class HyperParameterMismatchError(ModelMismatchError):
    """Raised when the pushes of one sync step carry different optimizer hyper-parameters
    (workers on different learning-rate schedules), or all-reduce ranks would apply different
    optimizer settings; the message names the workers or ranks, the group and the values."""


class NotInitializedError(PSError):
    """Raised when a call needs a job (or a checkpoint directory) the shard does not have yet."""

    status = "FAILED_PRECONDITION"


class TooLargeError(PSError):
    """Raised when a request is over one of the shard's limits (bytes, variables, workers)."""

    status = "RESOURCE_EXHAUSTED"


class WaitTimeoutError(PSError):
    """Raised when a wait (sync barrier, ssp gate, initial values, a ring receive, a step's
    reply) ran out of time; the message says what it waited for."""

    status = "DEADLINE_EXCEEDED"


class UnavailableError(PSError):
    """Raised when a shard or peer stayed unreachable, or restarted without the state to go on."""

    status = "UNAVAILABLE"


class ShardRestartedError(PSError):
    """Raised when the shard is not the one the worker last saw (it restarted): the worker
    re-registers and replays its pushes."""

    status = "ABORTED"


class UnauthenticatedError(PSError):
    """Raised when a call carries no token, or the wrong one."""

    status = "UNAUTHENTICATED"


class CallCancelledError(PSError):
    """Raised when the caller cancelled the call (or went away) before it finished."""

    status = "CANCELLED"


class ShardBusyError(TooLargeError):
    """Raised when a shard already serves as many calls that can wait or stream as its
    --threads allow (it keeps the rest for status and health)."""


class DuplicateWorkerError(PSError):
    """Raised when a second live client process claims a worker id another process holds."""

    status = "ALREADY_EXISTS"


class StepRefusedError(PSError):
    """Raised when a shard refused a step it could not apply (e.g. the averaged gradient or
    the optimizer's result is not finite): its weights stay as before that step, and every
    later step fails the same way until the job is restarted (from a checkpoint)."""

    status = "FAILED_PRECONDITION"


class WorkerDroppedError(PSError):
    """Raised on a worker whose sync push arrived after its step closed without it (it was
    dropped from the quorum, silent past the heartbeat timeout): training on would silently
    leave its gradients out of the model."""

    status = "FAILED_PRECONDITION"


class CorruptCheckpointError(PSError, ValueError):
    """Raised when a checkpoint file is truncated, altered, or does not describe a
    consistent shard (the shard then tries the next older one)."""

    status = "DATA_LOSS"


class ConfigError(PSError, ValueError):
    """Raised when a client or daemon is configured wrongly (an unknown mode, a missing TLS
    file, a malformed cluster spec or address); a ``ValueError`` too, as before."""

    status = "INVALID_ARGUMENT"


class ClientClosedError(PSError, RuntimeError):
    """Raised when a client is used after ``close()`` (or after leaving its ``with`` block)."""

    status = "FAILED_PRECONDITION"


def not_in_model(name: str, known: Iterable[str], kind: str = "variable") -> UnknownVariableError:
    """The error for a name the model lacks, naming some of those it has."""
    shown = sorted(known)
    more = ", ..." if len(shown) > 20 else ""
    return UnknownVariableError(
        f"{kind} '{name}' is not in the model; it has: {', '.join(shown[:20])}{more}"
    )


# Client side: a status code coming back maps to the most specific class raised for it.
_BY_STATUS: dict[str, type[PSError]] = {
    "NOT_FOUND": UnknownVariableError,
    "INVALID_ARGUMENT": InvalidRequestError,
    "FAILED_PRECONDITION": ModelMismatchError,
    "RESOURCE_EXHAUSTED": TooLargeError,
    "DEADLINE_EXCEEDED": WaitTimeoutError,
    "UNAVAILABLE": UnavailableError,
    "ABORTED": ShardRestartedError,
    "UNAUTHENTICATED": UnauthenticatedError,
    "CANCELLED": CallCancelledError,
    "DATA_LOSS": CorruptCheckpointError,
    "ALREADY_EXISTS": DuplicateWorkerError,
}


# Trailing metadata key naming the PSError class a server raised, where one status code stands
# for several (FAILED_PRECONDITION: ModelMismatchError or NotInitializedError).
ERROR_CLASS_KEY = "ps-error"


def _subclasses(cls: type[PSError]) -> list[type[PSError]]:
    return [cls, *(s for sub in cls.__subclasses__() for s in _subclasses(sub))]


def error_for_status(status: str, message: str, class_name: str = "") -> PSError:
    """Builds the exception a status code name stands for, carrying the server's message.

    ``class_name``: the class the server raised (``ERROR_CLASS_KEY`` metadata); used when it
    is a PSError subclass of that same status, else the status's usual class.
    """
    named = {c.__name__: c for c in _subclasses(PSError)}.get(class_name)
    cls = named if named is not None and named.status == status else _BY_STATUS.get(status, PSError)
    err = cls(message)
    if cls is PSError:
        # Keep the real code (e.g. UNIMPLEMENTED) on a plain PSError.
        err.status = status  # type: ignore[misc]
    return err
