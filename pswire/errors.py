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
    status = "NOT_FOUND"


class InvalidRequestError(PSError):
    """Wrong shape, dtype, byte count, non-finite values, malformed chunk streams."""

    status = "INVALID_ARGUMENT"


class ShapeMismatchError(InvalidRequestError):
    pass


class ModelMismatchError(PSError):
    """The job (model, mode, optimizer, worker count) differs from what the shard holds."""

    status = "FAILED_PRECONDITION"


class NotInitializedError(PSError):
    status = "FAILED_PRECONDITION"


class TooLargeError(PSError):
    status = "RESOURCE_EXHAUSTED"


class WaitTimeoutError(PSError):
    """A consistency wait (sync barrier, ssp gate, initial values) ran out of time."""

    status = "DEADLINE_EXCEEDED"


class UnavailableError(PSError):
    status = "UNAVAILABLE"


class ShardRestartedError(PSError):
    """The shard is not the one the worker last saw (it restarted): re-register, replay."""

    status = "ABORTED"


class UnauthenticatedError(PSError):
    status = "UNAUTHENTICATED"


class CancelledError(PSError):
    status = "CANCELLED"


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
    "CANCELLED": CancelledError,
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
