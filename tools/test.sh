#!/usr/bin/env bash
# The whole test suite, from a fresh machine: setup, generated-code check, lint, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
tools/gen_proto.sh --check
.venv/bin/ruff check .
# memtopo/ links every floor beneath the one import name, so one run sees the whole package.
.venv/bin/mypy memtopo tests bench
# Each synthesized host's host.py on its own: they share a module name, so not in one mypy run.
for host in tests/fixtures/*/host.py; do .venv/bin/mypy --no-error-summary "$host"; done
. tools/lab_gate.sh
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
