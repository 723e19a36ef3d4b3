#!/usr/bin/env bash
# Fail when the committed generated code differs from what protos/ generates now.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
bash "$here/scripts/gen_protos.sh" "$tmp"
for f in "$tmp"/pswire/proto/*; do
  name=$(basename "$f")
  if ! diff -q "$f" "$here/pswire/proto/$name" >/dev/null 2>&1; then
    echo "stale generated code: pswire/proto/$name differs from protos/; run 'make protos'" >&2
    exit 1
  fi
done
echo "generated code is up to date"
