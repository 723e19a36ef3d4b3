"""deploy/'s images, built and run for real: scripts/images.sh with podman and buildah as root."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from e2e_support import REPO

SCRIPT = REPO / "scripts" / "images.sh"
DEPLOY = REPO / "deploy"
# Commands the script needs; it installs their Debian packages when missing (apt-get).
TOOLS = ("podman", "buildah", "runc", "debootstrap", "iptables")
# Settings of the machine the script may need; every other PS_* variable stays out, so the
# files' defaults (CPU torch, both clusters, the accuracy bar) are what is tested.
MACHINE_SETTINGS = ("PS_IMAGES_CACHE", "PS_IMAGES_MIRROR", "PS_IMAGES_NOFILE", "PS_IMAGES_NPROC")


def _dockerfile_arg(name: str, arg: str) -> str:
    text = (DEPLOY / name).read_text()
    match = re.search(rf'^ARG {arg}="?([^"\n]*)"?$', text, re.M)
    assert match, f"{name} has no ARG {arg} with a default"
    return match.group(1)


# -- the files, without building --------------------------------------------------------------


@pytest.mark.parametrize("name", ["Dockerfile.server", "Dockerfile.worker"])
def test_dockerfiles_take_their_base_and_copy_the_context_whole(name: str) -> None:
    text = (DEPLOY / name).read_text()
    assert _dockerfile_arg(name, "PYTHON_IMAGE") == "python:3.11-slim"
    assert text.count("FROM ${PYTHON_IMAGE}") == 2
    # pyproject.toml picks the packages: no Dockerfile change when one is added or moved.
    assert "COPY . ." in text
    assert not re.search(r"^COPY (pswire|psserver|psworker|psctl)\b", text, re.M)


def test_the_worker_image_defaults_to_the_cpu_torch_build_everywhere() -> None:
    default = _dockerfile_arg("Dockerfile.worker", "TORCH_SPEC")
    assert re.fullmatch(
        r"torch==[\d.]+ --index-url https://download\.pytorch\.org/whl/cpu", default
    )
    for name in ("docker-compose.yml", "docker-compose.tls.yml"):
        text = (DEPLOY / name).read_text()
        specs = re.findall(r"TORCH_SPEC: \"\$\{PS_TORCH_SPEC:-([^}]*)\}\"", text)
        assert specs and set(specs) == {default}, (name, specs)


def test_the_cluster_starts_without_docker_hub() -> None:
    services = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    default = {name for name, s in services.items() if not s.get("profiles")}
    assert default == {"ps0", "ps1", "worker0", "worker1"}
    # Only Prometheus comes from a registry, and only with `--profile metrics`.
    assert services["prometheus"]["profiles"] == ["metrics"]


def test_the_build_context_leaves_out_what_the_wheel_does_not_need() -> None:
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".git", "tests", "bench", "examples", "*.log"} <= ignored
    assert not {"pyproject.toml", "README.md", "pswire", "psserver", "psworker"} & ignored


# -- the images, built and run ---------------------------------------------------------------


def _why_not_here() -> str | None:
    if sys.platform != "linux":
        return "podman and buildah run containers on Linux only"
    if os.geteuid() != 0:
        return "scripts/images.sh needs root (rootful podman and buildah, a bridge network)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing and shutil.which("apt-get") is None:
        return f"{', '.join(missing)} not installed and no apt-get to install them"
    made = subprocess.run(
        ["unshare", "--mount", "--net", "--pid", "--fork", "true"], capture_output=True, timeout=30
    )
    if made.returncode != 0:
        return f"cannot make namespaces here for containers: {made.stderr.decode().strip()}"
    return None


# Cold (tools, base and images to make) 3-6 minutes on 2 cores (330 s in a clean clone's CI
# run: a third of the whole suite), warm well under one; the script bounds each step itself and
# waits up to 15 minutes for another run's lock. Slow, so `make images` (or `pytest -m slow
# tests/e2e/test_images.py`) runs it, not the default gate.
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_images_build_and_the_compose_clusters_train_in_containers() -> None:
    reason = _why_not_here()
    if reason is not None:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PS_") and k != "TF_CONFIG"}
    env.update({k: os.environ[k] for k in MACHINE_SETTINGS if k in os.environ})
    env["PY"] = sys.executable
    result = subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-8000:]

    assert "(torch.version.cuda is None)" in out, out
    assert "images: server image: no torch" in out, out
    assert re.search(r"^images: shard health from the host \(.*\): SERVING$", out, re.M), out
    accuracies = dict(
        re.findall(
            r"^images: accuracy (compose(?:\+tls)?): worker0=([\d.]+) over 2 workers", out, re.M
        )
    )
    assert set(accuracies) == {"compose", "compose+tls"}, out
    assert all(float(acc) >= 0.95 for acc in accuracies.values()), accuracies
    # The overlay's shards really serve mutual TLS (their own log line says so).
    assert re.search(r"compose\+tls: ps0 healthy \(listening on .*mutual TLS", out), out
    assert "teardown done" in out.splitlines()[-1], out
