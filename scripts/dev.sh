#!/usr/bin/env bash
# Set-up and entry point: creates/reuses .venv, installs the project, then runs a job.
#   bash scripts/dev.sh demo [psctl demo flags]   # the main job: a local cluster trains a model
#   bash scripts/dev.sh test                      # the whole gate: format, lint, types, protos, tests
#   bash scripts/dev.sh bench | shell CMD...
# PS_PYTHON picks the interpreter (default python3.11); PS_TORCH_SPEC the torch requirement
# (default torch==2.13.0, the CPU wheel; e.g. "torch --index-url ..." for CUDA; "none" to skip).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PS_PYTHON:-python3.11}
command -v "$py" >/dev/null || py=python3
venv=${PS_VENV:-$root/.venv}
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
stamp="$venv/.psgrpc-installed"
want=$(cat pyproject.toml; echo "${PS_TORCH_SPEC:-torch==2.13.0}")
want=$(printf '%s' "$want" | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$venv/bin/python" -m pip install -q --upgrade pip
  spec=${PS_TORCH_SPEC:-torch==2.13.0}
  if [ "$spec" != "none" ] && ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pip install -q $spec
  fi
  "$venv/bin/python" -m pip install -q -e '.[dev,demo,docs]'
  echo "$want" >"$stamp"
fi
if [ "${1:-test}" = demo ] && [[ ":$PATH:" != *":$venv/bin:"* ]]; then
  echo "dev.sh: psctl, psserver and psworker are in $venv/bin; in a new shell," \
    "'source $venv/bin/activate' puts them on PATH" >&2
fi
export PATH="$venv/bin:$PATH"
cmd=${1:-test}
shift || true
case "$cmd" in
  demo) exec psctl demo "$@" ;;
  test)
    # Debian's docker-compose validates deploy/*.yml without a Docker engine
    # (tests/e2e/test_deploy.py); installed when we may, else that one test skips.
    if ! command -v docker-compose >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
          --no-install-recommends docker-compose >/dev/null; } ||
        echo "docker-compose unavailable: the Compose validation test will skip" >&2
    fi
    # Debian's chromium: the dashboard's screenshot test opens the page in it headless
    # (tests/e2e/test_dashboard.py); installed when we may, else that test skips.
    if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
          --no-install-recommends chromium >/dev/null; } ||
        echo "chromium unavailable: the dashboard screenshot test will skip" >&2
    fi
    exec make check PY="$venv/bin/python" ;;
  bench) exec "$venv/bin/python" -m bench "$@" ;;
  shell) exec "$@" ;;
  *) echo "usage: scripts/dev.sh demo|test|bench|shell CMD..." >&2; exit 2 ;;
esac
