"""How fast is an estimate? Prints the median time of one `estimate()` (goal <= 0.2 ms) and of 10,000
estimates in a sweep (goal <= 1 s), warm (the step program compiled once per model and options) and
cold (compiling included), and what replaying the caching allocator costs for a batch shape not seen
before (goal <= 0.5 ms: not met, ~1.1 ms for an 8B model on an idle 2-core machine with the C replay, of
which the replay ~0.8 ms; ~30 ms without it; ~1.2 ms for a 7B model at the explorer's slider shapes) and in a sweep (its shapes replayed side by side on every core:
~1.4 ms per row on 2 cores). The replay alone (printed) varies with the shape: 0.44-1.34 ms, median 0.85 ms,
over 51 of llama-2-7b's slider shapes (2026-12-08), about half of it, under perf, keeping each size's free blocks
sorted by address (the buckets' shifts and searches; a min-heap per size instead gave the same median). fp8's eager casts give its step about three times the events of a bf16 step (the
folded program merges its scalar temporaries; the replayed one keeps every malloc): a warm estimate ~0.19 ms
and a new batch shape ~5 ms for an 8B model.

Run: python benchmarks/bench_estimate.py
"""

from __future__ import annotations

import itertools
import time

from _timing import median_ms

import trainmem_nb as tm
from trainmem_nb.engine.allocator.fast import NATIVE
from trainmem_nb.model.presets import get_model, list_presets
from trainmem_nb.model.spec import ModelSpec
from trainmem_nb.step.compile import compile_step


def main() -> None:
    print(f"allocator replay in C: {'yes' if NATIVE else 'no (the Python model: about twenty times slower)'}")
    m = get_model("llama-3-8b")
    tm.estimate(m, micro_batch=2, seq_len=2048)  # compile once
    warm = median_ms(lambda i: tm.estimate(m, micro_batch=1 + i % 8, seq_len=2048), 2000)
    print(f"estimate() warm, llama-3-8b:            median {warm:.3f} ms   (goal <= 0.2 ms)")
    for name, opts in (("deepseek-v3", {}), ("gpt-oss-120b", {"attention": "eager"})):  # 61-layer MLA; 36-layer MoE
        big = get_model(name)
        tm.estimate(big, micro_batch=2, seq_len=2048, **opts)
        took = median_ms(lambda i, big=big, opts=opts: tm.estimate(big, micro_batch=1 + i % 8, seq_len=2048, **opts), 500)
        print(f"estimate() warm, {name + ':':<24s} median {took:.3f} ms")

    def cold(i: int) -> None:
        compile_step.cache_clear()
        tm.estimate(m, micro_batch=1 + i % 8, seq_len=2048, checkpointing=("none", "full")[i % 2])

    print(f"estimate() cold (program compiled):     median {median_ms(cold, 50):.2f} ms")
    # a batch shape not seen before: the step is compiled, the caching allocator is replayed (two steps)
    fresh = iter(range(9, 10_000))
    ms = median_ms(lambda i: tm.estimate(m, micro_batch=1, seq_len=next(fresh) * 8), 40)
    print(f"estimate() new batch shape, llama-3-8b (allocator replayed): median {ms:.1f} ms   (goal <= 0.5 ms)")
    # the shapes the explorer's sliders give (micro-batch 1-8, 1,024-4,096 tokens), on a 7B model: longer
    # sequences put the activations in the large pool, whose few sizes replay faster than the small pool's
    m7 = get_model("llama-2-7b")
    tm.estimate(m7, micro_batch=1, seq_len=2048)
    slider = iter(list(itertools.product(range(1, 9), range(1024, 4097, 8)))[::61])  # spread over the grid
    ms7 = median_ms(lambda i: tm.estimate(m7, micro_batch=(bs := next(slider))[0], seq_len=bs[1]), 40)
    print(f"estimate() new batch shape, llama-2-7b, micro-batch 1-8 x 1,024-4,096 tokens: median {ms7:.2f} ms   "
          f"(goal <= 0.5 ms: {'ok' if ms7 <= 0.5 else 'not met'})")
    # the replay alone: llama-2-7b's two steps (no loading) through the C allocator model, each trace built
    # once, at the slider shapes above (the same events, other sizes: the cache's buckets differ)
    from array import array

    from trainmem_nb.engine.allocator import parse_alloc_conf
    from trainmem_nb.engine.allocator.fast import replay_trace
    from trainmem_nb.engine.trace import trace_arrays
    from trainmem_nb.spec.training import TrainingSpec
    from trainmem_nb.step.compile import _SINGLE, program_key

    prog7 = compile_step(m7, program_key(TrainingSpec(micro_batch=1, seq_len=2048), m7), _SINGLE, unrolled=True)
    conf, none = parse_alloc_conf(None), array("q")
    traces = [trace_arrays(prog7, b, s) for b, s in list(itertools.product(range(1, 9), range(1024, 4097, 8)))[::61]]
    alone = sorted(median_ms(lambda i, tr=tr: replay_trace(none, *tr, conf), 20) for tr in traces)
    events = len(trace_arrays(prog7, 1, 2048)[0])
    print(f"  of which the replay alone (llama-2-7b, two steps, {events:,} events), over {len(alone)} slider shapes: "
          f"median {alone[len(alone) // 2]:.2f} ms, fastest {alone[0]:.2f} ms, slowest {alone[-1]:.2f} ms")
    # the explorer's expandable-segments toggle: the same replay with segments that grow in place
    es = dict(alloc_conf="expandable_segments:True")
    for name in ("llama-3-8b", "deepseek-v3"):
        tm.estimate(name, micro_batch=1, seq_len=1024, **es)
        ms = median_ms(lambda i, n=name: tm.estimate(n, micro_batch=1, seq_len=next(fresh) * 8, **es), 10)
        print(f"estimate() new batch shape, {name}, expandable_segments:True: median {ms:.1f} ms")
    # fp8 (torchao's eager casts: ~5x the events of a bf16 step, so its replay takes ~5x as long)
    tm.estimate(m, micro_batch=2, seq_len=2048, precision="fp8")
    warm8 = median_ms(lambda i: tm.estimate(m, micro_batch=1 + i % 8, seq_len=2048, precision="fp8"), 1000)
    new8 = median_ms(lambda i: tm.estimate(m, micro_batch=1, seq_len=next(fresh) * 16, precision="fp8"), 20)
    print(f"estimate() fp8, llama-3-8b: warm median {warm8:.3f} ms (goal <= 0.2 ms: {'ok' if warm8 <= 0.2 else 'OVER'}), "
          f"new batch shape median {new8:.1f} ms")
    # the litgpt stack's chunked head: one program per count of 128-token chunks, so a new micro-batch or a
    # sequence in the same band replays only, a new band compiles too
    lit = dict(method="lora", stack="litgpt")
    tm.estimate(m, micro_batch=2, seq_len=2048, **lit)
    warm_l = median_ms(lambda i: tm.estimate(m, micro_batch=1 + i % 8, seq_len=2048, **lit), 1000)
    band = median_ms(lambda i: tm.estimate(m, micro_batch=1, seq_len=1921 + next(fresh) % 127, **lit), 20)
    new_l = median_ms(lambda i: tm.estimate(m, micro_batch=1, seq_len=128 * (20 + next(fresh) % 40) + 5, **lit), 10)
    print(f"estimate() litgpt stack (chunked head), llama-3-8b LoRA: warm median {warm_l:.3f} ms, new shape in the "
          f"same 128-token band {band:.1f} ms, new band {new_l:.1f} ms")
    # the torchtune stack's chunked loss: one program per residue of the tokens modulo its 8 chunks
    tt = dict(method="lora", stack="torchtune")
    tm.estimate(m, micro_batch=2, seq_len=2048, **tt)
    new_t = median_ms(lambda i: tm.estimate(m, micro_batch=2, seq_len=4 * next(fresh), **tt), 20)
    print(f"estimate() torchtune stack (chunked loss), llama-3-8b LoRA: new batch shape, same residue, median "
          f"{new_t:.1f} ms")

    grid = list(itertools.product(range(1, 26), (128, 256, 512, 1024, 2048, 3072, 4096, 8192),
                                  ("bf16-mixed", "bf16-true"), ("none", "full"), ("adamw", "sgd"),
                                  ("sdpa", "eager", "flash"), ("cuda",), (1, 2, 4, 8, 16, 32, 64)))[:1_000]
    compile_step.cache_clear()
    t0 = time.perf_counter()
    for b, s, prec, ckpt, opt, attn, dev, ga in grid:
        tm.estimate(m, micro_batch=b, seq_len=s, precision=prec, checkpointing=ckpt, optimizer=opt,
                    attention=attn, device=dev, grad_accum=ga)
    total = time.perf_counter() - t0
    print(f"1,000 estimate() calls, one by one (cold cache, each shape replayed): {total:.2f} s")
    sweeps = {
        # 10,000 rows, 10 step programs (precision x optimizer) of 1,000 batch shapes each
        "10,000 rows, 10 programs": dict(
            micro_batch=list(range(1, 126)), seq_len=[128, 256, 512, 1024, 2048, 3072, 4096, 8192],
            precision=["bf16-mixed", "bf16-true"], optimizer=["adamw", "sgd", "adafactor", "lion", "adamw-8bit"]),
        # 16,000 rows over 80 programs: every option a notebook's what-if cell might sweep
        "16,000 rows, 80 programs": dict(
            micro_batch=list(range(1, 26)), seq_len=[128, 256, 512, 1024, 2048, 3072, 4096, 8192],
            precision=["bf16-mixed", "bf16-true"], optimizer=["adamw", "sgd", "adafactor", "lion", "adamw-8bit"],
            checkpointing=["none", "full"], attention=["sdpa", "flash"], grad_accum=[1, 4]),
    }
    for name, axes in sweeps.items():
        compile_step.cache_clear()
        for label in ("cold cache: programs compiled", "warm: what a notebook's second sweep costs"):
            t0 = time.perf_counter()
            df = tm.sweep(m, replay=False, **axes)
            took = time.perf_counter() - t0
            print(f"tm.sweep(replay=False), {name} ({label}): {len(df):,} rows in {took:.2f} s  "
                  "(goal <= 1 s for 10,000)")
    tm.sweep(m, micro_batch=[1], seq_len=[512])  # pandas imported
    t0 = time.perf_counter()
    df = tm.sweep(m, micro_batch=list(range(1, 26)), seq_len=[512, 1024, 2048, 4096])
    took = time.perf_counter() - t0
    print(f"tm.sweep with the allocator replayed, 100 rows: {took:.2f} s  ({1e3 * took / len(df):.1f} ms per row; "
          "goal <= 2 s for 10,000, not met)")
    for layout in (dict(gpus=8, engine="fsdp", zero=3), dict(gpus=8, zero=3), dict(gpus=16, tp=4, pp=4, nodes=2)):
        tm.estimate(m, micro_batch=1, seq_len=2048, **layout)
        ms = median_ms(lambda i, layout=layout: tm.estimate(m, micro_batch=1 + i % 4, seq_len=2048, **layout), 200)
        print(f"estimate() warm, per rank {layout!s:<42} median {ms:.3f} ms")
    for name in ("gpt2", "mixtral-8x7b", "llama-3.1-405b"):
        mm = get_model(name)
        tm.estimate(mm, micro_batch=1, seq_len=1024)
        print(f"estimate() warm, {name:<22} median {median_ms(lambda i, mm=mm: tm.estimate(mm, micro_batch=1 + i % 4, seq_len=1024), 500):.3f} ms")
    print("estimate() warm per family, its largest preset (goal <= 0.2 ms each):")
    for family, mm in _largest_per_family().items():
        opts = {"attention": "eager"} if family == "gpt_oss" else {}  # its sinks run eager
        seq = min(1024, mm.max_positions)
        tm.estimate(mm, micro_batch=1, seq_len=seq, **opts)
        took = median_ms(lambda i, mm=mm, opts=opts, seq=seq: tm.estimate(mm, micro_batch=1 + i % 4, seq_len=seq, **opts),
                         300)
        print(f"  {family:<12s} {mm.name:<28s} {mm.n_layers:>3d} layers  median {took:.3f} ms"
              f"  {'ok' if took <= 0.2 else 'OVER GOAL'}")
    for label, mm in _pattern_models().items():
        def first(i: int, mm: ModelSpec = mm) -> None:
            compile_step.cache_clear()
            tm.estimate(mm, micro_batch=1, seq_len=4096)

        print(f"estimate() cold (first), {label}: median {median_ms(first, 20):.2f} ms")
        print(f"estimate() warm,         {label}: median "
              f"{median_ms(lambda i, mm=mm: tm.estimate(mm, micro_batch=1 + i % 4, seq_len=4096), 500):.3f} ms")


def _largest_per_family() -> dict[str, ModelSpec]:
    """Each family's preset with the most parameters (the most layers and experts to evaluate)."""
    best: dict[str, tuple[int, ModelSpec]] = {}
    for p in list_presets():
        mm = get_model(p.name)
        if (p.n_params or 0) > best.get(mm.family.value, (-1, mm))[0]:
            best[mm.family.value] = (p.n_params or 0, mm)
    return {family: mm for family, (_n, mm) in sorted(best.items())}


def _pattern_models() -> dict[str, ModelSpec]:
    """Layer-pattern models of real shapes: DeepSeek-V3's 3 dense then 58 MoE layers (on a mixtral-style
    MoE layer) and Gemma 3 27B's five sliding-window layers then one global, 62 layers."""
    deep = ModelSpec(name="61-layer dense+MoE", family="mixtral", n_layers=61, hidden=7168, n_heads=128, n_kv_heads=128,
                     head_dim=128, ffn=18432, expert_ffn=2048, vocab=129280, n_experts=256, experts_top_k=8,
                     dense_layers=(0, 1, 2))
    types = (("sliding_attention",) * 5 + ("full_attention",)) * 10 + ("sliding_attention",) * 2
    gemma = ModelSpec(name="62-layer 5:1 sliding/global", family="mistral", n_layers=62, hidden=5376, n_heads=32,
                      n_kv_heads=16, head_dim=128, ffn=21504, vocab=262208, sliding_window=1024, layer_types=types)
    return {"61-layer dense then MoE   ": deep, "62-layer 5:1 sliding/global": gemma}


if __name__ == "__main__":
    main()
