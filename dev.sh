#!/usr/bin/env bash
# Entry point for newcomers and CI:  ./dev.sh train [flags]   |   ./dev.sh test [pytest args]
# Each sets up .venv first (fast no-op when nothing changed); `test` runs the linter (ruff, configured in
# pyproject.toml) before pytest.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
cmd="${1:-}"; shift || true
case "$cmd" in
    train) exec .venv/bin/torchrec-tpu train "$@" ;;
    test)  .venv/bin/ruff check --quiet . && exec .venv/bin/python -m pytest "$@" ;;
    *) echo "usage: ./dev.sh train [flags] | ./dev.sh test [pytest args]" >&2; exit 2 ;;
esac
