"""deploy/: the Compose files and Kubernetes manifests validate, and the Compose cluster trains."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from compose_netns import (
    ComposeHosts,
    command_of,
    dependency_order,
    dockerfile_env,
    environment_of,
    interpolate,
    load_compose,
    namespaces_unavailable,
)
from e2e_support import REPO, Processes, child_env, free_port

from pswire.cluster import ClusterSpec

DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
COMPOSE_TLS = DEPLOY / "docker-compose.tls.yml"
K8S = DEPLOY / "k8s"
# The oldest Kubernetes the manifests promise to work on (the pod-index label is 1.28+, with a
# hostname fallback before that); validated against the newest bundled schemas too.
K8S_VERSIONS = ("1.28.0", "1.37.0")
OUR_IMAGES = ("psgrpc-server", "psgrpc-worker")


def _ours(service: dict[str, Any]) -> bool:
    return str(service.get("image", "")).split(":")[0].rsplit("/", 1)[-1] in OUR_IMAGES


# -- Compose ---------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "files", [[COMPOSE], [COMPOSE, COMPOSE_TLS]], ids=["compose", "compose+tls"]
)
def test_docker_compose_accepts_the_files(files: list[Path]) -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip(
            "docker-compose is not installed (Debian: apt-get install -y --no-install-recommends "
            "docker-compose); it validates the files without a Docker engine"
        )
    args = [binary, *(arg for f in files for arg in ("-f", str(f))), "config"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PS_")}
    result = subprocess.run(args, capture_output=True, text=True, timeout=50, env=env)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert {"ps0", "ps1", "worker0", "worker1", "prometheus"} <= set(config["services"])
    if COMPOSE_TLS in files:
        assert config["services"]["ps0"]["environment"]["PS_TLS_CA"] == "/certs/ca.pem"
        assert "certs" in config["services"]["worker1"]["depends_on"]


def test_compose_cluster_is_consistent() -> None:
    """Every TF_CONFIG describes the same cluster, names its own service, and every shard's
    metrics port is a Prometheus target: mistakes `docker-compose config` cannot see."""
    compose = load_compose(COMPOSE, {})
    services = compose["services"]
    specs = {}
    for name, service in services.items():
        if not _ours(service):
            continue
        env = environment_of(service)
        assert all(k.startswith("PS_") or k == "TF_CONFIG" for k in env), env
        specs[name] = ClusterSpec.parse(env["TF_CONFIG"])
    clusters = {(s.ps, s.workers) for s in specs.values()}
    assert len(clusters) == 1, clusters
    ps, workers = clusters.pop()
    assert (len(ps), len(workers)) == (2, 2)
    for name, spec in specs.items():
        listed = ps if spec.task_type == "ps" else workers
        assert listed[spec.task_index].split(":")[0] == name
    assert {s.task_type for s in specs.values()} == {"ps", "worker"}
    for name, spec in specs.items():
        env = environment_of(services[name])
        if spec.task_type == "worker":
            assert env["PS_MODE"] == "sync"
            assert {"ps0", "ps1"} <= set(services[name]["depends_on"])
        else:
            # Each shard its own checkpoint folder on the named volume.
            assert env["PS_CHECKPOINT_DIR"] == f"/data/checkpoints/{name}"
            assert "checkpoints:/data/checkpoints" in services[name]["volumes"]
    assert {"checkpoints", "demo-out"} <= set(compose["volumes"])

    prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for c in job["static_configs"]
               for t in c["targets"]}  # fmt: skip
    expected = {
        f"{name}:{environment_of(services[name])['PS_METRICS_PORT']}"
        for name, spec in specs.items()
        if spec.task_type == "ps"
    }
    assert targets == expected


def test_compose_interpolation_matches_compose_rules() -> None:
    variables = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${UNSET:-d} ${EMPTY-d} $SET $$SET", variables) == (
        "x d d  x $SET"
    )
    assert interpolate(["${UNSET}", {"k": "${SET}"}], variables) == ["", {"k": "x"}]


def test_compose_dependencies_put_shards_first() -> None:
    services = load_compose(COMPOSE, {})["services"]
    order = dependency_order(services)
    assert order.index("ps0") < order.index("worker0")
    assert order.index("ps1") < order.index("worker1")
    # The command is written out, so `docker compose up` needs no other source of truth.
    worker = ["python", "-m", "psworker", "run", "psctl.demo:main"]
    assert command_of(services["worker0"])[:5] == worker


# -- Kubernetes ------------------------------------------------------------------------------


def _k8s_documents() -> Iterator[tuple[str, dict[str, Any]]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            if doc is not None:
                yield name, doc


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(on_disk)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_manifests_match_their_schemas(version: str) -> None:
    kv = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate (a dev dependency) is not installed"
    )
    kinds = []
    for name, doc in _k8s_documents():
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{name} ({doc.get('kind')}) is invalid for Kubernetes {version}: {exc}")
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["ConfigMap", "Job", "Service", "Service", "StatefulSet"]


def test_kubernetes_cluster_spec_matches_the_workloads(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _k8s_documents()}
    config = docs["ConfigMap", "psgrpc-cluster"]["data"]
    shards = docs["StatefulSet", "ps"]
    job = docs["Job", "worker"]
    for key in ("PS_TASK_INDEX", "JOB_COMPLETION_INDEX"):
        monkeypatch.delenv(key, raising=False)
    # A shard pod: the StatefulSet ordinal in its hostname names its task.
    monkeypatch.setattr("socket.gethostname", lambda: "ps-1")
    spec = ClusterSpec.parse(config["TF_CONFIG"], role="ps")
    assert (spec.task_type, spec.task_index) == ("ps", 1)
    assert len(spec.ps) == shards["spec"]["replicas"]
    assert len(spec.workers) == job["spec"]["completions"] == job["spec"]["parallelism"]
    assert job["spec"]["completionMode"] == "Indexed"
    # The addresses are the pods' DNS names under the headless Services.
    service = shards["spec"]["serviceName"]
    assert docs["Service", service]["spec"]["clusterIP"] == "None"
    assert list(spec.ps) == [f"ps-{i}.{service}:7000" for i in range(len(spec.ps))]
    subdomain = job["spec"]["template"]["spec"]["subdomain"]
    assert docs["Service", subdomain]["spec"]["clusterIP"] == "None"
    assert list(spec.workers) == [f"worker-{i}.{subdomain}:7000" for i in range(2)]
    # A worker pod: the Indexed Job's completion index names its task.
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")
    spec = ClusterSpec.parse(config["TF_CONFIG"], role="worker")
    assert (spec.task_type, spec.task_index) == ("worker", 1)
    # Checkpoints on a per-shard claim; scrape annotations on the pods.
    template = shards["spec"]["template"]
    assert shards["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "checkpoints"
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0]["env"]}
    port = template["metadata"]["annotations"]["prometheus.io/port"]
    assert env["PS_METRICS_PORT"] == port


# -- where the shards listen ---------------------------------------------------------------


def test_every_deployed_shard_names_the_host_it_serves() -> None:
    """psserver without --host/PS_HOST and with neither TLS nor a token serves 127.0.0.1 only:
    every deployment whose workers reach the shards from other hosts names 0.0.0.0."""
    wildcard = "0.0.0.0"
    # The image: any orchestrator running it unchanged (TFJob, plain docker run).
    assert dockerfile_env(DEPLOY / "Dockerfile.server")["PS_HOST"] == wildcard
    for files in ([COMPOSE], [COMPOSE, COMPOSE_TLS]):
        # Compose merges an overlay's environment into the base's, key by key.
        shards = {
            name: environment_of(service)
            for name, service in load_compose(COMPOSE, {})["services"].items()
            if "command" in service and "psserver" in command_of(service)  # not Grafana's
        }
        for path in files[1:]:
            for name, service in load_compose(path, {})["services"].items():
                if name in shards:
                    shards[name].update(environment_of(service))
        assert sorted(shards) == ["ps0", "ps1"]
        for name, env in shards.items():
            assert env.get("PS_HOST") == wildcard, (files, name)
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _k8s_documents()}
    (container,) = docs["StatefulSet", "ps"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PS_HOST"] == wildcard
    launches = [
        line
        for line in (DEPLOY / "slurm" / "train.sbatch").read_text().splitlines()
        if "-m psserver " in line and "healthcheck" not in line
    ]
    assert launches and all(f"--host {wildcard}" in line for line in launches), launches


# -- the Compose cluster, without Docker -----------------------------------------------------


@pytest.fixture
def compose_hosts(tmp_path: Path) -> Iterator[ComposeHosts]:
    reason = namespaces_unavailable()
    if reason is not None:
        pytest.skip(f"cannot run the Compose services on their own hosts: {reason}")
    pytest.importorskip("sklearn", reason="the demo's digits come from scikit-learn")
    base_env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        # The images install the project; here it is imported from the checkout.
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",
    }
    # One epoch keeps the test short; the file's default is the full demo.
    hosts = ComposeHosts(COMPOSE, tmp_path, {"PS_DEMO_EPOCHS": "1"}, base_env)
    try:
        yield hosts
    finally:
        hosts.close()


@pytest.mark.timeout(300)
def test_compose_services_train_the_demo_on_their_own_hosts(compose_hosts: ComposeHosts) -> None:
    hosts = compose_hosts
    hosts.up_network()
    ours = [name for name in dependency_order(hosts.services) if _ours(hosts.services[name])]
    assert ours[:2] == ["ps0", "ps1"] and sorted(ours[2:]) == ["worker0", "worker1"]
    for name in ours:
        hosts.start(name)
        if "healthcheck" in hosts.services[name]:
            # depends_on: condition: service_healthy, as Compose waits.
            hosts.wait_healthy(name, timeout=90)

    for name in ("worker0", "worker1"):
        proc = hosts.hosts[name].proc
        assert proc is not None
        try:
            code = proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} did not finish:\n{hosts.hosts[name].output()}")
        assert code == 0, hosts.hosts[name].output()
    assert "held-out accuracy" in hosts.hosts["worker0"].output()
    results = json.loads((hosts.work / "volumes" / "demo-out" / "metrics.json").read_text())
    assert (results["mode"], results["workers"]) == ("sync", 2)

    # The Prometheus host reaches every target of prometheus.yml by service name.
    prometheus = hosts.hosts["prometheus"]
    scrape = (
        "import sys, urllib.request\n"
        "for target in sys.argv[1:]:\n"
        "    body = urllib.request.urlopen(f'http://{target}/metrics', timeout=10).read()\n"
        "    print(target, body.decode().count('psserver_push_bytes_total{'))\n"
    )
    result = prometheus.run([sys.executable, "-c", scrape, "ps0:9100", "ps1:9100"], 60)
    assert result.returncode == 0, result.stderr
    for line in result.stdout.splitlines():
        assert int(line.split()[1]) >= 1, result.stdout  # each shard counted pushed bytes

    # psctl status from a worker's host, by service name, with every shard's clocks.
    status = (
        "from psctl import status_view\n"
        "addresses = ['ps0:7000', 'ps1:7000']\n"
        "health, statuses = status_view.gather(addresses, 10.0)\n"
        "print(status_view.render_table(addresses, statuses, health))\n"
    )
    result = hosts.hosts["worker0"].run([sys.executable, "-c", status], 60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("SERVING") == 2, result.stdout

    # SIGTERM: each shard saves a final checkpoint on the volume and exits 0.
    for name in ("ps0", "ps1"):
        proc = hosts.hosts[name].proc
        assert proc is not None
        proc.terminate()
        assert proc.wait(timeout=30) == 0, hosts.hosts[name].output()
        saved = list((hosts.work / "volumes" / "checkpoints" / name).glob("ckpt-*"))
        assert saved, hosts.hosts[name].output()
        # PS_LOG_FORMAT=json: every log line is one JSON object.
        lines = hosts.hosts[name].output().splitlines()
        assert lines and all(json.loads(line)["level"] for line in lines)


# -- what the images run ---------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_daemon_metrics_json_logs_and_the_images_healthcheck(procs: Processes) -> None:
    daemon, metrics_port = procs.metered_psserver("--log-format", "json")
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    # Unnamed and outside a cluster, the shard label is the address it serves.
    assert f'psserver_initialized{{shard="127.0.0.1:{daemon.port}"}} 0.0' in text

    # The HEALTHCHECK finds the port the way the daemon does (here PS_PORT), and fails on a
    # port nothing serves.
    probe = [sys.executable, "-m", "psserver.healthcheck"]
    code, out = procs.run(probe, timeout=30, env=child_env(PS_PORT=str(daemon.port)))
    assert (code, out.strip()) == (0, f"127.0.0.1:{daemon.port}: SERVING")
    code, out = procs.run([*probe, f"127.0.0.1:{free_port()}", "--timeout", "1"], timeout=30)
    assert code == 1, out

    daemon.proc.send_signal(signal.SIGTERM)
    out, _ = daemon.proc.communicate(timeout=15)
    assert daemon.proc.returncode == 0, out
    records = [json.loads(line) for line in out.splitlines()]
    messages = [r["message"] for r in records]
    assert f"metrics at http://127.0.0.1:{metrics_port}/metrics" in messages
    assert "psserver stopped" in messages
