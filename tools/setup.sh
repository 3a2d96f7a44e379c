#!/usr/bin/env bash
# Creates .venv (Python >= 3.12: pyhwloc needs it) with memtopo, its Kubernetes extra and its dev tools
# (installed by uv, or pip where uv cannot be had).
# Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
find_python() {
  local c
  for c in "${MEMTOPO_PYTHON:-}" "$(command -v pyenv >/dev/null && echo "$(pyenv root)/versions/3.12.1/bin/python3.12")" \
           python3.13 python3.12 "$HOME/.pyenv/versions/3.12.1/bin/python3.12" python3; do
    [[ -n "$c" ]] && command -v "$c" >/dev/null 2>&1 || continue
    if "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then echo "$c"; return; fi
  done
  echo "no Python >= 3.12 found (set MEMTOPO_PYTHON)" >&2; exit 1
}
# The fleet page's browser tests drive Debian's Chromium (playwright's own browser download cannot
# run here); installed only where missing and only as root, else those tests skip and say why.
if ! command -v chromium >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
  { DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium fonts-liberation fonts-dejavu-core >/dev/null; } ||
    echo "tools/setup.sh: could not install chromium; the fleet page's browser tests will skip" >&2
fi
# The CRI enforcement tests drive a real containerd (Debian's containerd and runc) with an image built
# from the static busybox; installed only where missing and only as root, else those tests skip and say
# why. The package's own service is not wanted: the tests start containerd as their child.
if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1 &&
   ! { command -v containerd && command -v runc && command -v ctr && [[ -x /bin/busybox ]]; } >/dev/null 2>&1; then
  { DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends containerd runc busybox-static >/dev/null; } ||
    echo "tools/setup.sh: could not install containerd; the CRI enforcement tests will skip" >&2
fi
stamp=.venv/.memtopo-setup
want=$(sha256sum pyproject.toml | cut -c1-16)
if [[ ! -x .venv/bin/python || "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
  py=$(find_python)
  [[ -x .venv/bin/python ]] || "$py" -m venv .venv
  # setuptools installs this flat layout (memtopo/ at the root, beside the floors it links) editable
  # through an import finder, and says that a memtopo/ folder in the current directory would take
  # precedence over it. Here that folder is the one the finder points to: the same files either way,
  # so the notice says nothing about this checkout and is filtered by its text (nothing else is).
  export PYTHONWARNINGS="ignore:Editable installation"
  # uv (PyPI's Rust installer) resolves and installs the dependencies several times faster than
  # pip; it compiles their bytecode as pip does. pip remains where uv cannot be had.
  if ! { .venv/bin/python -m pip install -q uv &&
         .venv/bin/uv pip install -q --python .venv/bin/python --compile-bytecode -e '.[dev,k8s]'; }; then
    echo "tools/setup.sh: uv unavailable or failed; installing with pip" >&2
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e '.[dev,k8s]'
  fi
  echo "$want" > "$stamp"
fi
# Put `memtopo` on PATH, as the README writes it: a link in /usr/local/bin (or $MEMTOPO_BIN_DIR) to this
# checkout's .venv/bin/memtopo. The checkout set up last wins; a memtopo that is not such a link (a
# system-wide install) is left alone. MEMTOPO_LINK=0 skips this.
if [[ "${MEMTOPO_LINK:-1}" != 0 ]]; then
  bin_dir=${MEMTOPO_BIN_DIR:-/usr/local/bin}
  target="$PWD/.venv/bin/memtopo"
  link="$bin_dir/memtopo"
  current=$(readlink "$link" 2>/dev/null || true)
  if [[ "$current" == "$target" ]]; then
    :
  elif [[ -e "$link" || -L "$link" ]] && [[ "$current" != */.venv/bin/memtopo ]]; then
    echo "setup: $link is not a memtopo checkout's link; left alone (this checkout's: $target)" >&2
  elif [[ -d "$bin_dir" && -w "$bin_dir" ]] && ln -sfn "$target" "$link"; then
    :
  else
    echo "setup: cannot write $bin_dir; put memtopo on PATH with one of:" >&2
    echo "  sudo ln -sfn $target $link" >&2
    echo "  export PATH=\"$PWD/.venv/bin:\$PATH\"" >&2
  fi
  if [[ -L "$link" && ":$PATH:" != *":$bin_dir:"* ]]; then
    echo "setup: $bin_dir is not on PATH; add it, or run $target" >&2
  fi
fi
