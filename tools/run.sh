#!/usr/bin/env bash
# The main job: set up, then discover this host's memory topology.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec .venv/bin/memtopo topo "$@"
