"""Client SDK: connect to parameter-server shards and train through them."""

from pswire.errors import (
    InvalidRequestError,
    ModelMismatchError,
    NotInitializedError,
    PSError,
    ShapeMismatchError,
    TooLargeError,
    UnavailableError,
    UnknownVariableError,
    WaitTimeoutError,
)
from pswire.optim import SGD, Adagrad, Adam, Optimizer
from psworker.client import PSClient, connect
from psworker.data import shard
from psworker.local import LocalClient

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "InvalidRequestError",
    "LocalClient",
    "ModelMismatchError",
    "NotInitializedError",
    "Optimizer",
    "PSClient",
    "PSError",
    "ShapeMismatchError",
    "TooLargeError",
    "UnavailableError",
    "UnknownVariableError",
    "WaitTimeoutError",
    "connect",
    "shard",
]
