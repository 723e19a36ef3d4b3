"""The README's command lines work as written in a new shell after its set-up: every line of its
``bash`` blocks runs in a fresh ``env -i bash -lc`` shell that has only run the README's
activation line (the new user's first day: no inherited PATH, no PS_* variables). A line that
needs a cluster, Slurm or Kubernetes runs a stand-in named here with its reason; a README line
this file does not know fails the test, so a new line gets checked too."""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import pytest
from e2e_support import Processes, wait_port_file

REPO = Path(__file__).resolve().parents[2]
ACTIVATE = "source .venv/bin/activate"
SLOW = pytest.mark.slow

# README line -> (what runs in the fresh shell, why it differs from the line, marks).
# "{tmp}" is the test's own folder.
CHECKS: dict[str, tuple[str, str, tuple[pytest.MarkDecorator, ...]]] = {
    "bash scripts/dev.sh demo": (
        "bash scripts/dev.sh demo --epochs 1 --out {tmp}/demo",
        "one epoch, into the test's own folder (out/demo is the user's)",
        (SLOW,),  # about 20 s on 2 busy cores
    ),
    "bash scripts/dev.sh test": (
        "bash scripts/dev.sh shell make --version",
        "the gate itself (this test runs inside it): its set-up and make only",
        (),
    ),
    ACTIVATE: (
        "command -v psctl psserver psworker python && psctl --help && psserver --help "
        "&& psworker run --help",
        "",
        (),
    ),
    "psctl local --servers 2 --workers 2 -- python examples/train_digits.py": (
        "",
        "",
        (SLOW,),  # as written: 2 shards, 2 workers, the digits example (about 30 s)
    ),
    "psctl local --workers 2 --mode allreduce -- python examples/train_digits.py": (
        "",
        "",
        (SLOW,),  # as written: about 30 s
    ),
}


def readme_lines() -> list[str]:
    """Every command of the README's ``bash`` blocks, continuation lines joined, comments
    dropped."""
    text = (REPO / "README.md").read_text()
    lines: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", "", block)
        for raw in joined.splitlines():
            line = re.sub(r"\s+#.*$", "", raw).strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def fresh_shell(command: str, tmp: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``command`` in a login shell with an empty environment (HOME is the test's folder) after
    the README's activation line, from the repository's folder."""
    script = f"cd {REPO} && {ACTIVATE} && {command}"
    return subprocess.run(
        ["env", "-i", f"HOME={tmp}", "bash", "-lc", script],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def needs_the_readme_venv() -> None:
    if not (REPO / ".venv" / "bin" / "activate").is_file():
        pytest.skip("no .venv in the repository (the README's set-up makes one)")


def test_every_readme_command_line_is_checked_here() -> None:
    found = readme_lines()
    assert ACTIVATE in found, "the README's set-up must say how the commands get on PATH"
    unknown = [line for line in found if line not in CHECKS]
    assert not unknown, f"README command lines with no check in {__file__}: {unknown}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "line",
    [pytest.param(line, marks=CHECKS[line][2], id=line[:40]) for line in readme_lines()],
)
def test_a_readme_line_runs_in_a_fresh_shell(line: str, tmp_path: Path) -> None:
    needs_the_readme_venv()
    if line not in CHECKS:
        pytest.fail(f"no check for README line {line!r}")
    stand_in, reason, _ = CHECKS[line]
    if reason and not stand_in:
        pytest.skip(reason)
    done = fresh_shell((stand_in or line).format(tmp=tmp_path), tmp_path, timeout=200)
    assert done.returncode == 0, (
        f"{line!r} ({reason or 'as written'}):\n{done.stdout}\n{done.stderr}"
    )


@pytest.mark.timeout(60)
def test_psserver_serves_from_a_fresh_shell(procs: Processes, tmp_path: Path) -> None:
    # The shard daemon itself, as a user starts one: port 0, the port in a file.
    needs_the_readme_venv()
    port_file = tmp_path / "port"
    serve = f"exec psserver --host 127.0.0.1 --port 0 --port-file {port_file}"
    script = f"cd {REPO} && {ACTIVATE} && {serve}"
    proc = procs.start(["env", "-i", f"HOME={tmp_path}", "bash", "-lc", script])
    assert wait_port_file(proc, port_file, 30) > 0
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "psserver listening on 127.0.0.1" in out, out


def test_the_set_up_says_how_to_get_the_commands(tmp_path: Path) -> None:
    # dev.sh's demo tells a user whose PATH lacks the venv what to run in a new shell.
    needs_the_readme_venv()
    done = subprocess.run(
        ["env", "-i", f"HOME={tmp_path}", "PATH=/usr/bin:/bin", "bash", "-c",
         f"cd {REPO} && bash scripts/dev.sh demo --help"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"'source {REPO}/.venv/bin/activate' puts them on PATH" in done.stderr
