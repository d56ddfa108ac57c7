#!/usr/bin/env bash
# The main job: JupyterLab on the quick-start notebook (installs what it needs on a fresh machine).
# The URL JupyterLab prints opens the quick start itself (default_url), also in a container or over ssh
# with --no-browser. As root (containers, cloud boxes) JupyterLab refuses to start without --allow-root,
# which is added, saying so. Extra arguments go to jupyter lab: make lab LAB_ARGS="--port 9999 --no-browser".
# TRAINMEM_LAB_DRY_RUN=1 prints the command instead of running it (what the tests check).
set -euo pipefail
cd "$(dirname "$0")/.."
args=(--LabApp.default_url=/lab/tree/notebooks/00_quick_start.ipynb)
if [ "$(id -u)" = 0 ]; then
  echo "[lab] running as root (a container or cloud box?): passing --allow-root to JupyterLab" >&2
  args+=(--allow-root)
fi
if [ -n "${TRAINMEM_LAB_DRY_RUN:-}" ]; then
  echo jupyter lab "${args[@]}" "$@"
  exit 0
fi
bash scripts/setup_env.sh notebook,app
# shellcheck disable=SC1091
. .venv/bin/activate
exec jupyter lab "${args[@]}" "$@"
