#!/usr/bin/env bash
# The main job end to end: build the demo model, start a throwaway Redis if REDIS_URL is not
# reachable, start a worker, send a few thousand requests through `redbatch run`, print the
# summary, and stop everything it started. Extra arguments go to `python -m tools.demo`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/bootstrap.sh" demo
cd "$root"
exec .venv/bin/python -m tools.demo "$@"
