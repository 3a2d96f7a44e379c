#!/usr/bin/env bash
# Sourced by tools/test.sh: when the numa-vm lab is in the shared checkout (MEMTOPO_SHARED, default
# ../shared) and MEMTOPO_LAB is not 0, set it up and export MEMTOPO_LAB=1 so the lab tests run.
lab="${MEMTOPO_SHARED:-../shared}/lab/numa-vm"
if [[ -x "$lab" && "${MEMTOPO_LAB:-1}" != 0 ]]; then
  # The lab boots a real multi-NUMA kernel under QEMU; its setup installs qemu/ndctl from Debian.
  # Its log goes to a file of this run's own: other checkouts' test runs may be setting up beside it.
  lab_log=$(mktemp -t memtopo-lab-setup.XXXXXX)
  "$lab" setup >"$lab_log" 2>&1 || { cat "$lab_log"; rm -f "$lab_log"; exit 1; }
  rm -f "$lab_log"
  export MEMTOPO_LAB=1
fi
