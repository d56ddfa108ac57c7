"""How long `trainmem measure` takes: fake mode on 7B-70B shapes (goal: a 7B step in under a minute
on 2 cores) and real CPU steps of small models.

Run: python benchmarks/bench_measure.py [--quick]
Each line: the case, wall seconds of the whole measurement (build, prime, step, analysis) and the
phases, and the measured peak.
"""

from __future__ import annotations

import argparse
import sys
import time

from trainmem_nb.measure import measure
from trainmem_nb.units import format_bytes

CASES = [
    # (label, model, device, options)
    ("llama-2-7b bf16-mixed b1 s2048", "llama-2-7b", "fake", {"precision": "bf16-mixed"}),
    ("llama-2-7b bf16-mixed b1 s2048 full ckpt", "llama-2-7b", "fake", {"precision": "bf16-mixed",
                                                                        "checkpointing": "full"}),
    ("llama-3-8b bf16-true b4 s4096 LoRA qv", "llama-3-8b", "fake", {"precision": "bf16-true", "micro_batch": 4,
                                                                      "seq_len": 4096, "method": "lora"}),
    ("mixtral-8x7b bf16-mixed b1 s2048", "mixtral-8x7b", "fake", {"precision": "bf16-mixed"}),
    ("llama-2-70b bf16-mixed b1 s4096 full ckpt", "llama-2-70b", "fake", {"precision": "bf16-mixed", "seq_len": 4096,
                                                                          "checkpointing": "full"}),
    ("gpt2 124M fp32 b1 s128 (real CPU tensors)", "gpt2", "cpu", {"precision": "fp32", "seq_len": 128, "dropout": 0.0}),
    ("pythia-160m fp32 b2 s256 (real CPU tensors)", "pythia-160m", "cpu", {"precision": "fp32", "micro_batch": 2,
                                                                             "seq_len": 256}),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the 7B fake step and the GPT-2 CPU step")
    args = ap.parse_args(argv)
    cases = [c for c in CASES if not args.quick or c[0].startswith(("llama-2-7b bf16-mixed b1 s2048", "gpt2"))]
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'case':<46} {'device':<6} {'wall s':>7} {'build':>6} {'step':>6} {'peak':>11}")
    slow = False
    for label, model, device, options in cases:
        opts = {"micro_batch": 1, "seq_len": 2048, **options}
        t0 = time.perf_counter()
        r = measure(model, device=device, **opts)
        wall = time.perf_counter() - t0
        timing = r.measured_with["timing"]
        print(f"{label:<46} {device:<6} {wall:7.1f} {timing['build_s']:6.1f} {timing['step_s']:6.1f} "
              f"{format_bytes(r.peak_allocated_bytes):>11}", flush=True)
        if label.startswith("llama-2-7b bf16-mixed b1 s2048") and "ckpt" not in label and wall > 60:
            slow = True
    if slow:
        print("GOAL MISSED: a 7B fake step took over a minute", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
