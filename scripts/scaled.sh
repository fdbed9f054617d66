#!/usr/bin/env bash
# The scaled layout: `scripts/scaled.sh up|down|status|clean [--dir DIR]` (docs/scaled.md).
# The same as `make scaled-up` / `make scaled-down`, without make; needs `make setup` once.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="$root/.venv/bin/python"
if [ ! -x "$py" ]; then
    echo "scaled: error: no $root/.venv: run \`make setup\` (or \`make scaled-up\`) first" >&2
    exit 2
fi
exec "$py" "$root/scripts/scaled.py" "$@"
