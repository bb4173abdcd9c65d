#!/usr/bin/env bash
# Set up (first run only) and run every distribution's tests (or what the arguments name).
# Exit 5 (no tests ran) is a failure.
set -uo pipefail
root="$(cd "$(dirname "$0")" && pwd)"
venv="${VERISPEC_VENV:-$root/.venv}"
[ -x "$venv/bin/verispec" ] || "$root/scripts/setup.sh" || exit 1
cd "$root"
# No arguments: every distribution, on one pytest-xdist worker per core (four at most;
# VERISPEC_TEST_WORKERS=N to choose), each test module whole on one worker (--dist loadscope: its
# fixtures built once). Arguments (paths, -k, -n ...) go to pytest instead.
workers="${VERISPEC_TEST_WORKERS:-$(n=$(nproc 2>/dev/null || echo 1); [ "$n" -gt 4 ] && n=4; echo "$n")}"
[ "$#" -gt 0 ] || set -- core plugins models examples tests -q -n "$workers" --dist loadscope
"$venv/bin/python" -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "no tests ran: failing" >&2; exit 1; fi
exit "$rc"
