"""What the docs tell a reader holds: they cite only what the reader can see, and name what
the reader needs (the demo's model class, which Compose works)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The README and the documentation site's pages (docs/), where most of the README moved.
README = "\n".join(
    p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
)


def test_benchmarks_doc_cites_no_issue_numbers_or_private_files() -> None:
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert not re.search(r"\bissues? #?\d", text, re.I)
    assert "/tmp/" not in text
    # Every repository file it names exists.
    for path in set(re.findall(r"\b((?:bench|docs|psctl|psworker|psserver)/[\w./-]+\.\w+)", text)):
        assert (ROOT / path).exists(), path


def test_readme_names_the_class_model_pt_loads_into() -> None:
    assert "psctl.demo.DigitsCNN" in README
    source = (ROOT / "psctl" / "demo.py").read_text()
    assert re.search(r"^class DigitsCNN\(nn\.Module\):", source, re.M)


def test_readme_says_a_shard_keeps_its_first_job_until_restarted() -> None:
    assert "A shard keeps its first job" in README and "until it is restarted" in README


def test_compose_versions_are_named() -> None:
    deploy = (ROOT / "deploy" / "README.md").read_text()
    assert "Compose v2" in deploy and "1.29 or newer" in deploy
    assert "Compose v2" in README
