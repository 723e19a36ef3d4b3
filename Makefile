# One gate: `make check` (format, lint, types, stale protos, tests). .ci/run calls it via scripts/dev.sh.
PY ?= python
PROTO_SRC := protos/pswire/proto/ps.proto

.PHONY: check fmt lint types test protos check-protos bench mutate
check: fmt-check lint types check-protos test

fmt-check:
	$(PY) -m ruff format --check .
fmt:
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .
lint:
	$(PY) -m ruff check .
types:
	$(PY) -m mypy
test:
	$(PY) -m pytest -q
protos:
	bash scripts/gen_protos.sh .
check-protos:
	bash scripts/check_protos.sh
bench:
	$(PY) -m bench
# Mutation testing of the core (scripts/mutate.toml): slow, so never part of `check`.
# Writes build/mutate/report.md; fails under 90% of mutants caught. MUTATE_ARGS="optim codec".
mutate:
	$(PY) scripts/mutate.py $(MUTATE_ARGS)
