#!/usr/bin/env bash
# Simulate mybinder.org without Docker: a fresh virtualenv that installs only what binder/ names, then
# every notebook executed in it, then the two launch URLs served by `jupyter lab` on 127.0.0.1.
#
# What repo2docker does for this repository (binder/requirements.txt, runtime.txt, postBuild):
#   1. a Python from binder/runtime.txt with the base image's Jupyter (jupyterlab 4, notebook 7, ipywidgets 8,
#      jupyter_server 2)
#   2. pip install -r binder/requirements.txt from the repository root
#   3. binder/postBuild
# It cannot check conda, apt.txt, the Ubuntu image, Binder's memory limit or the image build itself.
#
# Usage: bash scripts/binder_sim.sh          (BINDER_SIM_DIR=/path to keep the environment elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
start=$(date +%s)
work="${BINDER_SIM_DIR:-${TMPDIR:-/tmp}/trainmem-binder-sim}"
log() { echo "[binder-sim] $*"; }

want="$(sed -n 's/^python-\([0-9.]*\).*/\1/p' binder/runtime.txt)"
py="$(command -v "python${want}" || true)"
if [ -z "$py" ]; then
  py="$(command -v python3)"
  log "python${want} (binder/runtime.txt) not found; using $($py --version 2>&1)"
fi

rm -rf "$work"
mkdir -p "$work"
log "fresh virtualenv in $work/venv ($($py --version 2>&1))"
"$py" -m venv "$work/venv"
# shellcheck disable=SC1091
. "$work/venv/bin/activate"
python -m pip install -q --upgrade pip
log "repo2docker's base packages"
python -m pip install -q "jupyterlab==4.*" "notebook==7.*" "ipywidgets==8.*" "jupyter_server==2.*"
log "pip install -r binder/requirements.txt"
python -m pip install -q -r binder/requirements.txt
log "binder/postBuild"
NB_PYTHON_PREFIX="$work/venv" bash binder/postBuild

log "executing every notebook from a copy"
cp -r notebooks "$work/notebooks"
for nb in "$work"/notebooks/*.ipynb; do
  log "  $(basename "$nb")"
  timeout 600 jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=300 \
    --ExecutePreprocessor.kernel_name=python3 "$nb" >"$work/nbconvert.log" 2>&1 \
    || { cat "$work/nbconvert.log" >&2; log "FAILED: $(basename "$nb")"; exit 1; }
done

log "jupyter lab on 127.0.0.1: the Binder launch URLs"
port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
token=$(python -c 'import secrets; print(secrets.token_hex(16))')
jupyter lab --no-browser --allow-root --ServerApp.ip=127.0.0.1 --ServerApp.port="$port" \
  --IdentityProvider.token="$token" --ServerApp.root_dir="$root" >"$work/lab.log" 2>&1 &
lab_pid=$!
stop_lab() {  # jupyter-server may take its time over SIGTERM (kernels to shut down): 20 s, then SIGKILL
  kill "$lab_pid" 2>/dev/null || return 0
  for _ in $(seq 1 20); do kill -0 "$lab_pid" 2>/dev/null || return 0; sleep 1; done
  kill -9 "$lab_pid" 2>/dev/null || true
}
trap stop_lab EXIT
base="http://127.0.0.1:$port"
for _ in $(seq 1 120); do
  curl -fsS "$base/api/status?token=$token" >/dev/null 2>&1 && break
  sleep 1
done
fetch() {  # URL PATH -> the body, failing on anything but 200
  curl -fsS --max-time 180 -o "$work/$2" -w '%{http_code}' "$base/$1?token=$token"
}
code=$(fetch "lab/tree/notebooks/00_quick_start.ipynb" lab.html) || { cat "$work/lab.log" >&2; exit 1; }
[ "$code" = 200 ] || { log "lab/tree/notebooks/00_quick_start.ipynb answered $code"; exit 1; }
log "  lab/tree/notebooks/00_quick_start.ipynb: 200"
code=$(fetch "voila/render/notebooks/app.ipynb" voila.html) || { cat "$work/lab.log" >&2; exit 1; }
[ "$code" = 200 ] || { log "voila/render/notebooks/app.ipynb answered $code"; exit 1; }
grep -q "application/vnd.jupyter.widget-view+json" "$work/voila.html" \
  || { log "the Voila page holds no widget view"; exit 1; }
grep -q "trainmem" "$work/voila.html" || { log "the Voila page does not show the app"; exit 1; }
log "  voila/render/notebooks/app.ipynb: 200, widgets rendered"
log "OK in $(( $(date +%s) - start ))s"
