#!/usr/bin/env bash
# Regenerates memtopo/v1/*_pb2*.py(i) from proto/. CI runs it with --check.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
export PATH="$(dirname "$py"):$PATH"
out=memtopo/v1
gen() {
  local dest=$1
  "$py" -m grpc_tools.protoc -I proto \
    --python_out="$dest" --mypy_out="$dest" --mypy_grpc_out="$dest" --grpc_python_out="$dest" \
    proto/memtopo/v1/*.proto
}
if [[ "${1:-}" == "--check" ]]; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  gen "$tmp"
  diff -r -x __init__.py -x __pycache__ "$tmp/memtopo/v1" "$out" >/dev/null \
    || { echo "generated protobuf code is stale: run tools/gen_proto.sh" >&2; diff -r -x __init__.py -x __pycache__ "$tmp/memtopo/v1" "$out" | head -20 >&2; exit 1; }
  echo "generated protobuf code is up to date"
else
  gen .
fi
