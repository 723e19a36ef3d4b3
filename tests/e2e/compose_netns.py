"""Runs a Compose file's services without Docker: each one a process on its own network host.

Every service gets a network namespace with its own address on a private bridge, and an
``/etc/netns/<ns>/hosts`` (which ``ip netns exec`` mounts over ``/etc/hosts``) naming every
service, so ``ps0:7000`` in a TF_CONFIG reaches the ps0 process as it would in Compose. The
bridge has no address on this host and the namespaces no other route: nothing they send can
leave them. A service's process gets what a container would: the ``ENV`` lines of its
Dockerfile, then its Compose ``environment``, with ``${VAR:-default}`` interpolated as Compose
does; named volumes become folders, and paths under a volume's mount point in the command or
environment are rewritten to that folder (the one liberty taken: there is no image filesystem).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# RFC 2544's benchmarking range: addresses for test hosts, never routed anywhere. They live
# only inside the namespaces made here.
SUBNET = "198.18.{net}.{host}"
_INTERPOLATION = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<sep>:?-)(?P<default>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(value: Any, variables: Mapping[str, str]) -> Any:
    """Compose's variable substitution over strings in ``value`` (lists and dicts walked):
    ``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-default}`` (unset or empty), ``${VAR-default}``."""
    if isinstance(value, str):

        def one(match: re.Match[str]) -> str:
            if match["escaped"]:
                return "$"
            name = match["braced"] or match["named"]
            current = variables.get(name)
            if match["sep"] == ":-" and not current:
                return str(match["default"])
            if match["sep"] == "-" and current is None:
                return str(match["default"])
            return current or ""

        return _INTERPOLATION.sub(one, value)
    if isinstance(value, list):
        return [interpolate(v, variables) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, variables) for k, v in value.items()}
    return value


def load_compose(path: Path, variables: Mapping[str, str]) -> dict[str, Any]:
    """The Compose file at ``path`` (YAML anchors and merge keys resolved), interpolated."""
    data = yaml.safe_load(path.read_text())
    data = {k: v for k, v in data.items() if not str(k).startswith("x-")}
    return dict(interpolate(data, variables))


def environment_of(service: Mapping[str, Any]) -> dict[str, str]:
    """A service's ``environment`` (mapping or ``KEY=VALUE`` list) as strings."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def command_of(service: Mapping[str, Any]) -> list[str]:
    """A service's ``command``; a string is split as Compose splits it (shell words)."""
    command = service.get("command")
    if command is None:
        raise ValueError("service has no command: the test needs it written in the file")
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def dockerfile_env(dockerfile: Path) -> dict[str, str]:
    """The ``ENV`` settings of the final stage of ``dockerfile``."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    env: dict[str, str] = {}
    for line in text.splitlines():
        words = line.strip().split(None, 1)
        if not words:
            continue
        if words[0].upper() == "FROM":
            env = {}  # a new stage starts clean
        elif words[0].upper() == "ENV" and len(words) == 2:
            for item in shlex.split(words[1]):
                key, sep, value = item.partition("=")
                if sep:
                    env[key] = value
    return env


def volume_mounts(service: Mapping[str, Any]) -> dict[str, str]:
    """Named volumes a service mounts: mount point -> volume name (bind mounts left out)."""
    mounts = {}
    for spec in service.get("volumes") or []:
        if isinstance(spec, dict):
            source, target = str(spec.get("source", "")), str(spec["target"])
        else:
            source, target = str(spec).split(":")[:2]
        if source and not source.startswith((".", "/", "~")):
            mounts[target] = source
    return mounts


def dependency_order(services: Mapping[str, Any]) -> list[str]:
    """Service names so that each comes after what it ``depends_on``.

    Raises:
        ValueError: a dependency cycle or an unknown dependency.
    """
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting or name not in services:
            raise ValueError(f"depends_on: cycle or unknown service at {name!r}")
        visiting.add(name)
        for dep in services[name].get("depends_on") or []:
            visit(dep)
        visiting.discard(name)
        order.append(name)

    for name in services:
        visit(name)
    return order


def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if sys.platform != "linux":
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"psprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    """One service's network host and, once started, its process."""

    service: str
    netns: str
    address: str
    env: dict[str, str]
    command: list[str]
    cwd: Path
    proc: subprocess.Popen[str] | None = None
    log: Path | None = None

    def run(self, args: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
        """Runs ``args`` inside this host with its environment, to completion."""
        return subprocess.run(
            ["ip", "netns", "exec", self.netns, *args],
            env=self.env,
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log and self.log.exists() else ""


@dataclass
class ComposeHosts:
    """The namespaces, bridge and processes of one Compose project; ``close`` removes them."""

    compose_file: Path
    work: Path
    variables: dict[str, str]
    base_env: dict[str, str]
    python: str = sys.executable
    prefix: str = field(default_factory=lambda: f"psc{secrets.token_hex(3)}")
    hosts: dict[str, Host] = field(default_factory=dict)
    services: dict[str, Any] = field(default_factory=dict)
    _bridge: str | None = None
    _netns: list[str] = field(default_factory=list)

    def up_network(self) -> None:
        """Creates the bridge and one namespace per service, with the hosts file."""
        data = load_compose(self.compose_file, self.variables)
        self.services = data["services"]
        volumes = self.work / "volumes"
        net = secrets.randbelow(250) + 1
        self._bridge = f"{self.prefix}br"
        _ip("link", "add", self._bridge, "type", "bridge")
        _ip("link", "set", self._bridge, "up")
        addresses = {
            name: SUBNET.format(net=net, host=i + 2) for i, name in enumerate(self.services)
        }
        hosts_file = "127.0.0.1 localhost\n::1 localhost\n" + "".join(
            f"{addr} {name}\n" for name, addr in addresses.items()
        )
        for i, (name, service) in enumerate(self.services.items()):
            netns = f"{self.prefix}-{name}"
            outside, inside = f"{self.prefix}h{i}", f"{self.prefix}c{i}"
            _ip("netns", "add", netns)
            self._netns.append(netns)
            etc = Path("/etc/netns") / netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside, "netns", netns)
            _ip("link", "set", outside, "master", self._bridge, "up")
            _ip("-n", netns, "addr", "add", f"{addresses[name]}/24", "dev", inside)
            _ip("-n", netns, "link", "set", inside, "up")
            _ip("-n", netns, "link", "set", "lo", "up")
            self.hosts[name] = self._host(name, service, netns, addresses[name], volumes)

    def _host(
        self, name: str, service: Mapping[str, Any], netns: str, address: str, volumes: Path
    ) -> Host:
        mounts = {target: volumes / volume for target, volume in volume_mounts(service).items()}
        for folder in mounts.values():
            folder.mkdir(parents=True, exist_ok=True)

        def local(value: str) -> str:
            for target in sorted(mounts, key=len, reverse=True):
                if value == target or value.startswith(target.rstrip("/") + "/"):
                    return str(mounts[target]) + value[len(target.rstrip("/")) :]
            return value

        build = service.get("build")
        image_env = {}
        if isinstance(build, dict):
            context = (self.compose_file.parent / build.get("context", ".")).resolve()
            image_env = dockerfile_env(context / build.get("dockerfile", "Dockerfile"))
        env = {**self.base_env, **image_env, **environment_of(service)}
        env = {k: local(v) for k, v in env.items()}
        command = [local(word) for word in command_of(service)] if build else []
        if command[:1] == ["python"]:
            command[0] = self.python  # the image's interpreter is this test's
        cwd = self.work / "home" / name
        cwd.mkdir(parents=True, exist_ok=True)
        env["HOME"] = str(cwd)
        return Host(name, netns, address, env, command, cwd)

    def start(self, name: str) -> Host:
        """Starts service ``name``'s command inside its namespace, output to a log file."""
        host = self.hosts[name]
        host.log = self.work / f"{name}.log"
        with host.log.open("w") as log:
            host.proc = subprocess.Popen(
                ["ip", "netns", "exec", host.netns, *host.command],
                env=host.env,
                cwd=host.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
            )
        return host

    def wait_healthy(self, name: str, timeout: float) -> None:
        """Runs the service's Compose ``healthcheck`` test in its host until it passes.

        Raises:
            AssertionError: the process died, or the check never passed within ``timeout``.
        """
        host = self.hosts[name]
        test = list(self.services[name]["healthcheck"]["test"])
        assert test[0] in ("CMD", "CMD-SHELL"), test
        args = test[1:] if test[0] == "CMD" else ["sh", "-c", test[1]]
        if args[:1] == ["python"]:
            args[0] = self.python
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if host.proc is not None and host.proc.poll() is not None:
                raise AssertionError(f"{name} exited with {host.proc.returncode}:\n{host.output()}")
            result = host.run(args, timeout=max(1.0, deadline - time.monotonic()))
            if result.returncode == 0:
                return
            last = result.stdout + result.stderr
            # The probe itself waits up to its --timeout for an answer; no extra sleep needed
            # unless it failed fast (connection refused while the daemon imports).
            time.sleep(0.2)
        raise AssertionError(f"{name} never healthy in {timeout}s: {last}\n{host.output()}")

    def close(self) -> None:
        """Stops every process still running, then removes namespaces, bridge and files."""
        for host in self.hosts.values():
            if host.proc is not None and host.proc.poll() is None:
                host.proc.send_signal(signal.SIGTERM)
        for host in self.hosts.values():
            if host.proc is not None:
                try:
                    host.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    host.proc.kill()
                    host.proc.wait(timeout=10)
        for netns in self._netns:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / netns, ignore_errors=True)
        if self._bridge is not None:
            subprocess.run(["ip", "link", "del", self._bridge], capture_output=True)
        with contextlib.suppress(OSError):
            Path("/etc/netns").rmdir()  # only if empty: another user's files stay
