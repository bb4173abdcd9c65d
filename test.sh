#!/usr/bin/env bash
# Set up (first run only) and run every distribution's tests (or what the arguments name).
# Exit 5 (no tests ran) is a failure.
set -uo pipefail
root="$(cd "$(dirname "$0")" && pwd)"
venv="${VERISPEC_VENV:-$root/.venv}"
[ -x "$venv/bin/verispec" ] || "$root/scripts/setup.sh" || exit 1
cd "$root"
# No arguments: every distribution. Arguments (paths, -k, ...) go to pytest instead.
[ "$#" -gt 0 ] || set -- core plugins models examples tests -q
"$venv/bin/python" -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "no tests ran: failing" >&2; exit 1; fi
exit "$rc"
