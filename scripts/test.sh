#!/usr/bin/env bash
# The test suite: installs the dev extra into .venv, then runs pytest (real redis-server and
# onnxruntime; each test module starts its own Redis). Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh" dev
cd "$root"
if ! command -v redis-server >/dev/null; then
  echo "redis-server is not installed: sudo apt-get install redis-server" >&2
  exit 2
fi
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then  # pytest: no tests collected (e.g. a -k that matches nothing)
  echo "pytest collected no tests for: $*" >&2
  exit 0
fi
exit "$rc"
