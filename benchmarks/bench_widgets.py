"""How fast does the explorer answer a slider, and how fast is a sweep?

Prints, in the kernel's terms (no browser):
- slider -> redrawn chart: the time from setting a slider's value to the explorer holding the new PNG,
  verdict and numbers (re-estimate, planner fit, in-place redraw, PNG encode), median and 90th percentile,
  wall clock and CPU (goal: median wall <= 100 ms), for llama-3-8b and for DeepSeek-V3's 61 MLA layers
  (a batch shape seen for the first time replays the caching allocator: ~0.13 s for DeepSeek-V3);
- tm.sweep of 10,000 combinations into a DataFrame, allocated bytes (``replay=False``: the reserved columns
  would replay the allocator for every batch shape, tens of ms each; `bench_estimate.py` times that) (goal <= 1 s);
- the machine's load average, since the CPU may be shared.

Run: python benchmarks/bench_widgets.py   (MPLBACKEND=Agg is set here)
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("MPLBACKEND", "Agg")

import trainmem_nb as tm

GOAL_REDRAW_S = 0.100
GOAL_SWEEP_S = 1.0


def _time(fn: Callable[[int], Any], n: int) -> tuple[list[float], list[float]]:
    walls, cpus = [], []
    for i in range(n):
        w0, c0 = time.perf_counter(), time.process_time()
        fn(i)
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return walls, cpus


def _line(label: str, walls: list[float], cpus: list[float], goal: float) -> str:
    med = statistics.median(walls)
    p90 = sorted(walls)[int(0.9 * (len(walls) - 1))]
    verdict = "OK" if med <= goal else "OVER GOAL"
    return (f"{label:<44} median {1e3 * med:6.1f} ms  p90 {1e3 * p90:6.1f} ms  cpu median "
            f"{1e3 * statistics.median(cpus):6.1f} ms  (goal <= {1e3 * goal:.0f} ms: {verdict})")


def main() -> None:
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    app = tm.explore("llama-3-8b", gpu="H100", micro_batch=1, seq_len=2048, checkpointing="full")
    slider = app.controls["micro_batch"]
    before = app.redraws

    def move_micro_batch(i: int) -> None:
        slider.value = 1 + (i % 16) if slider.value != 1 + (i % 16) else 17

    walls, cpus = _time(move_micro_batch, 60)
    assert app.redraws == before + 60, "every slider move must redraw once"
    print(_line("slider -> redrawn chart, micro-batch", walls, cpus, GOAL_REDRAW_S))

    seq = app.controls["seq_len"]
    options = [s for s in seq.options if 256 <= s <= 16384]

    def move_seq(i: int) -> None:
        seq.value = options[i % len(options)] if seq.value != options[i % len(options)] else options[0]

    walls, cpus = _time(move_seq, 36)
    print(_line("slider -> redrawn chart, sequence length", walls, cpus, GOAL_REDRAW_S))

    # a 61-layer MLA model (DeepSeek-V3): a batch shape seen for the first time replays its allocator
    big = tm.explore("deepseek-v3", gpu="H100", micro_batch=1, seq_len=2048, checkpointing="full")
    big_seq = big.controls["seq_len"]
    big_options = [s for s in big_seq.options if 256 <= s <= 16384]

    def move_big_seq(i: int) -> None:
        value = big_options[i % len(big_options)]
        big_seq.value = value if big_seq.value != value else big_options[0]

    walls, cpus = _time(move_big_seq, len(big_options))
    print(_line("deepseek-v3: sequence length, first visits", walls, cpus, GOAL_REDRAW_S))
    walls, cpus = _time(move_big_seq, 2 * len(big_options))
    print(_line("deepseek-v3: sequence length, revisits", walls, cpus, GOAL_REDRAW_S))

    size = app.controls["params"]
    app.set(model=7e9)
    values = [1e8, 1e9, 7e9, 7e10, 4e11]

    def move_size(i: int) -> None:
        size.value = values[i % len(values)]

    walls, cpus = _time(move_size, 20)
    print(_line("slider -> redrawn chart, model size (cold)", walls, cpus, GOAL_REDRAW_S))
    walls, cpus = _time(move_size, 20)
    print(_line("slider -> redrawn chart, model size (warm)", walls, cpus, GOAL_REDRAW_S))

    grid = dict(micro_batch=list(range(1, 51)), seq_len=[256, 512, 1024, 2048, 4096, 8192, 16384, 32768],
                precision=["fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp16-true"],
                optimizer=["adamw", "sgd", "sgd-momentum", "lion", "adafactor"])
    n = 1
    for v in grid.values():
        n *= len(v)
    tm.sweep("llama-3.1-8b", micro_batch=1, seq_len=1024)  # import pandas and numpy once
    from trainmem_nb.step.compile import compile_step

    compile_step.cache_clear()
    walls, cpus = _time(lambda i: tm.sweep("llama-3.1-8b", replay=False, **grid), 1)
    print(_line(f"tm.sweep(replay=False), {n:,} rows (cold: 25 compiles)", walls, cpus, GOAL_SWEEP_S))
    walls, cpus = _time(lambda i: tm.sweep("llama-3.1-8b", replay=False, **grid), 3)
    print(_line(f"tm.sweep(replay=False), {n:,} rows (warm)", walls, cpus, GOAL_SWEEP_S))
    assert len(tm.sweep("llama-3.1-8b", replay=False, **grid)) == n


if __name__ == "__main__":
    main()
