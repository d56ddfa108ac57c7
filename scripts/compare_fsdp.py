"""Estimated vs measured (one-process, fake process group) FSDP2 rank: peak, phase, breakdown at the peak.

Example: python scripts/compare_fsdp.py --set precision=bf16-mixed --zero 3 --gpus 4 --live
"""

from __future__ import annotations

import argparse

from _step_args import add_step_args, step_from_args

from trainmem_nb.engine.program import _round
from trainmem_nb.estimator.simulate import simulate
from trainmem_nb.measure.fsdp import run_fsdp_step
from trainmem_nb.measure.step import summarize
from trainmem_nb.measure.tracker import cuda_round
from trainmem_nb.parallel.layout import _hooks
from trainmem_nb.spec.parallel import ParallelSpec
from trainmem_nb.step.compile import compile_step, program_key


def main() -> None:
    ap = argparse.ArgumentParser()
    add_step_args(ap)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--zero", type=int, default=3)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--live", action="store_true", help="print live bytes per event side by side")
    a = ap.parse_args()
    m, t = step_from_args(a)
    p = ParallelSpec(gpus=a.gpus, engine="fsdp", zero=a.zero)
    e = simulate(m, t, None, p, backend="nccl")  # the fake process group allocates as NCCL does
    s = summarize(run_fsdp_step(m, t, p, rank=a.rank))
    print(f"peak est {e.peak_allocated_bytes:,} ({e.peak_phase}, {e.peak_at})  mea {s['peak']:,} ({s['peak_phase']}, "
          f"{s['peak_op']} {s['peak_module']})  err {e.peak_allocated_bytes / s['peak'] - 1:+.4f}")
    for k in sorted(set(e.detail_bytes) | set(s["detail"])):
        ev, mv = e.detail_bytes.get(k, 0), s["detail"].get(k, 0)
        if ev or mv:
            print(f"  {k:28s} est {ev:>12,} mea {mv:>12,}{'  <<<' if ev != mv else ''}")
    if a.live:
        prog = compile_step(m, program_key(t), _hooks(m, t, p, "nccl"))
        est = []
        for seg in prog.segments:
            for _ in range(seg.repeat):
                for cat, sign, sz, label in seg.events:
                    est.append((sign * _round(sz.at(a.batch, a.seq)), f"{seg.phase[:3]} {seg.label}: {label} c{cat}"))
        tr = run_fsdp_step(m, t, p, rank=a.rank).tracker
        mea = []
        for idx, sign in tr.events:
            r = tr.records[idx]
            if r.phase in ("init", "adopt") or r.op == "adopt":
                continue
            mea.append((sign * cuda_round(r.nbytes), f"{r.phase[:3]} {r.op} {r.module} {r.shape} {r.dtype} {r.category}"))
        le = lm = 0
        for i in range(max(len(est), len(mea))):
            x = est[i] if i < len(est) else (0, "")
            y = mea[i] if i < len(mea) else (0, "")
            le += x[0]
            lm += y[0]
            print(f"{i:4d} {le:>11,} {x[0]:>+10,} {x[1][:60]:60s} | {lm:>11,} {y[0]:>+10,} {y[1][:80]}")


if __name__ == "__main__":
    main()
