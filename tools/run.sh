#!/usr/bin/env bash
# The main job: set up, then run the agent against this host with the reference controller embedded
# on loopback (no config file needed). Arguments are `memtopo serve`'s (e.g. --health 127.0.0.1:19464
# --with-controller 127.0.0.1:19470); once it serves, the agent prints what to try, at the addresses
# it bound. Stop it with Ctrl-C (SIGTERM/SIGINT: graceful).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
# A later --with-controller ADDR in "$@" takes the place of this one (argparse: the last one wins).
exec .venv/bin/memtopo serve --with-controller "$@"
