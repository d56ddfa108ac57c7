"""The shipped dataset of measured training steps (``trainmem_nb/data/measured/cases.jsonl``, package
data) and how to regenerate it.

Every case is one `Measurement` (``to_dict()`` without the timeline) plus ``id``, ``group`` and
``source``, one JSON object per line, sorted by id. Its ``measured_with`` block says how (device/mode,
torch, transformers, peft and python versions, threads, date, timing). Device semantics are CPU
kernels: compare a case with ``estimate(case.model, case.training)``, whose ``training.device`` is
``cpu``.

Regenerate everything (299 cases, 10-15 minutes on 2 cores)::

    python -m trainmem_nb.measure.dataset            # (trainmem validate --remeasure --out DIR: a copy in DIR)
    python -m trainmem_nb.measure.dataset --only gemma --keep   # re-measure a subset, keep the rest

`load_cases` reads the file without torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..model.spec import ModelSpec
from ..spec.choices import AdafactorImpl, OptimizerName
from ..spec.training import TrainingSpec
from .paths import CASES_FILE, HARNESS_FILE, VALIDATION_DIR
from .result import Measurement

__all__ = ["VALIDATION_DIR", "CaseSpec", "MeasuredCase", "full_matrix", "load_cases", "main", "quick_matrix"]



@dataclass(frozen=True)
class CaseSpec:
    """One step to measure: a model, a training setup and how (``fake`` or ``cpu``)."""

    id: str
    group: str
    model: ModelSpec
    training: TrainingSpec
    mode: str = "fake"
    source: str = "trainmem_nb.measure.dataset"

    @property
    def steady_state(self) -> bool:
        """False for a first step (``training.first_step``)."""
        return not self.training.first_step


@dataclass(frozen=True)
class MeasuredCase:
    """A stored case: what was measured (`measurement`) and under which id and group."""

    id: str
    group: str
    source: str
    measurement: Measurement

    @property
    def model(self) -> ModelSpec:
        """The model that was measured."""
        return self.measurement.model

    @property
    def training(self) -> TrainingSpec:
        """The training setup (device ``cpu``: CPU-kernel semantics)."""
        return self.measurement.training

    @property
    def mode(self) -> str:
        """``fake`` (FakeTensorMode) or ``cpu`` (real tensors)."""
        return self.measurement.mode

    @property
    def steady_state(self) -> bool:
        """False for a first step (``training.first_step``: optimizer state created inside it)."""
        return not self.measurement.training.first_step


def load_cases(path: str | Path | None = None, steady_state_only: bool = False,
               what: str = "dataset") -> list[MeasuredCase]:
    """The measured cases of the shipped dataset (or `path`), without importing torch.

    >>> cases = load_cases()  # doctest: +SKIP
    >>> c = cases[0]; c.id, c.measurement.peak_allocated_bytes, c.measurement.breakdown_bytes  # doctest: +SKIP
    """
    from ..errors import SpecError, parse_json, read_text_file

    file = Path(path) if path is not None else CASES_FILE
    if not file.exists():
        if path is None:
            raise SpecError(f"the measured dataset is missing from this installation ({file}); reinstall "
                            "trainmem_nb, or pass the path of a cases.jsonl (trainmem validate --from-dataset PATH)")
        raise SpecError(f"{what} {file}: no such file")
    out = []
    for n, line in enumerate(read_text_file(file, what).splitlines(), 1):
        if not line.strip():
            continue
        try:
            data = parse_json(line, f"{what} {file} line {n}")
            if not isinstance(data, dict):
                raise SpecError(f"{what} {file} line {n}: not a measured case (a JSON object per line)")
            case = MeasuredCase(str(data["id"]), str(data.get("group", "")), str(data.get("source", "")),
                                Measurement.from_dict(data))
        except SpecError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SpecError(f"{what} {file} line {n}: not a measured case: {str(exc).splitlines()[0]}") from None
        if case.steady_state or not steady_state_only:
            out.append(case)
    return out


# -- the matrix ---------------------------------------------------------------------------------------

def _m(family: str, name: str, **kw: Any) -> ModelSpec:
    return ModelSpec.model_validate({"family": family, "name": name, **kw})


def _preset(preset: str, **overrides: Any) -> ModelSpec:
    from ..model.presets import get_model

    spec = get_model(preset)
    if not overrides:
        return spec
    data = spec.model_dump()
    data.update(overrides)
    return ModelSpec.model_validate(data)


#: Small shapes of every family (tiny and "small" widths, GQA and not, tied and untied, biases).
def _small_shapes() -> list[ModelSpec]:
    return [
        _m("llama", "llama-tiny-gqa", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=176, vocab=512),
        _m("llama", "llama-small-mha-tied", n_layers=4, hidden=256, n_heads=8, ffn=688, vocab=2048, tie_embeddings=True),
        _m("llama", "llama-small-bias", n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, ffn=512, vocab=1024,
           qkv_bias=True, out_bias=True, mlp_bias=True),
        _m("mistral", "mistral-tiny-window", n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, ffn=256, vocab=512,
           sliding_window=64),
        _m("mistral", "mistral-small", n_layers=4, hidden=256, n_heads=8, n_kv_heads=4, ffn=768, vocab=2048),
        _m("qwen2", "qwen2-tiny", n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, ffn=256, vocab=1024),
        _m("qwen2", "qwen2-small-tied", n_layers=4, hidden=256, n_heads=8, n_kv_heads=2, ffn=704, vocab=4096,
           tie_embeddings=True),
        _m("gemma", "gemma-tiny-mqa", n_layers=2, hidden=128, n_heads=4, n_kv_heads=1, head_dim=64, ffn=512, vocab=1024),
        _m("gemma", "gemma-small", n_layers=4, hidden=256, n_heads=4, n_kv_heads=4, head_dim=64, ffn=1024, vocab=4096),
        _m("phi3", "phi3-tiny", n_layers=2, hidden=128, n_heads=4, ffn=256, vocab=1024),
        _m("phi3", "phi3-small-gqa", n_layers=4, hidden=256, n_heads=8, n_kv_heads=4, ffn=640, vocab=2048),
        _m("mixtral", "mixtral-tiny", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=128, vocab=512,
           n_experts=4, experts_top_k=2),
        _m("mixtral", "mixtral-small", n_layers=3, hidden=256, n_heads=8, n_kv_heads=2, ffn=512, vocab=2048,
           n_experts=8, experts_top_k=2),
        _m("gpt2", "gpt2-tiny", n_layers=2, hidden=64, n_heads=4, ffn=256, vocab=512, max_positions=1024),
        _m("gpt2", "gpt2-small-untied", n_layers=4, hidden=256, n_heads=8, ffn=1024, vocab=4096, max_positions=1024,
           tie_embeddings=False),
        _m("gpt_neox", "neox-tiny", n_layers=2, hidden=64, n_heads=4, ffn=256, vocab=512),
        _m("gpt_neox", "neox-small-serial", n_layers=4, hidden=256, n_heads=8, ffn=1024, vocab=4096,
           parallel_residual=False),
        _m("opt", "opt-tiny", n_layers=2, hidden=64, n_heads=4, ffn=256, vocab=512, max_positions=1024),
        _m("opt", "opt-small-postnorm-proj", n_layers=4, hidden=256, n_heads=8, ffn=1024, vocab=4096,
           max_positions=1024, pre_norm=False, word_embed_proj_dim=128),
        _m("bert", "bert-tiny", n_layers=2, hidden=64, n_heads=4, ffn=256, vocab=512),
        _m("bert", "bert-small", n_layers=4, hidden=256, n_heads=4, ffn=1024, vocab=4096),
        _m("qwen3", "qwen3-tiny-gqa", n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, head_dim=64, ffn=256, vocab=1024),
        _m("qwen3", "qwen3-small-tied-mqa", n_layers=4, hidden=256, n_heads=8, n_kv_heads=1, head_dim=32, ffn=704,
           vocab=4096, tie_embeddings=True),
        _m("qwen3", "qwen3-small-window", n_layers=3, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn=512,
           vocab=2048, sliding_window=32, layer_types=("full_attention", "sliding_attention", "sliding_attention")),
        _m("smollm3", "smollm3-tiny-nope", n_layers=4, hidden=128, n_heads=4, n_kv_heads=2, ffn=256, vocab=1024,
           nope_layers=(3,)),
        _m("smollm3", "smollm3-small-bias-window", n_layers=4, hidden=256, n_heads=8, n_kv_heads=4, ffn=512, vocab=2048,
           nope_layers=(1, 3), qkv_bias=True, out_bias=True, mlp_bias=True, sliding_window=32,
           layer_types=("full_attention", "sliding_attention") * 2),
        _m("granite", "granite-tiny-gqa", n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, ffn=256, vocab=1024),
        _m("granite", "granite-small-tied-bias", n_layers=4, hidden=256, n_heads=8, n_kv_heads=2, ffn=704, vocab=4096,
           tie_embeddings=True, qkv_bias=True, out_bias=True, mlp_bias=True),
        _m("qwen3_moe", "qwen3_moe-tiny", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=32, ffn=128,
           vocab=512, n_experts=4, experts_top_k=2, expert_ffn=64),
        _m("qwen3_moe", "qwen3_moe-small-norm-dense", n_layers=3, hidden=256, n_heads=8, n_kv_heads=2, head_dim=64,
           ffn=512, vocab=2048, n_experts=8, experts_top_k=2, expert_ffn=128, norm_topk_prob=True, dense_layers=(0,)),
        _m("phi", "phi-tiny", n_layers=2, hidden=64, n_heads=4, ffn=256, vocab=512),
        _m("phi", "phi-small-gqa-tied", n_layers=4, hidden=256, n_heads=8, n_kv_heads=4, ffn=1024, vocab=2048,
           tie_embeddings=True, rotary_pct=0.4),
        _m("phi", "phi-tiny-qk-layernorm", n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, ffn=256, vocab=512,
           qk_layernorm=True),
        _m("starcoder2", "starcoder2-tiny-window", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=256, vocab=512,
           sliding_window=32),
        _m("starcoder2", "starcoder2-small-untied-nobias", n_layers=4, hidden=256, n_heads=8, n_kv_heads=2, ffn=1024,
           vocab=2048, tie_embeddings=False, qkv_bias=False, out_bias=False, mlp_bias=False),
        _m("olmo2", "olmo2-tiny", n_layers=2, hidden=64, n_heads=4, ffn=176, vocab=512),
        _m("olmo2", "olmo2-small-gqa", n_layers=4, hidden=256, n_heads=8, n_kv_heads=2, ffn=688, vocab=2048),
        _m("gemma2", "gemma2-tiny", n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn=512, vocab=1024,
           sliding_window=32),
        _m("gemma2", "gemma2-small-nocap", n_layers=4, hidden=256, n_heads=4, n_kv_heads=1, head_dim=64, ffn=1024,
           vocab=4096, sliding_window=48, attn_softcap=0.0, final_softcap=0.0),
        _m("gemma3", "gemma3-tiny", n_layers=3, hidden=128, n_heads=4, n_kv_heads=1, head_dim=32, ffn=512, vocab=1024,
           sliding_window=32, layer_types=("sliding_attention", "full_attention", "sliding_attention")),
        _m("gemma3", "gemma3-small-5to1", n_layers=8, hidden=256, n_heads=4, n_kv_heads=2, head_dim=64, ffn=1024,
           vocab=4096, sliding_window=48),
    ]


#: Real shapes (presets), tiny to 7B class, measured in fake mode.
_LARGE = ["gpt2", "gpt2-medium", "gpt2-xl", "tinyllama-1.1b", "llama-3.2-1b", "llama-2-7b", "llama-3-8b",
          "mistral-7b", "qwen2.5-0.5b", "qwen2.5-7b", "gemma-2b", "gemma-7b", "phi-3-mini", "pythia-160m",
          "pythia-1.4b", "pythia-6.9b", "opt-125m", "opt-350m", "opt-1.3b", "opt-6.7b", "bert-base", "bert-large",
          "qwen3-0.6b", "smollm3-3b", "granite-3.1-2b", "phi-1.5", "starcoder2-3b"]

#: Real widths with fewer layers: option sweeps run fast but keep realistic ratios of h, ffn and vocab.
_SWEEP_MODELS = {
    "llama": ("llama-2-7b", {"n_layers": 2, "name": "llama-2-7b-2L"}),
    "qwen2": ("qwen2.5-0.5b", {"n_layers": 4, "name": "qwen2.5-0.5b-4L"}),
    "gpt2": ("gpt2", {"n_layers": 4, "name": "gpt2-4L"}),
    "gpt_neox": ("pythia-410m", {"n_layers": 4, "name": "pythia-410m-4L"}),
    "bert": ("bert-base", {"n_layers": 4, "name": "bert-base-4L"}),
    "mixtral": ("mixtral-8x7b", {"n_layers": 1, "name": "mixtral-8x7b-1L"}),
    "mistral": ("mistral-7b", {"n_layers": 2, "name": "mistral-7b-2L"}),
    "gemma": ("gemma-2b", {"n_layers": 2, "name": "gemma-2b-2L"}),
    "phi3": ("phi-3-mini", {"n_layers": 2, "name": "phi-3-mini-2L"}),
    "opt": ("opt-1.3b", {"n_layers": 3, "name": "opt-1.3b-3L"}),
    "qwen3": ("qwen3-8b", {"n_layers": 2, "name": "qwen3-8b-2L"}),
    "smollm3": ("smollm3-3b", {"n_layers": 4, "name": "smollm3-3b-4L", "nope_layers": (3,)}),
    "granite": ("granite-3.1-8b", {"n_layers": 2, "name": "granite-3.1-8b-2L"}),
    "qwen3_moe": ("qwen3-30b-a3b", {"n_layers": 2, "name": "qwen3-30b-a3b-2L"}),
    "phi": ("phi-2", {"n_layers": 2, "name": "phi-2-2L"}),
    "starcoder2": ("starcoder2-7b", {"n_layers": 2, "name": "starcoder2-7b-2L"}),
}


def _t(**kw: Any) -> TrainingSpec:
    base: dict[str, Any] = {"device": "cpu", "dropout": 0.0, "precision": "fp32", "optimizer": "adamw",
                            "optimizer_impl": "foreach"}
    base.update(kw)
    if base["optimizer"] == "none" or base.get("adafactor") == "transformers":  # one implementation only
        base["optimizer_impl"] = None
    return TrainingSpec.model_validate(base)


def _case_id(group: str, m: ModelSpec, t: TrainingSpec, mode: str) -> str:
    parts = [t.precision.value] + ([f"fp8-{t.fp8.value}"] if t.fp8.value != "none" else []) + [t.optimizer.value]
    if t.optimizer is OptimizerName.ADAFACTOR and t.adafactor is AdafactorImpl.TRANSFORMERS:
        parts.append("transformers")
    elif t.optimizer.value != "none":
        parts.append(t.resolved_optimizer_impl.value)
    if t.checkpointing.value != "none":
        parts.append(f"ckpt-{t.checkpointing.value}")
    if t.attention.value != "sdpa":
        parts.append(t.attention.value)
    if t.dropout:
        parts.append(f"drop{t.dropout:g}")
    if t.method.value != "full":
        parts.append(f"lora{t.lora_rank}-{t.lora_targets.replace(',', '+')}"
                     + (f"-ld{t.lora_dropout:g}" if t.lora_dropout else "")
                     + ("-base-dtype" if t.lora_dtype.value == "base" else ""))
    if t.first_step:
        parts.append("first-step")
    shape = f"b{t.micro_batch}s{t.seq_len}" + (f"ga{t.grad_accum}" if t.grad_accum > 1 else "")
    return f"{group}/{m.name}/{'-'.join(parts)}/{shape}/{mode}"


def _cases(group: str, models: Iterable[ModelSpec], trainings: Iterable[TrainingSpec], mode: str = "fake") -> list[CaseSpec]:
    trainings = list(trainings)
    return [CaseSpec(_case_id(group, m, t, mode), group, m, t, mode) for m in models for t in trainings]


def _sweep_options() -> list[TrainingSpec]:
    """Options around a bf16-mixed AdamW baseline: one thing changed at a time, and a few combinations."""
    b = {"micro_batch": 2, "seq_len": 256, "precision": "bf16-mixed"}
    return [
        _t(**b),
        _t(**{**b, "precision": "fp32"}),
        _t(**{**b, "precision": "bf16-true"}),
        _t(**{**b, "precision": "fp16-mixed"}),
        _t(**{**b, "optimizer_impl": "fused"}),
        _t(**{**b, "optimizer_impl": "for-loop"}),
        _t(**{**b, "optimizer": "adam"}),
        _t(**{**b, "optimizer": "sgd"}),
        _t(**{**b, "optimizer": "sgd-momentum"}),
        _t(**{**b, "optimizer": "adafactor"}),
        _t(**{**b, "optimizer": "none"}),
        _t(**{**b, "checkpointing": "full"}),
        _t(**{**b, "checkpointing": "selective"}),
        _t(**{**b, "attention": "eager"}),
        _t(**{**b, "dropout": 0.1}),
        _t(**{**b, "attention": "eager", "dropout": 0.1}),
        _t(**{**b, "method": "lora", "lora_rank": 16, "lora_alpha": 32, "lora_targets": "qv"}),
        _t(**{**b, "method": "lora", "lora_rank": 8, "lora_alpha": 16, "lora_targets": "all-linear",
              "precision": "bf16-true"}),
        _t(**{**b, "method": "lora", "lora_rank": 16, "lora_alpha": 32, "lora_targets": "qv",
              "checkpointing": "full", "lora_dropout": 0.05}),
        _t(micro_batch=1, seq_len=1024, precision="bf16-mixed"),
        _t(micro_batch=8, seq_len=128, precision="bf16-mixed", checkpointing="full"),
        _t(**{**b, "method": "lora", "lora_rank": 8, "lora_alpha": 16, "lora_targets": "all-linear",
              "precision": "bf16-true", "lora_dtype": "base"}),
        _t(**{**b, "checkpointing": "selective-op"}),
        _t(**{**b, "grad_accum": 2}),
        _t(**{**b, "precision": "fp16-mixed", "grad_accum": 3, "checkpointing": "full"}),
    ]


def full_matrix() -> list[CaseSpec]:
    """Every case of the shipped dataset (harness cases come from ``data/measured/harness_cases.json``)."""
    cases: list[CaseSpec] = []
    small = _small_shapes()
    small_trainings = [
        _t(micro_batch=2, seq_len=64),
        _t(micro_batch=1, seq_len=128, precision="bf16-mixed", optimizer_impl="for-loop", checkpointing="full"),
        _t(micro_batch=4, seq_len=32, precision="bf16-true", optimizer_impl="fused", attention="eager"),
        _t(micro_batch=2, seq_len=64, precision="fp32", optimizer="sgd-momentum", checkpointing="selective",
           dropout=0.1),
        _t(micro_batch=2, seq_len=64, precision="bf16-mixed", checkpointing="selective-op", grad_accum=2),
    ]
    cases += _cases("families", small, small_trainings)
    big_trainings = [
        _t(micro_batch=1, seq_len=512, precision="bf16-mixed"),
        _t(micro_batch=2, seq_len=1024, precision="bf16-true", optimizer_impl="fused", checkpointing="full"),
    ]
    for name in _LARGE:
        m = _preset(name)
        fitted = [t if t.seq_len <= m.max_positions else _t(**{**t.model_dump(), "seq_len": m.max_positions})
                  for t in big_trainings]  # learned positions (bert: 512) bound the sequence
        cases += _cases("presets", [m], fitted)
    cases += _cases("presets", [_preset("mixtral-8x7b", n_layers=4, name="mixtral-8x7b-4L")],
                    [_t(micro_batch=1, seq_len=256, precision="bf16-mixed")])
    sweep_models = {fam: _preset(name, **kw) for fam, (name, kw) in _SWEEP_MODELS.items()}
    cases += _cases("options", [sweep_models["llama"]], _sweep_options())
    for fam in ("qwen2", "gpt2", "gpt_neox", "bert", "mixtral"):
        opts = _sweep_options()
        pick = [0, 1, 2, 4, 7, 9, 11, 12, 13, 14, 16, 17]
        cases += _cases("options", [sweep_models[fam]], [opts[i] for i in pick])
    # peft's ParamWrapper LoRA on mixtral's router and 3-D experts (all-linear): other precisions, checkpointing,
    # fp32-or-base adapters and another batch shape than the sweep's bf16-true case
    moe_lora: dict[str, Any] = {"method": "lora", "lora_rank": 8, "lora_alpha": 16, "lora_targets": "all-linear"}
    cases += _cases("options", [sweep_models["mixtral"]], [
        _t(micro_batch=2, seq_len=256, precision="bf16-mixed", **moe_lora),
        _t(micro_batch=1, seq_len=512, precision="bf16-true", checkpointing="full", **moe_lora),
        _t(micro_batch=4, seq_len=128, precision="bf16-true", lora_dtype="base", **moe_lora),
    ])
    # all-linear also adapts linears outside the layers: OPT-350m's project_in / project_out
    cases += _cases("options", [_preset("opt-350m", n_layers=2, name="opt-350m-2L")], [
        _t(micro_batch=2, seq_len=256, precision="bf16-mixed", **moe_lora),
        _t(micro_batch=2, seq_len=256, precision="bf16-true", optimizer_impl="for-loop", checkpointing="full",
           **moe_lora),
    ])
    for fam in ("mistral", "gemma", "phi3", "opt"):
        opts = _sweep_options()
        pick = [0, 2, 5, 8, 10, 11, 12, 15, 16, 20]
        cases += _cases("options", [sweep_models[fam]], [opts[i] for i in pick])
    # issue 12's families: the option sweep with LoRA (qv; all-linear in bf16-true), checkpointing, eager, dropout
    for fam in ("qwen3", "smollm3", "granite", "qwen3_moe"):
        opts = _sweep_options()
        pick = [0, 1, 2, 4, 7, 9, 11, 12, 13, 14, 16, 17]
        cases += _cases("options", [sweep_models[fam]], [opts[i] for i in pick])
    # peft's ParamWrapper LoRA on Qwen3-MoE's router and experts (all-linear), as for mixtral above
    cases += _cases("options", [sweep_models["qwen3_moe"]], [
        _t(micro_batch=2, seq_len=256, precision="bf16-mixed", **moe_lora),
        _t(micro_batch=1, seq_len=512, precision="bf16-true", checkpointing="full", **moe_lora),
    ])
    for fam in ("phi", "starcoder2"):  # the families of issue 12: the first sweep's picks plus both checkpointings
        opts = _sweep_options()
        cases += _cases("options", [sweep_models[fam]], [opts[i] for i in (0, 1, 2, 4, 7, 11, 12, 13, 14, 16, 17)])
    # olmo2, gemma2, gemma3 at real widths with few layers (gemma's layer types cut to match): the
    # baseline, both checkpointing policies, eager attention, LoRA on q/v and all-linear
    for preset, layers in (("olmo-2-1b", 2), ("gemma-2-2b", 2), ("gemma-3-1b", 6)):
        types = _preset(preset).layer_types[:layers]
        model = _preset(preset, n_layers=layers, layer_types=types, name=f"{preset}-{layers}L")
        opts = _sweep_options()
        cases += _cases("options", [model], [opts[i] for i in (0, 11, 12, 13, 16, 17)])
    cases += _cases("cpu-real", [small[0], small[13], small[19]], [_t(micro_batch=2, seq_len=64)], mode="cpu")
    cases += moe_family_cases()
    cases += fp8_cases()
    cases += hf_adafactor_cases()
    cases += gemma3_vision_cases()
    cases += harness_matrix()
    ids = [c.id for c in cases]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise AssertionError(f"duplicate case ids: {dupes[:3]}")
    return cases


def moe_family_cases() -> list[CaseSpec]:
    """gpt_oss (eager attention only: transformers 5.24 refuses SDPA for it; ``selective`` checkpointing
    fails in PyTorch on its in-place expert biases, so ``selective-op``) and deepseek_v3: small shapes over
    precisions, optimizers, checkpointing, attention kernels, dropout and LoRA, and the first layers of
    gpt-oss-20b and DeepSeek-V3 at real widths."""
    eager: dict[str, Any] = {"attention": "eager"}
    oss = [_m("gpt_oss", "gpt-oss-tiny", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=64,
              vocab=512, n_experts=4, experts_top_k=2, sliding_window=16,
              layer_types=("sliding_attention", "full_attention")),
           _m("gpt_oss", "gpt-oss-small", n_layers=4, hidden=128, n_heads=8, n_kv_heads=2, head_dim=32, ffn=96,
              vocab=1024, n_experts=8, experts_top_k=4, sliding_window=32,
              layer_types=("sliding_attention", "full_attention") * 2)]
    lora: dict[str, Any] = {"method": "lora", "lora_rank": 8, "lora_alpha": 16}
    cases = _cases("families", oss, [
        _t(micro_batch=2, seq_len=64, **eager),
        _t(micro_batch=1, seq_len=128, precision="bf16-mixed", optimizer_impl="for-loop", checkpointing="full", **eager),
        _t(micro_batch=4, seq_len=32, precision="bf16-true", optimizer_impl="fused", **eager),
        _t(micro_batch=2, seq_len=64, optimizer="sgd-momentum", checkpointing="selective-op", dropout=0.1, **eager),
        _t(micro_batch=2, seq_len=64, precision="bf16-mixed", lora_targets="qv", **lora, **eager),
        _t(micro_batch=2, seq_len=64, precision="bf16-true", lora_targets="all-linear", checkpointing="full",
           **lora, **eager),
    ])
    cases += _cases("presets", [_preset("gpt-oss-20b").layer_slice(0, 2).model_copy(update={"name": "gpt-oss-20b-2L"})],
                    [_t(micro_batch=1, seq_len=256, precision="bf16-mixed", **eager)])
    # deepseek_v3: MLA (v_head_dim != q/k head dim: SDPA's math kernel on CPU), dense then MoE layers
    ds = [_m("deepseek_v3", "deepseek-v3-tiny", n_layers=2, hidden=64, n_heads=4, head_dim=8, ffn=128, vocab=512,
             n_experts=8, experts_top_k=2, expert_ffn=32, n_shared_experts=1, n_expert_groups=4, topk_groups=2,
             q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
             dense_layers=(0,)),
          _m("deepseek_v3", "deepseek-v3-small-noqlora", n_layers=4, hidden=128, n_heads=4, head_dim=16, ffn=256,
             vocab=1024, n_experts=8, experts_top_k=3, expert_ffn=32, n_shared_experts=2, n_expert_groups=2,
             topk_groups=1, q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24,
             dense_layers=(0, 1), norm_topk_prob=False)]
    cases += _cases("families", ds, [
        _t(micro_batch=2, seq_len=64),
        _t(micro_batch=1, seq_len=128, precision="bf16-mixed", optimizer_impl="for-loop", checkpointing="full"),
        _t(micro_batch=4, seq_len=32, precision="bf16-true", optimizer_impl="fused", attention="eager"),
        _t(micro_batch=2, seq_len=64, optimizer="sgd-momentum", checkpointing="selective", dropout=0.1),
        _t(micro_batch=2, seq_len=64, precision="bf16-mixed", checkpointing="selective-op", grad_accum=2),
        _t(micro_batch=2, seq_len=64, precision="bf16-mixed", lora_targets="qv", **lora),
    ])
    cases += _cases("presets", [_preset("deepseek-v3").layer_slice(0, 4).model_copy(update={"name": "deepseek-v3-4L"})],
                    [_t(micro_batch=1, seq_len=256, precision="bf16-mixed")])
    return cases


def fp8_cases() -> list[CaseSpec]:
    """fp8 training (torchao's Float8Linear, tensorwise and rowwise) on real CPU tensors (fake ones give the same
    bytes): a Llama over options, and families with biases, fused projections, q/k norms, layer patterns, MLA
    and a router with fp8-able dimensions (left alone: it is no nn.Linear)."""
    fp8: dict[str, Any] = {"precision": "bf16-true"}
    llama = _m("llama", "llama-fp8", n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, ffn=512, vocab=1024)
    cases = _cases("fp8", [llama], [
        _t(micro_batch=2, seq_len=64, fp8="tensorwise", **fp8),
        _t(micro_batch=2, seq_len=64, fp8="rowwise", **fp8),
        _t(micro_batch=1, seq_len=128, fp8="tensorwise", optimizer_impl="for-loop", checkpointing="full", **fp8),
        _t(micro_batch=4, seq_len=32, fp8="rowwise", optimizer="none", attention="eager", grad_accum=2, **fp8),
    ], mode="cpu")
    others = [
        _m("qwen3", "qwen3-fp8-bias", n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn=256,
           vocab=1024, qkv_bias=True, out_bias=True),
        _m("phi", "phi-fp8", n_layers=2, hidden=128, n_heads=4, ffn=512, vocab=1024),
        _m("gpt_neox", "gpt-neox-fp8", n_layers=2, hidden=128, n_heads=4, ffn=512, vocab=1024, norm="layernorm",
           norm_bias=True, mlp="dense", activation="gelu", rotary_pct=0.25, fused_qkv=True, qkv_bias=True,
           out_bias=True, mlp_bias=True, parallel_residual=True),
        _m("gemma3", "gemma3-fp8", n_layers=3, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32, ffn=256, vocab=1024,
           sliding_window=16, layer_types=("sliding_attention", "sliding_attention", "full_attention")),
        _m("qwen3_moe", "qwen3-moe-fp8-16e", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=32, ffn=128,
           vocab=512, n_experts=16, experts_top_k=2, expert_ffn=64),
        _m("deepseek_v3", "deepseek-v3-fp8", n_layers=2, hidden=64, n_heads=4, head_dim=16, ffn=128, vocab=512,
           n_experts=8, experts_top_k=2, expert_ffn=32, n_shared_experts=1, n_expert_groups=4, topk_groups=2,
           q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
           dense_layers=(0,)),
    ]
    cases += _cases("fp8", others, [
        _t(micro_batch=2, seq_len=64, fp8="tensorwise", **fp8),
        _t(micro_batch=2, seq_len=64, fp8="rowwise", optimizer="sgd", checkpointing="full", **fp8),
    ], mode="cpu")
    return cases


def hf_adafactor_cases() -> list[CaseSpec]:
    """transformers' Adafactor as the HF Trainer builds it (its decay groups; fp32 copies of 16-bit gradients and
    parameters): families whose largest tensor comes first (the embedding) or last (an untied head after the last
    layer's down projection, which the Trainer's groups put right before it), each precision, LoRA, options and
    the first step (which creates each parameter's state as the loop reaches it)."""
    hf: dict[str, Any] = {"optimizer": "adafactor", "adafactor": "transformers"}
    b: dict[str, Any] = {"micro_batch": 2, "seq_len": 128, **hf}
    trainings = [_t(**b), _t(**{**b, "precision": "bf16-true"}), _t(**{**b, "precision": "bf16-mixed"}),
                 _t(**{**b, "precision": "fp16-mixed", "checkpointing": "full"}),
                 _t(**{**b, "precision": "bf16-true", "method": "lora", "lora_rank": 8, "lora_alpha": 16,
                       "lora_targets": "all-linear"}),
                 _t(**{**b, "precision": "bf16-mixed", "grad_accum": 2, "attention": "eager"}),
                 # the first step creates each parameter's state inside the loop, as it comes
                 _t(**{**b, "first_step": True}), _t(**{**b, "precision": "bf16-true", "first_step": True})]
    models = [_preset(name, **kw) for fam, (name, kw) in _SWEEP_MODELS.items()
              if fam in ("llama", "gpt2", "bert", "mixtral", "qwen3")]
    cases = _cases("hf-adafactor", models, trainings)
    cases += _cases("hf-adafactor", [_small_shapes()[0]], [_t(micro_batch=2, seq_len=64, **hf)], mode="cpu")
    return cases


def gemma3_vision_cases() -> list[CaseSpec]:
    """A multimodal Gemma 3 (Gemma3ForConditionalGeneration, what AutoModelForCausalLM builds from the released
    4B-27B configs) on text: its vision tower held but never run, full fine-tuning and LoRA (peft adapts the
    tower's linear layers too). The vocabulary is the checkpoints' (above the image token id, so the model does
    not clone the input ids)."""
    vision = {"hidden": 64, "intermediate": 128, "n_layers": 2, "n_heads": 4, "image_size": 64, "patch_size": 8}
    m = _m("gemma3", "gemma3-vision-tiny", n_layers=3, hidden=64, n_heads=4, n_kv_heads=2, head_dim=32, ffn=256,
           vocab=262208, sliding_window=16, layer_types=("sliding_attention", "sliding_attention", "full_attention"),
           vision=vision)
    lora: dict[str, Any] = {"method": "lora", "lora_rank": 8, "lora_alpha": 16}
    return _cases("gemma3-vision", [m], [
        _t(micro_batch=1, seq_len=32),
        _t(micro_batch=1, seq_len=32, precision="bf16-mixed", attention="eager"),
        _t(micro_batch=2, seq_len=32, precision="bf16-true", checkpointing="full"),
        _t(micro_batch=1, seq_len=32, precision="bf16-true", lora_targets="all-linear", **lora),
        _t(micro_batch=1, seq_len=32, precision="bf16-mixed", lora_targets="qv", **lora),
        _t(micro_batch=1, seq_len=64, precision="bf16-true", optimizer="sgd", grad_accum=2),
    ], mode="cpu")


def quick_matrix() -> list[CaseSpec]:
    """`trainmem validate`'s default (about 100 cases, 2-4 minutes on 2 cores): every family's small
    shapes, the option sweep on a Llama-2-7B-wide model, one real shape per family up to 7B-class, and
    a few real-tensor steps."""
    small = _small_shapes()
    cases = _cases("families", small, [_t(micro_batch=2, seq_len=64),
                                       _t(micro_batch=1, seq_len=128, precision="bf16-mixed", optimizer_impl="for-loop",
                                          checkpointing="full")])
    name, kw = _SWEEP_MODELS["llama"]
    cases += _cases("options", [_preset(name, **kw)], _sweep_options())
    for preset in ("gpt2", "tinyllama-1.1b", "llama-2-7b", "mistral-7b", "qwen2.5-7b", "gemma-7b", "phi-3-mini",
                   "pythia-6.9b", "opt-6.7b", "bert-large"):
        cases += _cases("presets", [_preset(preset)], [_t(micro_batch=1, seq_len=512, precision="bf16-mixed")])
    cases += _cases("cpu-real", [small[0], small[13], small[19]], [_t(micro_batch=2, seq_len=64)], mode="cpu")
    return cases


def harness_matrix(path: str | Path | None = None) -> list[CaseSpec]:
    """The harness's configurations, re-measured by us (in fake mode: fake == real is proven)."""
    file = Path(path) if path is not None else HARNESS_FILE
    if not file.exists():
        return []
    from .harness import load_harness_cases

    out = []
    for case in load_harness_cases(file):
        m = ModelSpec.model_validate(case["model_spec"])
        t = TrainingSpec.model_validate(case["training"])
        out.append(CaseSpec(case["id"], "harness", m, t, "fake", case["source"]))
    return out


# -- regeneration -------------------------------------------------------------------------------------

def measure_case(case: CaseSpec) -> dict[str, Any]:
    """Measure one case; returns its dataset line (a dict), or ``{"id", "error"}`` if it failed."""
    from .api import measure

    try:
        r = measure(case.model, case.training, device=case.mode, check_ram=False)
    except Exception as exc:  # one failing case must not lose the others; the error is reported
        return {"id": case.id, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    return {"id": case.id, "group": case.group, "source": case.source, **r.to_dict(timeline=False)}


def _run(cases: list[CaseSpec], jobs: int) -> Iterator[dict[str, Any]]:
    if jobs <= 1:
        for case in cases:
            yield measure_case(case)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    ctx = multiprocessing.get_context("spawn")
    # (no max_tasks_per_child: it can hang the pool on Python 3.11, CPython gh-115634)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = [pool.submit(measure_case, c) for c in cases]
        for fut in as_completed(futures):
            yield fut.result()


def _write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for row in sorted(rows, key=lambda r: r["id"]):
            f.write(json.dumps(row, sort_keys=True, separators=(",", ":")) + "\n")
    os.replace(tmp, path)


def regenerate(out: Path = CASES_FILE, only: str = "", keep: bool = False, jobs: int = 1,
               log: Any = sys.stderr) -> tuple[int, list[dict[str, Any]]]:
    """Measure the full matrix into `out` (JSONL). Returns (cases written, failures).

    `only` keeps ids containing that text; `keep` keeps already-stored lines of other ids (and of
    matching ids not re-measured). Lines are written as they come (``<out>.partial``), so an
    interrupted run loses nothing; the final file is sorted by id.
    """
    cases = [c for c in full_matrix() if only in c.id]
    existing: dict[str, dict[str, Any]] = {}
    if keep and out.exists():
        for line in out.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                existing[row["id"]] = row
    done = dict(existing) if keep else {}
    failures: list[dict[str, Any]] = []
    partial = out.with_suffix(".partial")
    t0 = time.perf_counter()
    with partial.open("a") as f:
        for n, row in enumerate(_run(cases, jobs), 1):
            if "error" in row:
                failures.append(row)
                print(f"[{n}/{len(cases)}] FAILED {row['id']}: {row['error']}", file=log, flush=True)
                continue
            done[row["id"]] = row
            f.write(json.dumps(row, sort_keys=True, separators=(",", ":")) + "\n")
            f.flush()
            wall = row["measured_with"]["timing"].get("wall_s", 0.0)
            print(f"[{n}/{len(cases)}] {row['id']}  peak {row['peak_allocated_bytes']}  {row['peak_phase']}  "
                  f"({wall:.1f} s, {time.perf_counter() - t0:.0f} s total)", file=log, flush=True)
    _write_jsonl(out, done.values())
    partial.unlink(missing_ok=True)
    return len(done), failures


def main(argv: list[str] | None = None) -> int:
    """``python -m trainmem_nb.measure.dataset``: regenerate the dataset and ``validation/`` (module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m trainmem_nb.measure.dataset", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=CASES_FILE,
                    help="JSONL file to write (default: the shipped trainmem_nb/data/measured/cases.jsonl)")
    ap.add_argument("--only", default="", help="measure only cases whose id contains this text")
    ap.add_argument("--keep", action="store_true", help="keep stored cases that are not re-measured")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (timings are per case either way)")
    ap.add_argument("--list", action="store_true", help="print the case ids and exit")
    ap.add_argument("--import-harness", nargs="?", const="", default=None, metavar="RESULTS_DIR",
                    help="first copy the harness's results into trainmem_nb/data/measured/harness_cases.json")
    ap.add_argument("--no-report", action="store_true", help="skip validation/harness_agreement.md and SUMMARY.md")
    args = ap.parse_args(argv)
    if args.import_harness is not None:
        from .harness import DEFAULT_RESULTS, import_results

        doc = import_results(args.import_harness or DEFAULT_RESULTS)
        HARNESS_FILE.parent.mkdir(parents=True, exist_ok=True)
        HARNESS_FILE.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
        print(f"wrote {doc['n_cases']} harness cases to {HARNESS_FILE}", file=sys.stderr)
    if args.list:
        for c in full_matrix():
            if args.only in c.id:
                print(c.id)
        return 0
    n, failures = regenerate(args.out, args.only, args.keep, args.jobs)
    print(f"wrote {n} cases to {args.out}; {len(failures)} failed", file=sys.stderr)
    if not args.no_report:
        from .report import write_dataset_reports

        folder = VALIDATION_DIR if args.out == CASES_FILE and VALIDATION_DIR.is_dir() else None
        for path in write_dataset_reports(args.out, folder=folder):
            print(f"wrote {path}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
