"""Print every allocation and free of one measured training step (a developer's magnifying glass).

Example: python scripts/trace_step.py --family llama --layers 2 --hidden 256 --heads 4 --kv-heads 2 \
    --ffn 512 --vocab 1000 --batch 1 --seq 64 --precision bf16-mixed --min-bytes 1
Sizes are printed in units of b*s*h bytes (``sbh``) so that per-layer recipes read off directly.
"""

from __future__ import annotations

import argparse

from _step_args import add_step_args, step_from_args

from trainmem_nb.measure.step import run_step, summarize
from trainmem_nb.measure.tracker import cuda_round


def main() -> None:
    ap = argparse.ArgumentParser()
    add_step_args(ap, layers=2, ffn=512, batch=1)
    ap.add_argument("--device", default="fake")
    ap.add_argument("--min-bytes", type=int, default=1)
    ap.add_argument("--phase", default="")
    a = ap.parse_args()
    m, t = step_from_args(a)
    trace = run_step(m, t, a.device)
    tr = trace.tracker
    sbh = t.micro_batch * t.seq_len * m.hidden
    live = 0
    for i, (idx, sign) in enumerate(tr.events):
        r = tr.records[idx]
        live += sign * cuda_round(r.nbytes)
        if r.nbytes < a.min_bytes or (a.phase and r.phase != a.phase and sign > 0):
            continue
        print(f"{i:5d} {'+' if sign > 0 else '-'} {r.phase[:3]} L{'' if r.layer_index is None else r.layer_index:<2} "
              f"{r.category:26s} {r.op:38s} {r.module:40s} {r.shape!s:22s} {r.dtype:8s} {r.nbytes / sbh:8.3f} live={live}")
    summary = summarize(trace)
    summary.pop("timeline")  # the downsampled live-bytes curve: the events above already show it
    print(summary)


if __name__ == "__main__":
    main()
