#!/usr/bin/env bash
# Set up (first run only) and run the verispec CLI, e.g. `./verispec.sh generate`.
set -euo pipefail
root="$(cd "$(dirname "$0")" && pwd)"
venv="${VERISPEC_VENV:-$root/.venv}"
[ -x "$venv/bin/verispec" ] || "$root/scripts/setup.sh"
exec "$venv/bin/verispec" "$@"
