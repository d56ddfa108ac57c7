#!/usr/bin/env bash
# The main job: JupyterLab on the quick-start notebook (installs what it needs on a fresh machine).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh notebook,app
# shellcheck disable=SC1091
. .venv/bin/activate
exec jupyter lab notebooks/00_quick_start.ipynb "$@"
