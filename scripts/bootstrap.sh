#!/usr/bin/env bash
# Create .venv (once) and install redbatch with the given extra into it. Sourced by the others.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extra="${1:-dev}"
python="${PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "redbatch needs Python 3.11 or newer; set PYTHON=/path/to/python3.11" >&2
  exit 2
fi
if [ ! -x "$root/.venv/bin/python" ]; then
  "$python" -m venv "$root/.venv"
fi
stamp="$root/.venv/.redbatch-$extra"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  "$root/.venv/bin/python" -m pip install -q --upgrade pip
  "$root/.venv/bin/python" -m pip install -q -e "$root[$extra]"
  touch "$stamp"
fi
