"""The cluster description: TensorFlow's TF_CONFIG format, from a flag, a file or the env."""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pswire.errors import ConfigError

# A StatefulSet pod's hostname is "<set name>-<ordinal>".
_ORDINAL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?-(?P<ordinal>\d+)$")


def task_index_from_env(
    environ: Mapping[str, str] | None = None, hostname: str | None = None
) -> int | None:
    """This pod's task index: ``$PS_TASK_INDEX``, else ``$JOB_COMPLETION_INDEX`` (a Kubernetes
    Indexed Job sets it), else the ordinal ending a StatefulSet pod's hostname (``ps-1`` -> 1);
    None when none of them says.

    Raises:
        ConfigError: a variable is set but is not a non-negative integer.
    """
    env = os.environ if environ is None else environ
    for name in ("PS_TASK_INDEX", "JOB_COMPLETION_INDEX"):
        text = env.get(name, "").strip()
        if text:
            if not text.isdigit():
                raise ConfigError(f"${name}={text!r} is not a task index (a number >= 0)")
            return int(text)
    match = _ORDINAL.match(socket.gethostname() if hostname is None else hostname)
    return int(match["ordinal"]) if match else None


@dataclass(frozen=True)
class ClusterSpec:
    """``{"cluster": {"ps": [...], "worker": [...]}, "task": {"type": ..., "index": i}}``."""

    ps: tuple[str, ...]
    workers: tuple[str, ...]
    task_type: str
    task_index: int

    @classmethod
    def parse(cls, text: str, role: str | None = None) -> ClusterSpec:
        """Parses TF_CONFIG JSON.

        A spec without a ``task`` (one spec shared by every pod, as in Kubernetes) names this
        process by ``role`` (``"ps"`` or ``"worker"``) and ``task_index_from_env()``; without
        ``role`` a missing task means worker 0, as before.

        Raises:
            ConfigError: not JSON, lacking the cluster/task fields, or no task and no task
                index in the environment while ``role`` is given.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"cluster spec is not valid JSON: {exc}") from exc
        if not isinstance(data, dict) or not isinstance(data.get("cluster"), dict):
            raise ConfigError('cluster spec needs a "cluster" object with "ps" and "worker" lists')
        cluster = data["cluster"]
        task = data.get("task") or {}
        if not task and role is not None:
            index = task_index_from_env()
            if index is None:
                raise ConfigError(
                    "the cluster spec names no task, and neither $PS_TASK_INDEX, "
                    "$JOB_COMPLETION_INDEX nor a StatefulSet hostname (name-N) gives this "
                    f"{role}'s index"
                )
            task = {"type": role, "index": index}
        ps = tuple(str(a) for a in cluster.get("ps", []))
        # A TF "chief" is worker 0 here; plain workers follow it.
        chief = [str(a) for a in cluster.get("chief", [])]
        workers = tuple(chief + [str(a) for a in cluster.get("worker", [])])
        task_type = str(task.get("type", "worker"))
        index = int(task.get("index", 0))
        if task_type == "chief":
            task_type = "worker"
        elif task_type == "worker":
            index += len(chief)
        return cls(ps, workers, task_type, index)

    @classmethod
    def load(cls, source: str | None = None, role: str | None = None) -> ClusterSpec | None:
        """From ``source`` (JSON text or a file path), else ``$TF_CONFIG``; None if neither.

        ``role`` names this process when the spec has no task (see ``parse``).

        Raises:
            ConfigError: the source is unreadable or malformed.
        """
        text = source if source is not None else os.environ.get("TF_CONFIG")
        if not text:
            return None
        stripped = text.strip()
        if not stripped.startswith("{"):
            path = Path(stripped)
            if not path.is_file():
                raise ConfigError(f"cluster spec {stripped!r} is neither JSON nor a readable file")
            stripped = path.read_text()
        return cls.parse(stripped, role)

    def to_json(self) -> str:
        return json.dumps(
            {
                "cluster": {"ps": list(self.ps), "worker": list(self.workers)},
                "task": {"type": self.task_type, "index": self.task_index},
            }
        )
