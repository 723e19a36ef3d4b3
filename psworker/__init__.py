"""Client SDK: connect to parameter-server shards (or a ring of peers) and train through them."""

from pswire import __version__
from pswire.errors import (
    CallCancelledError,
    ClientClosedError,
    ConfigError,
    HyperParameterMismatchError,
    InvalidRequestError,
    ModelMismatchError,
    NotInitializedError,
    PSError,
    ShapeMismatchError,
    ShardBusyError,
    ShardRestartedError,
    TooLargeError,
    UnauthenticatedError,
    UnavailableError,
    UnknownVariableError,
    WaitTimeoutError,
)
from pswire.optim import SGD, Adagrad, Adam, AdamW, Optimizer, RMSprop, StepOptions
from pswire.tables import RowSparse, Table
from psworker.api import Client
from psworker.client import PSClient
from psworker.connect import connect
from psworker.data import shard
from psworker.local import LocalClient
from psworker.reports import report
from psworker.ring.client import AllReduceClient

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "AllReduceClient",
    "CallCancelledError",
    "Client",
    "ClientClosedError",
    "ConfigError",
    "DistributedOptimizer",
    "HyperParameterMismatchError",
    "InvalidRequestError",
    "LocalClient",
    "ModelMismatchError",
    "NotInitializedError",
    "Optimizer",
    "PSClient",
    "PSError",
    "RMSprop",
    "RowSparse",
    "ShapeMismatchError",
    "ShardBusyError",
    "ShardRestartedError",
    "StepOptions",
    "Table",
    "TooLargeError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnknownVariableError",
    "WaitTimeoutError",
    "__version__",
    "connect",
    "report",
    "shard",
]


def __getattr__(name: str) -> object:
    # psworker.DistributedOptimizer without importing torch for numpy-only users.
    if name == "DistributedOptimizer":
        from psworker.torch import DistributedOptimizer

        return DistributedOptimizer
    raise AttributeError(f"module 'psworker' has no attribute {name!r}")
