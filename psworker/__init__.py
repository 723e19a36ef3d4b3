"""Client SDK: connect to parameter-server shards and train through them."""

from pswire.errors import (
    InvalidRequestError,
    ModelMismatchError,
    NotInitializedError,
    PSError,
    ShapeMismatchError,
    ShardRestartedError,
    TooLargeError,
    UnauthenticatedError,
    UnavailableError,
    UnknownVariableError,
    WaitTimeoutError,
)
from pswire.optim import SGD, Adagrad, Adam, Optimizer
from pswire.tables import RowSparse, Table
from psworker.client import PSClient
from psworker.connect import connect
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
    "RowSparse",
    "ShapeMismatchError",
    "ShardRestartedError",
    "Table",
    "TooLargeError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnknownVariableError",
    "WaitTimeoutError",
    "connect",
    "shard",
]


def __getattr__(name: str) -> object:
    # psworker.DistributedOptimizer without importing torch for numpy-only users.
    if name == "DistributedOptimizer":
        from psworker.torch import DistributedOptimizer

        return DistributedOptimizer
    raise AttributeError(f"module 'psworker' has no attribute {name!r}")
