"""Estimate vs fake-mode measurement over a small matrix (developer loop; `trainmem validate` is the product)."""

from __future__ import annotations

import itertools
import sys
import time

from trainmem_nb.estimator.api import estimate
from trainmem_nb.measure.step import run_step, summarize
from trainmem_nb.model.spec import ModelSpec
from trainmem_nb.spec.training import TrainingSpec

#: Families without grouped-query attention (n_kv_heads must equal n_heads).
NO_GQA = ("gpt2", "opt", "bert", "gpt_neox")


def cases(family: str):
    shapes = [dict(n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, ffn=768, vocab=1000),
              dict(n_layers=2, hidden=192, n_heads=3, n_kv_heads=3, ffn=512, vocab=3000, tie_embeddings=True)]
    if family in NO_GQA:  # no grouped-query attention; the first shape unties the head instead
        shapes[0].update(n_kv_heads=0, tie_embeddings=False)
    opts = [dict(precision=p, optimizer=o, optimizer_impl=i, checkpointing=c, attention=a, dropout=d)
            for p, (o, i), c, a, d in itertools.product(
                ["fp32", "bf16-mixed", "bf16-true"],
                [("adamw", "foreach"), ("adamw", "for-loop"), ("adamw", "fused"), ("sgd", None), ("none", None)],
                ["none"], ["sdpa"], [0.0])]
    for sh in shapes:
        for o in opts:
            for b, s in [(2, 64), (1, 200)]:
                yield ModelSpec(family=family, max_positions=4096, **sh), TrainingSpec(micro_batch=b, seq_len=s, device="cpu", **o)


def main() -> None:
    family = sys.argv[1] if len(sys.argv) > 1 else "llama"
    extra = dict(a.split("=", 1) for a in sys.argv[2:])
    worst = 0.0
    for m, t in cases(family):
        if extra:
            t = TrainingSpec.model_validate({**t.model_dump(), **extra})
        t0 = time.time()
        e = estimate(m, t)
        s = summarize(run_step(m, t, "fake"))
        err = e.peak_allocated_bytes / s["peak"] - 1
        worst = max(worst, abs(err))
        phase = {"forward": "forward", "backward": "backward", "optimizer": "optimizer"}.get(s["peak_phase"], s["peak_phase"])
        flag = "" if abs(err) < 0.005 and phase == e.peak_phase else "  <<<"
        print(f"{t.precision.value:10s} {t.optimizer.value:5s} {t.optimizer_impl and t.optimizer_impl.value!s:8s} "
              f"ckpt={t.checkpointing.value:9s} {t.attention.value} d={t.dropout} b{t.micro_batch} s{t.seq_len} L{m.n_layers}: "
              f"est {e.peak_allocated_bytes} mea {s['peak']} err {err:+.4f} {e.peak_phase}/{phase}{flag}  ({time.time() - t0:.1f}s)")
    print("worst", worst)


if __name__ == "__main__":
    main()
