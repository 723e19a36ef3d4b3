"""The cluster description: TensorFlow's TF_CONFIG format, from a flag, a file or the env."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ClusterSpec:
    """``{"cluster": {"ps": [...], "worker": [...]}, "task": {"type": ..., "index": i}}``."""

    ps: tuple[str, ...]
    workers: tuple[str, ...]
    task_type: str
    task_index: int

    @classmethod
    def parse(cls, text: str) -> ClusterSpec:
        """Parses TF_CONFIG JSON.

        Raises:
            ValueError: not JSON, or lacking the cluster/task fields.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"cluster spec is not valid JSON: {exc}") from exc
        if not isinstance(data, dict) or not isinstance(data.get("cluster"), dict):
            raise ValueError('cluster spec needs a "cluster" object with "ps" and "worker" lists')
        cluster = data["cluster"]
        task = data.get("task") or {}
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
    def load(cls, source: str | None = None) -> ClusterSpec | None:
        """From ``source`` (JSON text or a file path), else ``$TF_CONFIG``; None if neither.

        Raises:
            ValueError: the source is unreadable or malformed.
        """
        text = source if source is not None else os.environ.get("TF_CONFIG")
        if not text:
            return None
        stripped = text.strip()
        if not stripped.startswith("{"):
            path = Path(stripped)
            if not path.is_file():
                raise ValueError(f"cluster spec {stripped!r} is neither JSON nor a readable file")
            stripped = path.read_text()
        return cls.parse(stripped)

    def to_json(self) -> str:
        return json.dumps(
            {
                "cluster": {"ps": list(self.ps), "worker": list(self.workers)},
                "task": {"type": self.task_type, "index": self.task_index},
            }
        )
