"""Fingerprints of compiled step programs: the guard that a refactor changes no byte of any step.

A fingerprint is a hash of a compiled program's event stream, expanded over its repetitions (each
allocation and free: phase, detail category, sign and size form) and of what is alive before it,
a hash of the live bytes after each allocation at one odd batch shape (what a measurement sees: blind
to the order of frees between two allocations), and a hash of the numbers an estimate reports (peaks,
breakdowns, per-rank rows, host bytes, timeline maximum). Segment boundaries and labels are left out, so code may be restructured freely as
long as the step it describes is the same.

``tests/data/program_fingerprints.json`` holds the grid (every family, over precisions, optimizers,
checkpointing, attention kernels, LoRA/QLoRA, gradient accumulation and parallel layouts) with the
fingerprints recorded before a change. After a change meant to alter the numbers, re-record with
``python tests/fingerprints.py --write`` and review which entries moved (``--diff`` lists them).
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any

DATA = Path(__file__).with_name("data") / "program_fingerprints.json"

#: Small shapes of every family: GQA and MHA, tied and untied, biases, windows, MoE, post-norm.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-gqa": dict(family="llama", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, ffn=176, vocab=512),
    "llama-mha-tied-bias": dict(family="llama", n_layers=3, hidden=128, n_heads=4, ffn=256, vocab=1024,
                                tie_embeddings=True, qkv_bias=True, out_bias=True, mlp_bias=True),
    "mistral-window": dict(family="mistral", n_layers=4, hidden=128, n_heads=4, n_kv_heads=2, ffn=256, vocab=512,
                           sliding_window=64),
    "qwen2": dict(family="qwen2", n_layers=4, hidden=128, n_heads=4, n_kv_heads=2, ffn=256, vocab=1024),
    "gemma-mqa": dict(family="gemma", n_layers=4, hidden=128, n_heads=4, n_kv_heads=1, head_dim=64, ffn=512,
                      vocab=1024),
    "phi3-gqa": dict(family="phi3", n_layers=4, hidden=128, n_heads=8, n_kv_heads=4, ffn=320, vocab=1024),
    "phi3-window": dict(family="phi3", n_layers=2, hidden=128, n_heads=4, ffn=256, vocab=1024, sliding_window=64),
    "mixtral": dict(family="mixtral", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, ffn=128, vocab=512,
                    n_experts=4, experts_top_k=2),
    "gpt2": dict(family="gpt2", n_layers=4, hidden=64, n_heads=4, ffn=256, vocab=512, max_positions=1024),
    "gpt2-untied": dict(family="gpt2", n_layers=2, hidden=64, n_heads=4, ffn=256, vocab=512, max_positions=1024,
                        tie_embeddings=False),
    "neox": dict(family="gpt_neox", n_layers=4, hidden=64, n_heads=4, ffn=256, vocab=512),
    "neox-serial": dict(family="gpt_neox", n_layers=2, hidden=64, n_heads=4, ffn=256, vocab=512,
                        parallel_residual=False),
    "opt": dict(family="opt", n_layers=4, hidden=64, n_heads=4, ffn=256, vocab=512, max_positions=1024),
    "opt-postnorm-proj": dict(family="opt", n_layers=2, hidden=128, n_heads=4, ffn=256, vocab=512,
                              max_positions=1024, pre_norm=False, word_embed_proj_dim=64),
    "bert": dict(family="bert", n_layers=4, hidden=64, n_heads=4, ffn=256, vocab=512),
    "qwen3-gqa": dict(family="qwen3", n_layers=4, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn=256, vocab=1024),
    "qwen3-window-mqa": dict(family="qwen3", n_layers=3, hidden=128, n_heads=4, n_kv_heads=1, head_dim=32, ffn=256,
                             vocab=512, sliding_window=64,
                             layer_types=("full_attention", "sliding_attention", "sliding_attention")),
    "smollm3-nope": dict(family="smollm3", n_layers=4, hidden=128, n_heads=4, n_kv_heads=2, ffn=256, vocab=1024,
                         nope_layers=(3,)),
    "granite": dict(family="granite", n_layers=4, hidden=128, n_heads=4, n_kv_heads=2, ffn=256, vocab=1024),
    "qwen3_moe-dense": dict(family="qwen3_moe", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, head_dim=32, ffn=128,
                            vocab=512, n_experts=4, experts_top_k=2, expert_ffn=64, dense_layers=(0,)),
    "phi": dict(family="phi", n_layers=4, hidden=64, n_heads=4, ffn=256, vocab=512),
    "phi-gqa-tied": dict(family="phi", n_layers=2, hidden=128, n_heads=8, n_kv_heads=4, ffn=256, vocab=512,
                         tie_embeddings=True, rotary_pct=0.4),
    "starcoder2-window": dict(family="starcoder2", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, ffn=256, vocab=512,
                              sliding_window=64),
    "starcoder2-untied-nobias": dict(family="starcoder2", n_layers=2, hidden=128, n_heads=4, ffn=256, vocab=512,
                                     tie_embeddings=False, qkv_bias=False, out_bias=False, mlp_bias=False),
    "olmo2-gqa": dict(family="olmo2", n_layers=3, hidden=128, n_heads=4, n_kv_heads=2, ffn=256, vocab=512),
    "gemma2-window": dict(family="gemma2", n_layers=4, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn=256,
                          vocab=512, sliding_window=64),
    "gemma3-5to1": dict(family="gemma3", n_layers=8, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn=256,
                        vocab=512, sliding_window=64),
    # gpt_oss runs only eager attention (the sdpa variations record a refusal)
    "gpt-oss": dict(family="gpt_oss", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=64, vocab=512,
                    n_experts=4, experts_top_k=2, sliding_window=16,
                    layer_types=("sliding_attention", "full_attention") * 2),
    "deepseek-v3-mla": dict(family="deepseek_v3", n_layers=4, hidden=64, n_heads=4, head_dim=8, ffn=128, vocab=512,
                            n_experts=8, experts_top_k=2, expert_ffn=32, n_shared_experts=1, n_expert_groups=4,
                            topk_groups=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                            v_head_dim=16, dense_layers=(0,)),
}

BASE: dict[str, Any] = dict(micro_batch=2, seq_len=128, precision="bf16-mixed", optimizer="adamw")

#: One thing changed from `BASE` at a time.
VARIATIONS: dict[str, dict[str, Any]] = {
    "base": {},
    "fp32": dict(precision="fp32"),
    "fp16-mixed": dict(precision="fp16-mixed"),
    "bf16-true": dict(precision="bf16-true"),
    "fp16-true": dict(precision="fp16-true"),
    "fused": dict(optimizer_impl="fused"),
    "for-loop": dict(optimizer_impl="for-loop"),
    "sgd": dict(optimizer="sgd"),
    "sgd-momentum": dict(optimizer="sgd-momentum"),
    "adafactor": dict(optimizer="adafactor"),
    "lion": dict(optimizer="lion"),
    "adamw-8bit": dict(optimizer="adamw-8bit"),
    "paged-adamw": dict(optimizer="paged-adamw"),
    "no-optimizer": dict(optimizer="none"),
    "ckpt-full": dict(checkpointing="full"),
    "ckpt-selective": dict(checkpointing="selective"),
    "ckpt-selective-op": dict(checkpointing="selective-op"),
    "eager": dict(attention="eager"),
    "flash": dict(attention="flash"),
    "dropout": dict(dropout=0.1),
    "cpu": dict(device="cpu"),
    "cpu-dropout": dict(device="cpu", dropout=0.1),
    "cpu-eager-fp32": dict(device="cpu", attention="eager", precision="fp32"),
    "b1": dict(micro_batch=1),
    "short-seq": dict(seq_len=32),
    "ga2": dict(grad_accum=2),
    "first-step": dict(first_step=True),
    "lora-qv": dict(method="lora", lora_rank=8),
    "lora-all": dict(method="lora", lora_rank=4, lora_targets="all-linear"),
    "lora-base-dtype": dict(method="lora", lora_rank=4, precision="bf16-true", lora_dtype="base"),
    "lora-ckpt-dropout": dict(method="lora", lora_rank=8, checkpointing="full", lora_dropout=0.05),
    "qlora": dict(method="qlora", lora_rank=8, precision="bf16-true"),
    "qlora-all-fp32": dict(method="qlora", lora_rank=8, lora_targets="all-linear", precision="fp32",
                           qlora_double_quant=False),
    "ddp2": dict(gpus=2),
    "ddp2-zero1-bucket-view": dict(gpus=2, engine="ddp", zero=1, ddp_bucket_view=True),
    "fsdp4-z3": dict(gpus=4, engine="fsdp", zero=3),
    "fsdp4-z2": dict(gpus=4, engine="fsdp", zero=2),
    "fsdp4-z3-ga2": dict(gpus=4, engine="fsdp", zero=3, grad_accum=2),
    "fsdp4-z3-offload": dict(gpus=4, engine="fsdp", zero=3, offload="optimizer+params"),
    "fsdp4-z3-lora": dict(gpus=4, engine="fsdp", zero=3, method="lora", lora_rank=8),
    "fsdp4-z3-fp32": dict(gpus=4, engine="fsdp", zero=3, precision="fp32"),
    "ds4-z1": dict(gpus=4, engine="deepspeed", zero=1),
    "ds4-z2-ga2": dict(gpus=4, engine="deepspeed", zero=2, grad_accum=2),
    "ds4-z3": dict(gpus=4, engine="deepspeed", zero=3),
    "ds4-z3-offload": dict(gpus=4, engine="deepspeed", zero=3, offload="optimizer"),
    "ds4-z2-qlora": dict(gpus=4, engine="deepspeed", zero=2, method="qlora", lora_rank=8),
    "megatron-tp2": dict(gpus=2, engine="megatron", tp=2),
    "megatron-tp2-sp-dist-opt": dict(gpus=4, engine="megatron", tp=2, sp=True, zero=1),
    "pp2-1f1b": dict(gpus=2, pp=2, grad_accum=4),
    "pp2-interleaved": dict(gpus=2, pp=2, pp_schedule="interleaved", virtual_stages=2, grad_accum=4),
    "pp2-gpipe": dict(gpus=2, pp=2, pp_schedule="gpipe", grad_accum=2),
    "fsdp-pp2": dict(gpus=4, engine="fsdp", zero=3, pp=2, grad_accum=4),
    "fsdp-cp2": dict(gpus=4, engine="fsdp", zero=3, cp=2),
    "fsdp-tp2-sp": dict(gpus=4, engine="fsdp", zero=3, tp=2, sp=True),
    "ep2": dict(gpus=4, engine="fsdp", zero=3, ep=2),
    "loss-chunked": dict(loss_impl="chunked", loss_chunks=4),
    "loss-chunked-lora": dict(loss_impl="chunked", method="lora", lora_rank=8),
    "loss-liger": dict(loss_impl="liger"),
    "loss-liger-bf16-fsdp": dict(loss_impl="liger", precision="bf16-true", gpus=4, engine="fsdp", zero=3),
    "loss-cce": dict(loss_impl="cce"),
    "loss-cce-qlora": dict(loss_impl="cce", method="qlora", lora_rank=8),
    # the stacks' mechanisms (trainmem_nb.spec.stack)
    "zero-grad-keep": dict(zero_grad_set_to_none=False),
    "zero-grad-keep-fsdp": dict(zero_grad_set_to_none=False, gpus=4, engine="fsdp", zero=3),
    "qlora-bnb-saves-input": dict(method="qlora", lora_rank=8, precision="bf16-true", bnb_saves_input=True),
    "hf-4.47-loss": dict(causal_lm_loss="logits-shifted"),
    "hf-4.38-loss-lora": dict(causal_lm_loss="model-upcast", method="lora", lora_rank=8),
    "hf-4.30-loss-b1": dict(causal_lm_loss="no-upcast", micro_batch=1),
    "loop-keeps-outputs": dict(loop_keeps_outputs=True),
    "stack-litgpt-lora": dict(stack="litgpt", method="lora", lora_rank=8),
    "stack-litgpt-qlora-bnb-0.42": dict(stack="litgpt", bitsandbytes="0.42.0", method="qlora", lora_rank=8,
                                        grad_accum=2),
}

#: Random combinations per shape (seeded, stored with the data: the grid never changes silently).
_CHOICES: dict[str, list[Any]] = {
    "precision": ["fp32", "bf16-mixed", "fp16-mixed", "bf16-true"],
    "optimizer": ["adamw", "sgd-momentum", "adafactor", "adamw-8bit", "none"],
    "checkpointing": ["none", "full", "selective", "selective-op"],
    "attention": ["sdpa", "eager"],
    "dropout": [None, 0.1],
    "device": ["cuda", "cpu"],
    "micro_batch": [1, 3],
    "seq_len": [16, 96],
    "grad_accum": [1, 2],
    "method": ["full", "lora", "qlora"],
    "layout": [{}, dict(gpus=2), dict(gpus=4, engine="fsdp", zero=3), dict(gpus=4, engine="deepspeed", zero=2),
               dict(gpus=2, pp=2, grad_accum=2), dict(gpus=2, engine="megatron", tp=2)],
}
N_RANDOM = 6


def grid(seed: int = 11) -> dict[str, dict[str, Any]]:
    """Every (shape, options) case of the grid, by id."""
    rng = random.Random(seed)
    out: dict[str, dict[str, Any]] = {}
    for shape, model in SHAPES.items():
        for name, var in VARIATIONS.items():
            if name == "ep2" and "n_experts" not in model:
                continue
            out[f"{shape}/{name}"] = {"model": model, "options": {**BASE, **var}}
        for i in range(N_RANDOM):
            opts: dict[str, Any] = {}
            for key, values in _CHOICES.items():
                choice = rng.choice(values)
                if key == "layout":
                    opts.update(choice)
                elif key == "method" and choice != "full":
                    opts.update(method=choice, lora_rank=4)
                elif choice is not None or key == "dropout":
                    opts[key] = choice
            out[f"{shape}/random{i}"] = {"model": model, "options": opts}
    return out


def _plain(x: Any) -> Any:
    """A JSON-ready copy of a compiled program's pieces (size forms as lists of floats)."""
    if isinstance(x, tuple | list):
        return [_plain(v) for v in x]
    return x


def program_fingerprint(prog: Any) -> str:
    """Hash of what is alive before the step (merged by category and size) and of the step's event
    stream, expanded over each segment's repetitions: (phase, category, +k/-k, size form)."""
    from trainmem_nb.engine.breakdown import DETAIL_KEYS

    init: dict[tuple[str, tuple[float, ...]], int] = {}
    for cat, sz, count in prog.init:
        key = (DETAIL_KEYS[cat], tuple(float(v) for v in sz))
        init[key] = init.get(key, 0) + count
    h = hashlib.sha256()
    h.update(json.dumps(sorted([k[0], list(k[1]), c] for k, c in init.items() if c)).encode())
    h.update(json.dumps([prog.n_params, prog.n_trainable]).encode())
    for seg in prog.segments:
        stream = json.dumps([[seg.phase, DETAIL_KEYS[cat], sign, [float(v) for v in sz]]
                             for cat, sign, sz, _label in seg.events]).encode()
        for _ in range(seg.repeat):
            h.update(stream)
    return h.hexdigest()[:24]


#: Keys of the JSON contract left out of the numbers: labels that name code locations, and the echo of
#: the inputs (a spec that gains a field with a default describes the same step).
_NOT_NUMBERS = ("peak_at", "model_spec", "training", "parallel", "calibration", "reserved_from", "stack")


#: An odd batch shape at which `live_fingerprint` evaluates a program (no coincidences of b*s with dims).
LIVE_SHAPE = (3, 37)


def live_fingerprint(prog: Any) -> str:
    """Hash of the live bytes right after each allocation of the expanded event stream at `LIVE_SHAPE`:
    what a measurement sees. Unlike `program_fingerprint` it is blind to the order of frees between two
    allocations, so a refactor that only reorders frees keeps it."""
    from trainmem_nb.engine.program import _round

    b, s = LIVE_SHAPE
    live = sum(_round(sz.at(b, s)) * count for _cat, sz, count in prog.init)
    out = []
    for seg in prog.segments:
        sizes = [(sign, _round(sz.at(b, s))) for _cat, sign, sz, _label in seg.events]
        for _ in range(seg.repeat):
            for sign, n in sizes:
                live += sign * n
                if sign > 0:
                    out.append(live)
    return hashlib.sha256(json.dumps(out).encode()).hexdigest()[:24]


def _strip(x: Any) -> Any:
    """The numbers of an estimate's JSON contract, without labels and the echo of its inputs."""
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in _NOT_NUMBERS}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


def numbers_fingerprint(est: Any) -> str:
    """Hash of the estimate's JSON contract (labels aside) and of its timeline's maximum."""
    data = _strip(est.to_dict())
    data["timeline_max"] = max(p.total_bytes for p in est.timeline())
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:24]


def fingerprint(case: dict[str, Any]) -> dict[str, str]:
    """Both fingerprints of one grid case, or its one-line refusal (an invalid combination)."""
    import trainmem_nb as tm
    from trainmem_nb.errors import SpecError
    from trainmem_nb.model.spec import ModelSpec

    m = ModelSpec.model_validate({"name": "fingerprint", **case["model"]})
    try:
        est = tm.estimate(m, **case["options"])
    except SpecError as exc:
        return {"refused": str(exc)}
    return {"program": program_fingerprint(est.program), "live": live_fingerprint(est.program),
            "numbers": numbers_fingerprint(est)}


def record() -> dict[str, Any]:
    """The grid with the current code's fingerprints."""
    return {cid: {**case, **fingerprint(case)} for cid, case in grid().items()}


def main(argv: list[str]) -> int:
    if "--write" in argv:
        DATA.parent.mkdir(exist_ok=True)
        DATA.write_text(json.dumps(record(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {DATA}")
        return 0
    if "--diff" in argv:
        stored = json.loads(DATA.read_text())
        changed = 0
        for cid, case in stored.items():
            now = fingerprint(case)
            for key in ("program", "live", "numbers", "refused"):
                if now.get(key) != case.get(key):
                    changed += 1
                    print(f"{cid}: {key} {case.get(key)} -> {now.get(key)}")
        print(f"{changed} changed of {len(stored)}")
        return 1 if changed else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main(sys.argv[1:]))
