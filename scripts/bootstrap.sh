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
fresh() { [ -f "$1" ] && ! [ "$root/pyproject.toml" -nt "$1" ]; }
stamp="$root/.venv/.redbatch-$extra"
# dev holds every other extra (pyproject.toml): after the tests, the demo and examples start at once.
if ! fresh "$stamp" && ! fresh "$root/.venv/.redbatch-dev"; then
  "$root/.venv/bin/python" -m pip install -q --upgrade pip
  "$root/.venv/bin/python" -m pip install -q -e "$root[$extra]"
  touch "$stamp"
fi
