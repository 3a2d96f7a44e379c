#!/usr/bin/env bash
# The whole test suite, from a fresh machine: setup, generated-code check, lint, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
tools/gen_proto.sh --check
.venv/bin/ruff check .
# Every package that has code yet (apply/ and controller/ fill in over the milestones).
mapfile -t typed < <(for d in discovery planner apply agent controller draw tests bench; do
  compgen -G "$d/*.py" >/dev/null && echo "$d"; done)
.venv/bin/mypy "${typed[@]}"
# Each synthesized host's host.py on its own: they share a module name, so not in one mypy run.
for host in tests/fixtures/*/host.py; do .venv/bin/mypy --no-error-summary "$host"; done
lab=../shared/lab/numa-vm
if [[ -x "$lab" && "${MEMTOPO_LAB:-1}" != 0 ]]; then
  # The lab boots a real multi-NUMA kernel under QEMU; its setup installs qemu/ndctl from Debian.
  "$lab" setup >/tmp/memtopo-lab-setup.log 2>&1 || { cat /tmp/memtopo-lab-setup.log; exit 1; }
  export MEMTOPO_LAB=1
fi
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
