#!/usr/bin/env bash
# Regenerates memtopo/v1/*_pb2*.py(i), memtopo/k8s/api/podresources/v1/ (memtopo's schema of the kubelet's PodResources API)
# and memtopo/k8s/api/cri/v1/ (memtopo's schema of the container runtime's CRI runtime.v1 API)
# from proto/. CI runs it with --check.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
export PATH="$(dirname "$py"):$PATH"
outs=(memtopo/v1 memtopo/k8s/api/podresources/v1 memtopo/k8s/api/cri/v1)
# quiet: mypy-protobuf otherwise prints a "Writing mypy to" line per stub, on every --check too.
gen() {
  local dest=$1 out
  for out in "${outs[@]}"; do
    "$py" -m grpc_tools.protoc -I proto \
      --python_out="$dest" --mypy_out=quiet:"$dest" --mypy_grpc_out=quiet:"$dest" --grpc_python_out="$dest" \
      "proto/$out"/*.proto
  done
}
if [[ "${1:-}" == "--check" ]]; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  gen "$tmp"
  for out in "${outs[@]}"; do
    diff -r -x __init__.py -x __pycache__ "$tmp/$out" "$out" >/dev/null \
      || { echo "generated protobuf code is stale: run tools/gen_proto.sh" >&2; diff -r -x __init__.py -x __pycache__ "$tmp/$out" "$out" | head -20 >&2; exit 1; }
  done
  echo "generated protobuf code is up to date"
else
  gen .
fi
