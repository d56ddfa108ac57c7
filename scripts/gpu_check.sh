#!/usr/bin/env bash
# One short GPU session's checks: measure a handful of real training steps with `trainmem measure --device
# cuda` (the allocator's counters and its segments), then print the estimate beside each
# (scripts/gpu_summary.py) and the replayed allocator segments beside the real ones
# (scripts/compare_snapshot.py). Each step runs in its own process (the allocator's settings are
# process-wide). Usage: bash scripts/gpu_check.sh OUTDIR [TARBALL]   (about 5 minutes on one H100/H200);
# TARBALL, if given, is rewritten with OUTDIR's JSON after every step, so a run cut short still returns them.
set -u
out=${1:?usage: gpu_check.sh OUTDIR [TARBALL]}
tarball=${2:-}
mkdir -p "$out/json"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
device=${DEVICE:-cuda}   # DEVICE=cpu ONLY=gpt2 tries the script here

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
"$py" -c 'import torch, transformers, peft; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "peft", peft.__version__)'

# name | environment | trainmem measure arguments; RUNS=FILE replaces the list with that file's lines
runs=(
  "llama1b-full||--model llama-3.2-1b --micro-batch 2 --seq-len 1024 --save-calibration $out/json/calibration-h200.json"
  "llama1b-full-expandable|PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True|--model llama-3.2-1b --micro-batch 2 --seq-len 1024"
  "qwen3-0.6b-full||--model qwen3-0.6b --micro-batch 4 --seq-len 2048"
  "gemma3-1b-lora||--model gemma-3-1b --method lora --micro-batch 2 --seq-len 2048"
  "llama2-7b-lora||--model llama-2-7b --method lora --micro-batch 1 --seq-len 2048"
  "llama1b-full-ckpt||--model llama-3.2-1b --micro-batch 8 --seq-len 2048 --checkpointing full"
  "olmo2-1b-eager||--model olmo-2-1b --micro-batch 2 --seq-len 1024 --attention eager"
  "gpt2-fp16||--model gpt2 --precision fp16-mixed --micro-batch 8 --seq-len 1024"
  "smollm3-3b-lora-ckpt||--model smollm3-3b --method lora --micro-batch 4 --seq-len 4096 --checkpointing full"
)
if [[ -n ${RUNS:-} ]]; then
  mapfile -t runs < <(grep -v '^ *#' "$RUNS" | grep -v '^ *$')
fi
for r in "${runs[@]}"; do
  IFS='|' read -r name envs args <<< "$r"
  [[ -n ${ONLY:-} && ! $name =~ $ONLY ]] && continue
  echo "== $name"
  # shellcheck disable=SC2086
  env $envs timeout "${STEP_TIMEOUT:-90}" "$py" -c 'import sys; from trainmem_nb.cli.main import main; sys.exit(main())' \
    measure $args --device "$device" --out "$out/json/$name.json" --force 2>&1 | tail -4
  [[ -n $tarball ]] && tar czf "$tarball" -C "$out" json
done
echo "== estimate beside each measured step"
steps=$(ls "$out"/json/*.json | grep -v calibration)
# shellcheck disable=SC2086
"$py" scripts/gpu_summary.py $steps 2>&1
echo "== replayed allocator segments beside the real ones"
# shellcheck disable=SC2086
"$py" scripts/compare_snapshot.py $steps 2>&1
