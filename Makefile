# One gate: `make check` (format, lint, types, stale protos, tests). .ci/run calls it via scripts/dev.sh.
PY ?= python
PROTO_SRC := protos/pswire/proto/ps.proto

.PHONY: check fmt lint types test protos check-protos bench images mutate docs docs-build
check: fmt-check lint types check-protos docs-build test

fmt-check:
	$(PY) -m ruff format --check .
fmt:
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .
lint:
	$(PY) -m ruff check .
types:
	$(PY) -m mypy
# Two pytest processes (pytest-xdist), each test file whole on one: every test owns its ports
# and folders, and one process keeps under one core busy (waits: heartbeats, pauses), so two
# on the 2-core machine take 11 minutes instead of 19. `PYTEST_JOBS=0` runs it in one process.
PYTEST_JOBS ?= 2
test:
	$(PY) -m pytest -q --durations=25 -n $(PYTEST_JOBS) --dist loadfile
protos:
	bash scripts/gen_protos.sh .
check-protos:
	bash scripts/check_protos.sh
bench:
	$(PY) -m bench

# The documentation site (mkdocs.yml, docs/): built into build/site with --strict, so a broken
# link, a missing reference or a docstring mkdocstrings cannot read fails it; `docs` then runs
# every runnable code block of docs/ (tests/e2e/test_docs_snippets.py, also part of `test`).
docs-build:
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir build/site
docs: docs-build
	$(PY) -m pytest -q tests/e2e/test_docs_snippets.py
# Build deploy/'s images with podman/buildah and run the Compose cluster in them (root; see
# scripts/images.sh). tests/e2e/test_images.py (marked slow: 3-6 minutes cold) runs it with
# `pytest -m slow tests/e2e/test_images.py`.
images:
	PY=$(PY) bash scripts/images.sh

# Mutation testing of the core (scripts/mutate.toml): slow, so never part of `check`.
# Writes build/mutate/report.md; fails under 90% of mutants caught, or on a survivor with no
# reason in scripts/mutate.toml. MUTATE_ARGS="optim codec".
mutate:
	$(PY) scripts/mutate.py $(MUTATE_ARGS)
