#!/usr/bin/env bash
# Install everything the tests need and run the whole suite: unit and property tests, measurement
# tests (torch, CPU), notebooks against their committed outputs (nbval), real-browser tests, and a
# simulated Binder launch.
# This is exactly what CI runs (.ci/run). Exits non-zero on the first failing stage.
set -euo pipefail
cd "$(dirname "$0")/.."
export MPLBACKEND=Agg PYTHONDONTWRITEBYTECODE=1
# Browser tests drive Debian's chromium; install it when missing and possible (root, apt).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "[test] installing chromium (apt) for the browser tests"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-dejavu-core >/dev/null) \
    || echo "[test] chromium could not be installed: browser tests will be skipped"
fi
# The allocator's replay in C (setup.py) is built by the install below; it needs a C compiler.
if ! command -v cc >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "[test] installing a C compiler (apt) for the allocator's C replay"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev >/dev/null) \
    || echo "[test] no C compiler: the allocator replays in Python and tests/test_allocator_fast.py says so"
fi
bash scripts/setup_env.sh notebook,app,test,browser,measure,hub,dev
# shellcheck disable=SC1091
. .venv/bin/activate
echo "[test] ruff"
ruff check trainmem_nb tests benchmarks scripts
echo "[test] mypy"
mypy trainmem_nb
echo "[test] import layers and cycles (import-linter, contracts in pyproject.toml)"
lint-imports
echo "[test] unit, property and measurement tests"
timeout 3600 python -m pytest tests -q -p no:cacheprovider
echo "[test] notebooks: every code cell executed, in order, clean"
python scripts/check_notebooks.py notebooks/*.ipynb
echo "[test] notebooks against their committed outputs (strict nbval)"
timeout 1800 python -m pytest -q -p no:cacheprovider --nbval --nbval-current-env --nbval-cell-timeout=300 \
  --nbval-sanitize-with notebooks/nbval_sanitize.cfg notebooks/
echo "[test] real browser: Voila app and JupyterLab in headless Chromium (skips, saying why, without chromium)"
timeout 1200 python -m pytest -q -p no:cacheprovider -rs tests/browser
echo "[test] Binder simulation: a fresh virtualenv with only what binder/ names runs every notebook"
timeout 1800 bash scripts/binder_sim.sh
echo "[test] all stages passed"
