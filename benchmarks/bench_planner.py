"""How fast is the planner? `fit` and `max_micro_batch` drive the explorer widget's verdict line (a slider
redraw must stay under 100 ms); `plan` searches layouts over GPU types (seconds for the whole catalog).

Run: python benchmarks/bench_planner.py
"""

from __future__ import annotations

import time

from _timing import median_ms

import trainmem_nb as tm
from trainmem_nb.model.presets import get_model
from trainmem_nb.planning.fit import fewest_gpus, fit, max_micro_batch
from trainmem_nb.planning.search import plan


def main() -> None:
    m = get_model("llama-3.2-1b")
    est = tm.estimate(m, micro_batch=4, seq_len=2048)
    print(f"fit()                                   median {median_ms(lambda i: fit(est, 'H100'), 2000):.3f} ms")
    max_micro_batch(m, "H100", seq_len=2048)
    warm = median_ms(lambda i: max_micro_batch(m, "H100", seq_len=1024 + 64 * (i % 16)), 64)
    print(f"max_micro_batch() warm, llama-3.2-1b    median {warm:.2f} ms   (goal: a slider redraw < 100 ms)")
    slider = median_ms(lambda i: (fit(tm.estimate(m, micro_batch=1 + i % 8, seq_len=2048), "H100"),
                                   max_micro_batch(m, "H100", seq_len=2048)), 64)
    print(f"estimate + fit + max_micro_batch        median {slider:.2f} ms")
    t0 = time.perf_counter()
    p = fewest_gpus("llama-2-7b", "A100 40GB", seq_len=2048)
    print(f"fewest_gpus(llama-2-7b, A100 40GB)      {1e3 * (time.perf_counter() - t0):.0f} ms -> {p.gpus if p else None} GPUs")
    for model, gpus, kw in (
        ("llama-2-13b", ["H100", "A100 80GB", "L40S"], {"seq_len": 2048, "micro_batch": 4, "checkpointing": "full",
                                                        "engine": "deepspeed", "zero": 3, "n_gpus": 8}),
        ("llama-2-7b", ["H100", "A100 40GB", "L40S", "RTX 4090"], {"seq_len": 2048, "target_global_batch": 256}),
        ("llama-2-7b", None, {"seq_len": 2048, "target_global_batch": 256}),
    ):
        t0 = time.perf_counter()
        result = plan(model, gpu=gpus, tokens=2e9, **kw)
        what = "whole catalog" if gpus is None else f"{len(gpus)} GPU types"
        label = f"plan({model}, {what})"
        print(f"{label:<40}{time.perf_counter() - t0:6.2f} s, {len(result.rows)} options")


if __name__ == "__main__":
    main()
