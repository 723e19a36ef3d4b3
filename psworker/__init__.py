"""Client SDK: connect to parameter-server shards (or a ring of peers) and train through them."""

from pscore.optim import (
    SGD,
    Adadelta,
    Adagrad,
    Adam,
    Adamax,
    AdamW,
    NAdam,
    Optimizer,
    RAdam,
    RMSprop,
)
from pscore.optspec import StepOptions
from pscore.tables import RowSparse, Table
from pswire import __version__
from pswire.errors import (
    CallCancelledError,
    ClientClosedError,
    ConfigError,
    CorruptCheckpointError,
    DuplicateWorkerError,
    HyperParameterMismatchError,
    InvalidRequestError,
    ModelMismatchError,
    NotInitializedError,
    PSError,
    ShapeMismatchError,
    ShardBusyError,
    ShardRestartedError,
    StepRefusedError,
    TooLargeError,
    UnauthenticatedError,
    UnavailableError,
    UnknownVariableError,
    WaitTimeoutError,
    WorkerDroppedError,
)
from psworker.api import Client
from psworker.client import PSClient
from psworker.connect import connect
from psworker.data import shard, start_epoch
from psworker.elastic import ElasticPSClient
from psworker.local import LocalClient
from psworker.reports import report
from psworker.ring.client import AllReduceClient
from psworker.seeding import seed, worker_seed
from psworker.settings import ClientSettings

__all__ = [
    "SGD",
    "Adadelta",
    "Adagrad",
    "Adam",
    "AdamW",
    "Adamax",
    "AllReduceClient",
    "CallCancelledError",
    "Client",
    "ClientClosedError",
    "ClientSettings",
    "ConfigError",
    "CorruptCheckpointError",
    "DistributedOptimizer",
    "DuplicateWorkerError",
    "ElasticPSClient",
    "Embedding",
    "EmbeddingBag",
    "HyperParameterMismatchError",
    "InvalidRequestError",
    "LocalClient",
    "ModelMismatchError",
    "NAdam",
    "NotInitializedError",
    "Optimizer",
    "PSClient",
    "PSError",
    "RAdam",
    "RMSprop",
    "RowSparse",
    "ShapeMismatchError",
    "ShardBusyError",
    "ShardRestartedError",
    "StepOptions",
    "StepRefusedError",
    "Table",
    "TooLargeError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnknownVariableError",
    "WaitTimeoutError",
    "WorkerDroppedError",
    "__version__",
    "connect",
    "report",
    "seed",
    "shard",
    "start_epoch",
    "worker_seed",
]


# The torch-facing names, imported on first use: a numpy-only user never imports torch.
_TORCH_NAMES = {
    "DistributedOptimizer": "psworker.torch",
    "Embedding": "psworker.torch_tables",
    "EmbeddingBag": "psworker.torch_tables",
}


def __getattr__(name: str) -> object:
    module = _TORCH_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'psworker' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
