#!/usr/bin/env bash
# The main job: set up, then run the agent against this host with the reference controller embedded
# on loopback (no config file needed). Stop it with Ctrl-C (SIGTERM/SIGINT: graceful).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
cat >&2 <<'TXT'
memtopo: starting the agent + reference controller (127.0.0.1:9470). In another shell:
  .venv/bin/memtopo query topology          # the topology over the agent's Unix socket
  .venv/bin/memtopo query topology --addr unix:///run/memtopo/agent-read.sock   # the readers' socket
  .venv/bin/memtopo query watch             # snapshot, then each new generation (kill -HUP the agent to rescan)
  .venv/bin/memtopo query health            # grpc.health.v1
  .venv/bin/memtopo controller nodes        # what the controller holds
  curl -s 127.0.0.1:9464/readyz; curl -s 127.0.0.1:9464/metrics
  open http://127.0.0.1:9471/ in a browser: the controller's fleet page
TXT
exec .venv/bin/memtopo serve --with-controller "$@"
