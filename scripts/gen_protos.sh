#!/usr/bin/env bash
# Generate pswire/proto/*_pb2.py, *_pb2_grpc.py and .pyi stubs from protos/ into the folder $1.
set -euo pipefail
out=${1:-.}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out/pswire/proto"
python -m grpc_tools.protoc -I"$here/protos" \
  --python_out="$out" --grpc_python_out="$out" --mypy_out="$out" --mypy_grpc_out="$out" \
  "$here"/protos/pswire/proto/*.proto
