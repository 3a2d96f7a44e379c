#!/usr/bin/env bash
# Every benchmark in bench/, quickly (short repeat counts), then one table of every target:
# bench, target, figure, limit, PASS/FAIL (bench/report.py writes the rows). Exit 1 on any FAIL.
#
#   bash tools/bench.sh [NAME ...]     # NAME: apply, cli, discovery, ... (default: all of them)
#
# The figures move with the machine's load (its average is printed with each bench's verdict);
# the targets are ratios against a baseline of the same run where that can be had. The lab's
# migration benchmark (bench/apply.py --lab) needs the numa-vm lab and is not run here.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || bash tools/setup.sh >/dev/null

# name | command line (the short counts; each bench's --help names its options)
BENCHES=(
  "apply|bench/apply.py --repeat 10"
  "cli|bench/cli.py --repeat 5"
  "discovery|bench/discovery.py --repeat 5"
  "extender|bench/extender.py --iterations 20 --memory-nodes 2000"
  "fleet|bench/fleet.py"
  "footprint|bench/footprint.py --idle-seconds 10"
  "hostile_clients health|bench/hostile_clients.py health --probes 100"
  "hostile_clients watchers|bench/hostile_clients.py watchers --settle 5"
  "hostile_clients http|bench/hostile_clients.py http --impls memtopo aiohttp --probes 100"
  "hostile_roots|bench/hostile_roots.py"
  "planner|bench/planner.py --repeat 5"
  "rpc|bench/rpc.py --repeat 3 --seconds 0.5"
  "svg|bench/svg.py --repeat 3"
  "watch|bench/watch.py --changes 100"
)

summary=$(mktemp)
trap 'rm -f "$summary"' EXIT
export MEMTOPO_BENCH_SUMMARY="$summary"
failed=0
for entry in "${BENCHES[@]}"; do
  name=${entry%%|*}
  cmd=${entry#*|}
  if [ $# -gt 0 ]; then
    wanted=0
    for w in "$@"; do [ "$w" = "${name%% *}" ] || [ "$w" = "$name" ] && wanted=1; done
    [ $wanted = 1 ] || continue
  fi
  echo "== $name: $cmd"
  # shellcheck disable=SC2086  # the command line is split into its words on purpose
  if ! $PY $cmd; then
    failed=1
    grep -q "^${name%% *}" "$summary" || printf '%s\t%s\t-\t%s\tFAIL\n' "$name" "the run" "it exited before judging" >>"$summary"
  fi
done

echo
echo "== summary (load average now $(cut -d' ' -f1-3 /proc/loadavg) on $(nproc) CPUs)"
{ printf 'bench\ttarget\tfigure\tlimit\tverdict\n'; cat "$summary"; } | column -t -s $'\t'
if [ $failed = 0 ] && ! grep -q $'\tFAIL$' "$summary"; then
  echo "all targets met"
  exit 0
fi
echo "$(grep -c $'\tFAIL$' "$summary") target(s) failed"
exit 1
