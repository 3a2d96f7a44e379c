#!/usr/bin/env bash
# The whole test suite, from a fresh machine: setup, generated-code check, lint, types, tests.
# The checks that need nothing from each other run at the same time: the generated-code check, ruff
# and mypy beside pytest, which itself runs on every core (pytest-xdist; the numa-vm lab's tests on
# one worker, one boot at a time; `bash tools/test.sh -n 4` asks for 4 workers). Each step's time is
# printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=()
timed() { # NAME CMD...: run CMD, record how long it took
  local t0=$SECONDS rc=0
  "${@:2}" || rc=$?
  steps+=("$1 $((SECONDS - t0)) s")
  return "$rc"
}
timed setup bash tools/setup.sh
timed lab-setup . tools/lab_gate.sh
# Bytecode for the checkout once, before anything starts Python: every test process (and the lab's
# guests, which read this checkout) would otherwise compile the same modules again, since a
# PYTHONDONTWRITEBYTECODE environment keeps each from saving what it compiled.
timed bytecode .venv/bin/python -m compileall -q -j 0 memtopo discovery planner apply agent controller extender fleetpage \
  cli draw k8s \
  tests bench >/dev/null

static=$(mktemp); trap 'rm -f "$static"' EXIT
static_checks() {
  tools/gen_proto.sh --check
  .venv/bin/ruff check .
  # memtopo/ links every floor beneath the one import name, so one run sees the whole package.
  .venv/bin/mypy memtopo tests bench
  # Each synthesized host's host.py on its own: they share a module name, so not in one mypy run.
  for host in tests/fixtures/*/host.py; do .venv/bin/mypy --no-error-summary "$host"; done
}
# One worker per core; with the lab, one more: its worker mostly waits while QEMU runs the guest.
workers=$(nproc)
[[ "${MEMTOPO_LAB:-}" == 1 ]] && workers=$((workers + 1))
t0=$SECONDS
static_checks >"$static" 2>&1 &
static_pid=$!
pytest_rc=0
timed pytest .venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadgroup \
  --durations=20 "$@" || pytest_rc=$?
static_rc=0
wait "$static_pid" || static_rc=$?
steps+=("static-checks $((SECONDS - t0)) s (beside pytest)")
echo "---- generated code, ruff, mypy"
cat "$static"
printf 'tools/test.sh: %s\n' "${steps[@]}"
if (( static_rc )); then echo "tools/test.sh: the generated-code check, ruff or mypy failed (above)" >&2; fi
exit $(( pytest_rc ? pytest_rc : static_rc ))
