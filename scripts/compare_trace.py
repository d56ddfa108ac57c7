"""Align the estimator's allocation events with a measured step's, to find where they differ.

Example: python scripts/compare_trace.py --family llama --set precision=bf16-mixed --phase backward
Prints a unified diff of (sign, bytes / (b*s*h)) per event, estimator ('-') vs measured ('+').
"""

from __future__ import annotations

import argparse
import difflib

from _step_args import add_step_args, step_from_args

from trainmem_nb.engine.program import _round
from trainmem_nb.measure.step import run_step
from trainmem_nb.measure.tracker import cuda_round
from trainmem_nb.step.compile import compile_step


def main() -> None:
    ap = argparse.ArgumentParser()
    add_step_args(ap)
    ap.add_argument("--phase", default="")
    ap.add_argument("--min-bytes", type=int, default=0)
    ap.add_argument("--live", action="store_true",
                    help="compare live bytes at each allocation; print where they first diverge")
    a = ap.parse_args()
    m, t = step_from_args(a)
    sbh = a.batch * a.seq * m.hidden
    prog = compile_step(m, t)
    est = []
    for seg in prog.segments:
        if a.phase and seg.phase != a.phase:
            continue
        for _rep in range(seg.repeat):
            for _cat, sign, sz, label in seg.events:
                b = _round(sz.at(a.batch, a.seq))
                if b >= a.min_bytes:
                    est.append((f"{'+' if sign > 0 else '-'}{b / sbh:.3f}", f"{seg.label}: {label}"))
    tr = run_step(m, t, "fake").tracker
    mea = []
    for idx, sign in tr.events:
        r = tr.records[idx]
        if r.phase in ("init", "adopt") or r.op == "adopt":
            continue
        if a.phase and r.phase != a.phase and not (sign < 0 and a.phase == "backward"):
            continue
        b = cuda_round(r.nbytes)
        if b >= a.min_bytes:
            mea.append((f"{'+' if sign > 0 else '-'}{b / sbh:.3f}", f"{r.phase[:3]} {r.op} {r.module} {r.shape} {r.dtype}"))
    if a.live:
        _live_divergence(prog, tr, a, sbh)
        return
    sm = difflib.SequenceMatcher(a=[e[0] for e in est], b=[e[0] for e in mea], autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            print(f"   ... {i2 - i1} equal events (e.g. {est[i1][1]})")
            continue
        for k in range(i1, i2):
            print(f"EST {est[k][0]:>9}  {est[k][1]}")
        for k in range(j1, j2):
            print(f"MEA {mea[k][0]:>9}  {mea[k][1]}")
        print("   ---")


def _live_divergence(prog, tr, a, sbh) -> None:  # type: ignore[no-untyped-def]
    """Walk both event streams; at every allocation compare the live totals (frees between
    allocations are order-insensitive). Prints the first few divergences with context."""
    est = []
    for seg in prog.segments:
        for _rep in range(seg.repeat):
            for _cat, sign, sz, label in seg.events:
                est.append((sign * _round(sz.at(a.batch, a.seq)), f"{seg.label}: {label}"))
    init = sum(_round(sz.at(a.batch, a.seq)) * count for _c, sz, count in prog.init)
    mea, base = [], 0
    for idx, sign in tr.events:
        r = tr.records[idx]
        if r.op == "adopt":
            base += sign * cuda_round(r.nbytes)
            continue
        mea.append((sign * cuda_round(r.nbytes), f"{r.phase[:3]} {r.op} {r.module} {r.shape} {r.dtype}"))

    def at_allocs(seq, start):  # type: ignore[no-untyped-def]
        out, live = [], start
        for d, label in seq:
            live += d
            if d > 0:
                out.append((live, d, label))
        return out

    ea, ma = at_allocs(est, init), at_allocs(mea, base)
    print(f"init est {init} mea {base}; allocations est {len(ea)} mea {len(ma)}")
    shown = 0
    for i, (e, m_) in enumerate(zip(ea, ma, strict=False)):
        if e[0] != m_[0] or e[1] != m_[1]:
            print(f"alloc #{i}: est live {e[0]} (+{e[1] / sbh:.3f} {e[2]})  mea live {m_[0]} (+{m_[1] / sbh:.3f} {m_[2]})"
                  f"  diff {(e[0] - m_[0]) / sbh:+.3f} sbh")
            shown += 1
            if shown >= 8:
                break
    if not shown:
        print("live bytes agree at every allocation")


if __name__ == "__main__":
    main()
