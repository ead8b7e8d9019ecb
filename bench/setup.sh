#!/usr/bin/env bash
# Create (or refresh) the benchmark's own virtualenv, bench/.venv, from bench/requirements.txt.
# The alternatives singletask is compared with are installed there only, never as dependencies
# of singletask. `python -m bench run` does the same by itself when the venv is missing or stale.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet -r requirements.txt
sha256sum requirements.txt | cut -d' ' -f1 > .venv/bench-requirements.sha256
.venv/bin/python -m pip list 2>/dev/null | grep -i -E '^(celery|redis|kombu|matplotlib)'
