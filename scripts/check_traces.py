"""Check the estimator's step, allocation by allocation, against measured fake-mode steps over a grid.

For each (family, options) case it compiles the step, runs the real Hugging Face model under
PyTorch's fake tensors, and compares the live bytes at every allocation of the forward and backward
(frees between two allocations are order-insensitive); it prints ``ok`` or the first divergence. A
stricter check than peaks alone: use it before and after changing a recipe.

Example: python scripts/check_traces.py --families llama,gemma --set dropout=0.1 --set precision=bf16-mixed
"""

from __future__ import annotations

import argparse
import itertools
import sys

from trainmem_nb.engine.program import _round
from trainmem_nb.measure.step import run_step
from trainmem_nb.measure.tracker import cuda_round
from trainmem_nb.model.spec import ModelSpec
from trainmem_nb.spec.training import TrainingSpec
from trainmem_nb.step.compile import compile_step

#: One small shape per family (GQA where the family has it).
SHAPES = {
    "llama": dict(n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, ffn=512, vocab=1000),
    "llama-mha": dict(family="llama", n_layers=3, hidden=256, n_heads=4, ffn=512, vocab=1000),
    "mistral": dict(n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, ffn=512, vocab=1000, sliding_window=32),
    "qwen2": dict(n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, ffn=512, vocab=1000, qkv_bias=True),
    "gemma": dict(n_layers=3, hidden=256, n_heads=4, n_kv_heads=1, head_dim=64, ffn=512, vocab=1000),
    "phi3": dict(n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, ffn=512, vocab=1000),
    "mixtral": dict(n_layers=3, hidden=128, n_heads=4, n_kv_heads=2, ffn=256, vocab=1000, n_experts=4, experts_top_k=2),
    "gpt2": dict(n_layers=3, hidden=256, n_heads=4, ffn=1024, vocab=1000, max_positions=1024),
    "gpt_neox": dict(n_layers=3, hidden=256, n_heads=4, ffn=1024, vocab=1000),
    "opt": dict(n_layers=3, hidden=256, n_heads=4, ffn=1024, vocab=1000, max_positions=1024),
    "bert": dict(n_layers=3, hidden=256, n_heads=4, ffn=1024, vocab=1000),
    "qwen3": dict(n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn=512, vocab=1000),
    "qwen3-window": dict(family="qwen3", n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn=512,
                         vocab=1000, sliding_window=32, layer_types=("full_attention",) + ("sliding_attention",) * 2),
    "qwen3-allslide": dict(family="qwen3", n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn=512,
                           vocab=1000, sliding_window=32, layer_types=("sliding_attention",) * 3),
    "smollm3": dict(n_layers=4, hidden=256, n_heads=4, n_kv_heads=2, ffn=512, vocab=1000, nope_layers=(3,)),
    "smollm3-nope-window": dict(family="smollm3", n_layers=4, hidden=256, n_heads=4, n_kv_heads=2, ffn=512, vocab=1000,
                                nope_layers=(1, 3), sliding_window=32, layer_types=("full_attention", "sliding_attention") * 2),
    "granite": dict(n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, ffn=512, vocab=1000),
    "granite-tied-bias": dict(family="granite", n_layers=3, hidden=256, n_heads=4, ffn=512, vocab=1000,
                              tie_embeddings=True, qkv_bias=True, out_bias=True, mlp_bias=True),
    "qwen3_moe": dict(n_layers=3, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn=256, vocab=1000, n_experts=4,
                      experts_top_k=2, expert_ffn=64),
    "qwen3_moe-norm-dense": dict(family="qwen3_moe", n_layers=3, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32,
                                 ffn=256, vocab=1000, n_experts=4, experts_top_k=2, expert_ffn=64, norm_topk_prob=True,
                                 dense_layers=(0,)),
    "phi": dict(n_layers=3, hidden=256, n_heads=4, ffn=1024, vocab=1000),
    "phi-gqa": dict(family="phi", n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, ffn=1024, vocab=1000),
    "starcoder2": dict(n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, ffn=1024, vocab=1000, sliding_window=32),
    "starcoder2-nowin": dict(family="starcoder2", n_layers=3, hidden=256, n_heads=4, ffn=1024,
                             vocab=1000, tie_embeddings=False),
    "olmo2": dict(n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, ffn=512, vocab=1000),
    "gemma2": dict(n_layers=4, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn=512, vocab=1000,
                   sliding_window=32),
    "gemma3": dict(n_layers=8, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn=512, vocab=1000,
                   sliding_window=32),
    "gpt_oss": dict(n_layers=3, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn=64, vocab=1000,
                    n_experts=4, experts_top_k=2, sliding_window=32,
                    layer_types=("sliding_attention", "full_attention", "sliding_attention")),
    "deepseek_v3": dict(n_layers=3, hidden=128, n_heads=4, head_dim=16, ffn=256, vocab=1000, n_experts=8,
                        experts_top_k=2, expert_ffn=32, n_shared_experts=1, n_expert_groups=4, topk_groups=2,
                        q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24,
                        dense_layers=(0,)),
    "deepseek_v3-eqv": dict(family="deepseek_v3", n_layers=3, hidden=128, n_heads=4, head_dim=16, ffn=256, vocab=1000,
                            n_experts=8, experts_top_k=2, expert_ffn=32, n_shared_experts=2, n_expert_groups=1,
                            topk_groups=1, q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                            v_head_dim=48, dense_layers=(0, 1), norm_topk_prob=False),
}


def first_divergence(m: ModelSpec, t: TrainingSpec) -> str | None:
    """None when the live bytes agree at every allocation of forward and backward, else where they part."""
    b, s = t.micro_batch, t.seq_len
    prog = compile_step(m, t)
    est = [(sign * _round(sz.at(b, s)), f"{seg.label}: {label}") for seg in prog.segments
           if seg.phase in ("forward", "backward") for _ in range(seg.repeat) for _c, sign, sz, label in seg.events]
    init = sum(_round(sz.at(b, s)) * count for _c, sz, count in prog.init)
    tr = run_step(m, t, "fake").tracker
    mea, base = [], 0
    for idx, sign in tr.events:
        r = tr.records[idx]
        if r.op == "adopt":
            base += sign * cuda_round(r.nbytes)
        elif r.phase in ("forward", "backward"):
            mea.append((sign * cuda_round(r.nbytes), f"{r.phase[:3]} {r.op} {r.module} {r.shape} {r.dtype}"))

    def at_allocs(seq: list[tuple[int, str]], live: int) -> list[tuple[int, int, str]]:
        out = []
        for d, label in seq:
            live += d
            if d > 0:
                out.append((live, d, label))
        return out

    ea, ma = at_allocs(est, init), at_allocs(mea, base)
    for i, (e, x) in enumerate(itertools.zip_longest(ea, ma, fillvalue=(0, 0, "(none)"))):
        if e[:2] != x[:2]:
            return f"alloc #{i}: est {e[2]} (+{e[1]}, live {e[0]}) | measured {x[2]} (+{x[1]}, live {x[0]})"
    return None


def _number(v: object) -> object:
    """A command-line value as the int or float it spells (the specs take no numeric strings)."""
    if isinstance(v, str):
        for kind in (int, float):
            try:
                return kind(v)
            except ValueError:
                pass
    return v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(SHAPES))
    ap.add_argument("--set", action="append", default=[], help="training option key=value (several: all combined)")
    ap.add_argument("--grid", action="append", default=[], help="key=v1|v2|... swept (product over --grid keys)")
    ap.add_argument("--batch", default="1|2")
    ap.add_argument("--seq", type=int, default=64)
    a = ap.parse_args(argv)
    fixed = dict(s.split("=", 1) for s in a.set)
    grid = [(k, v.split("|")) for k, v in (g.split("=", 1) for g in a.grid)]
    grid.append(("micro_batch", a.batch.split("|")))
    bad = 0
    for name in a.families.split(","):
        shape = dict(SHAPES[name])
        shape.setdefault("family", name)
        m = ModelSpec.model_validate({"name": name, **shape})
        for combo in itertools.product(*(vals for _k, vals in grid)):
            opts = {"device": "cpu", "seq_len": a.seq, **fixed, **dict(zip([k for k, _ in grid], combo, strict=True))}
            opts = {k: _number(v) for k, v in opts.items()}
            t = TrainingSpec.model_validate(opts)
            where = first_divergence(m, t)
            label = " ".join(f"{k}={v}" for k, v in opts.items() if k not in ("device", "seq_len"))
            print(f"{'ok  ' if where is None else 'DIFF'} {name:<10} {label}" + ("" if where is None else f"\n     {where}"))
            bad += where is not None
    print(f"{bad} cases differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
