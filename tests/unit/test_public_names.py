"""What a user imports from ``psworker``: every error a call can raise, and the torch modules
(loaded only when asked for, so a numpy-only user never imports torch)."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import psworker
from pswire import errors

REPO = Path(__file__).resolve().parents[2]


def test_every_error_a_user_can_receive_is_exported_from_psworker() -> None:
    # Private subclasses (a module's own ConfigError) reach users as their public parent.
    family = [c for c in errors._subclasses(errors.PSError) if not c.__name__.startswith("_")]
    assert len(family) > 15  # the whole family was found, not just its root
    missing = [c.__name__ for c in family if getattr(psworker, c.__name__, None) is not c]
    assert not missing, f"not exported from psworker: {missing}"
    unlisted = [c.__name__ for c in family if c.__name__ not in psworker.__all__]
    assert not unlisted, f"exported but not in psworker.__all__: {unlisted}"


def test_an_error_class_defined_in_any_client_module_is_exported_too() -> None:
    # Every module a client call runs through imported first: a PSError subclass defined
    # outside pswire/errors.py (say in a link or session module) is seen as well.
    for package in ("pswire", "psworker"):
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            if not info.name.endswith("__main__"):  # running it is the command itself
                importlib.import_module(info.name)
    family = [c for c in errors._subclasses(errors.PSError) if not c.__name__.startswith("_")]
    assert errors.StepRefusedError in family and errors.DuplicateWorkerError in family
    missing = [
        f"{c.__module__}.{c.__name__}"
        for c in family
        if getattr(psworker, c.__name__, None) is not c
    ]
    assert not missing, f"not exported from psworker: {missing}"
    assert psworker.ClientSettings.__module__ == "psworker.settings"
    assert {"ClientSettings", "ElasticPSClient"} <= set(psworker.__all__)


def test_every_name_in_all_resolves() -> None:
    unresolved = [name for name in psworker.__all__ if not hasattr(psworker, name)]
    assert not unresolved


def test_torch_names_are_exported_and_load_torch_only_when_asked_for() -> None:
    # A child process: whether torch is imported depends on what ran before in this one.
    code = (
        "import sys, psworker\n"
        "before = 'torch' in sys.modules\n"
        "from psworker import Embedding, EmbeddingBag, DistributedOptimizer\n"
        "from psworker.torch_tables import Embedding as E, EmbeddingBag as B\n"
        "from psworker.torch import DistributedOptimizer as D\n"
        "print(before, 'torch' in sys.modules, Embedding is E, EmbeddingBag is B,"
        " DistributedOptimizer is D)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "True", "True", "True"]


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchThing"):
        _ = psworker.NoSuchThing  # type: ignore[attr-defined]
