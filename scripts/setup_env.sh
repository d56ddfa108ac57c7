#!/usr/bin/env bash
# Create (or reuse) .venv with the project and the extras named in $1 (default: notebook,app).
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-notebook,app}"
python3 -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip
if [[ ",$extras," == *",measure,"* ]]; then
  # torch 2.13.0 first and pinned: it is the CPU build on this machine's disk (anything else downloads
  # several GB of CUDA build)
  python -m pip install -q "torch==2.13.0"
fi
python -m pip install -q -e ".[$extras]"
