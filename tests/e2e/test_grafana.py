"""deploy/'s Grafana: the Compose file provisions it beside Prometheus, and every query of
the dashboard (panels and annotations) names only metrics a live shard daemon exports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from e2e_support import REPO, Processes
from prometheus_client.parser import text_string_to_metric_families

import psworker
from psctl.admin import checkpoint_all

DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "psgrpc.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = DEPLOY / "grafana" / "provisioning" / "dashboards" / "psgrpc.yml"
COMPOSE = DEPLOY / "docker-compose.yml"

# PromQL words that are not metric names: functions, aggregations, modifiers, keywords.
PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "by", "without", "on", "ignoring", "group_left", "group_right",
    "and", "or", "unless", "bool", "offset", "rate", "irate", "increase", "changes", "delta",
    "idelta", "deriv", "histogram_quantile", "abs", "clamp_min", "clamp_max", "time", "vector",
    "scalar", "label_replace", "sort", "sort_desc", "inf", "nan",
}  # fmt: skip


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, expr) of every panel target and annotation."""
    found = [
        (f"panel {p['title']!r} target {t['refId']}", t["expr"])
        for p in dashboard["panels"]
        for t in p["targets"]
    ]
    found += [(f"annotation {a['name']!r}", a["expr"]) for a in dashboard["annotations"]["list"]]
    return found


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (label matchers, grouping labels, ranges,
    strings and function names left out)."""
    expr = re.sub(r'"[^"]*"', "", expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery durations
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    words = re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr)
    return {w for w in words if w not in PROMQL_WORDS}


def test_metric_names_reads_promql() -> None:
    expr = 'sum by (shard, code) (rate(psserver_rpcs_total{code!="OK"}[1m])) / max(up)'
    assert metric_names(expr) == {"psserver_rpcs_total", "up"}
    expr = "histogram_quantile(0.99, sum by (le) (rate(a_bucket[5m]))) > 0"
    assert metric_names(expr) == {"a_bucket"}


def exported_names(text: str) -> set[str]:
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.timeout(120)
def test_every_grafana_query_names_metrics_a_live_shard_exports(
    procs: Processes, tmp_path: Path
) -> None:
    daemon, port = procs.metered_psserver("--checkpoint-dir", str(tmp_path / "ckpt"))
    # A job that touches every family: a dense variable and a table pushed and pulled, a
    # checkpoint, and a worker leaving (a membership change).
    with psworker.connect([daemon.address], worker_id=0, num_workers=1, mode="sync") as client:
        client.init(
            {"w": np.zeros(4, np.float32)},
            psworker.SGD(lr=0.1),
            tables={"emb": psworker.Table(100, 2, capacity=0)},
        )
        rows = psworker.RowSparse(np.array([1, 5]), np.ones((2, 2), np.float32))
        for _ in range(2):
            client.push_pull({"w": np.ones(4, np.float32), "emb": rows}, rows={"emb": [1, 5]})
    checkpoint_all([daemon.address], timeout=30.0)  # as `psctl checkpoint`: saved on return
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        exported = exported_names(reply.read().decode())

    dashboard = json.loads(DASHBOARD.read_text())
    found = queries(dashboard)
    assert len(found) >= len(dashboard["panels"]) + 1  # every panel has a query, plus marks
    missing = {
        where: sorted(metric_names(expr) - exported)
        for where, expr in found
        if metric_names(expr) - exported
    }
    assert not missing, f"queries naming metrics the shard does not export: {missing}"
    # Every name exported as psserver_* is shown somewhere (no family forgotten) except the
    # information-only ones listed here.
    shown = set().union(*(metric_names(expr) for _, expr in found))
    unplotted = {
        "psserver_info", "psserver_initialized", "psserver_variables",
        "psserver_worker_heartbeat_age_seconds", "psserver_worker_live",
        "psserver_checkpoint_step", "psserver_table_bytes", "psserver_pushes", "psserver_pulls",
    }  # fmt: skip
    suffix = re.compile(r"_(bucket|sum|count|created|total)$")
    ours = {suffix.sub("", n) for n in exported if n.startswith("psserver_")}
    plotted = {suffix.sub("", n) for n in shown}
    assert ours - plotted - unplotted == set()


def test_grafana_provisioning_points_the_dashboard_at_compose_prometheus() -> None:
    datasource = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"
    dashboard = json.loads(DASHBOARD.read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    uids |= {p["datasource"]["uid"] for p in dashboard["panels"]}
    assert uids == {datasource["uid"]}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    provider = yaml.safe_load(PROVIDERS.read_text())["providers"][0]
    compose = yaml.safe_load(COMPOSE.read_text())
    grafana = compose["services"]["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"])
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    for local in mounts:
        assert (DEPLOY / local).is_dir(), local
    assert grafana["profiles"] == compose["services"]["prometheus"]["profiles"]


@pytest.mark.timeout(60)
def test_docker_compose_accepts_the_grafana_service() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (scripts/dev.sh test installs it)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PS_")}
    result = subprocess.run(
        [binary, "-f", str(COMPOSE), "--profile", "metrics", "config"],
        capture_output=True,
        text=True,
        timeout=50,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert services["grafana"]["depends_on"] and "prometheus" in services
    volumes = services["grafana"]["volumes"]
    targets = {v["target"] if isinstance(v, dict) else v.split(":")[1] for v in volumes}
    assert {"/etc/grafana/provisioning", "/var/lib/grafana/dashboards"} <= targets
