#!/usr/bin/env bash
# The text example end to end: install what it needs into .venv, fetch its pinned model, start a
# throwaway Redis if REDIS_URL is not reachable, start a worker on config.toml next to this file,
# send a few generated inputs, and print each served answer next to a direct run of the same
# handler and model. Exits non-zero when any answer differs.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
bash "$root/scripts/bootstrap.sh" examples
cd "$root"
exec .venv/bin/python -m tools.example_run text "$@"
