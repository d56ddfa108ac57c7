"""``estimate()``: one training step's per-device memory, its peak and when the peak happens.

>>> import trainmem_nb as tm
>>> est = tm.estimate("gpt2", micro_batch=4, seq_len=512, precision="fp32", device="cpu")
>>> est.peak_phase, round(est.peak_allocated_bytes / 2**30, 2)
('backward', 6.36)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import SpecError
from ..model.families import DESCRIPTIONS, describe
from ..model.params import as_built
from ..model.presets import resolve_model
from ..model.spec import ModelSpec
from ..parallel.checks import check_layout, keeps_grads_modelled
from ..recipes.registry import loss_gap, runs_loss, separate_head
from ..spec.calibration import Calibration, load_calibration
from ..spec.parallel import ParallelSpec, build_parallel
from ..spec.training import TrainingSpec, build_training
from .result import MemoryEstimate
from .simulate import simulate

__all__ = ['check_model_options', 'estimate']


def estimate(
    model: str | ModelSpec | Mapping[str, Any] | int | float | None = None,
    training: TrainingSpec | Mapping[str, Any] | None = None,
    *,
    parallel: ParallelSpec | Mapping[str, Any] | None = None,
    hf_config: str | Path | Mapping[str, Any] | None = None,
    params: int | float | None = None,
    calibration: Calibration | Mapping[str, Any] | str | Path | None = None,
    **options: Any,
) -> MemoryEstimate:
    """Simulate one steady-state training step and return its per-device memory.

    `model` is a preset name or Hugging Face repo id, a `ModelSpec`, a config dict or a parameter
    count (or pass ``hf_config=`` a path/dict, or ``params=`` a count); `options` are `TrainingSpec`
    fields (micro_batch, seq_len, grad_accum, precision, optimizer, optimizer_impl, checkpointing,
    attention, dropout, device, method, lora_*) and `ParallelSpec` fields (gpus, nodes, engine, zero,
    tp, sp, pp, pp_schedule, virtual_stages, cp, ep, offload). With a parallel layout each headline
    figure is the maximum over the ranks (the breakdown and `timeline` are those of the rank with the
    largest allocated peak) and ``per_rank`` holds every distinct rank. `calibration` (from
    ``trainmem measure --device cuda``) replaces the modelled CUDA context and allocator constants.
    """
    m = _resolve(model, hf_config, params)
    par_opts = {k: options.pop(k) for k in list(options) if k in ParallelSpec.model_fields}
    t = build_training(training, **options)
    m = as_built(m, t)
    p = build_parallel(parallel, **par_opts)
    check_model_options(m, t)
    check_layout(m, p, t)
    if not t.zero_grad_set_to_none and not keeps_grads_modelled(p):  # a stack's torch < 2.0, on an engine that
        t = t.model_copy(update={"zero_grad_set_to_none": True})  # clears its own gradients (`check_layout`)
    cal = load_calibration(calibration)
    return simulate(m, t, cal, p)


def _resolve(model: Any, hf_config: Any, params: Any) -> ModelSpec:
    given = [x is not None for x in (model, hf_config, params)]
    if sum(given) != 1:
        raise SpecError("name the model exactly once: model=NAME|spec|dict, hf_config=PATH, or params=N")
    if hf_config is not None:
        return ModelSpec.from_hf_config(hf_config)
    if params is not None:
        return ModelSpec.from_params(params)
    return resolve_model(model)


def check_model_options(m: ModelSpec, t: TrainingSpec) -> None:
    """Options that cannot run on this model: a clear error instead of a silent wrong number."""
    if t.seq_len > m.max_positions:
        raise SpecError(
            f"seq_len={t.seq_len} exceeds {m.name}'s max_positions={m.max_positions}; "
            f"use seq_len <= {m.max_positions}"
        )
    if t.attention.value == "flash" and t.device.value == "cpu":
        raise SpecError("attention='flash' (flash-attention 2) runs only on CUDA; use attention='sdpa' with device='cpu'")

    if describe(m.family).attention == "sinks" and t.attention.value == "flash":
        raise SpecError(f"attention='flash' on {m.family.value}: its attention sinks need the kernels-community "
                        "flash kernels, which are not modelled; use attention='eager' (attention='sdpa' runs eager too: "
                        "GptOssPreTrainedModel._supports_sdpa = False)")
    if m.family.value == "gpt_oss" and t.checkpointing.value == "selective":
        raise SpecError("checkpointing='selective' on gpt_oss fails in PyTorch: the policy caches grouped_mm's "
                        "output, which the experts then add their bias to in place (\"Tensor cached during selective "
                        "activation checkpoint has been mutated\"); use checkpointing='selective-op' or 'full'")
    if m.family.value == "deepseek_v3" and t.attention.value == "flash":
        raise SpecError("attention='flash' on deepseek_v3 is not modelled (its v_head_dim differs from the q/k head "
                        "dim, which flash-attn does not take as is); use attention='sdpa' or 'eager'")
    why = loss_gap(m, t)
    if why and runs_loss(m, t) is t.loss_impl and m.num_labels:  # a stack's lit-gpt head falls back (`runs_loss`)
        raise SpecError(f"loss_impl={t.loss_impl.value!r} replaces the language-model head's loss; a sequence "
                        f"classifier (num_labels={m.num_labels}) has no such head: use loss_impl='standard'")
    if why and runs_loss(m, t) is t.loss_impl:  # the user's is refused
        ok = ", ".join(f.value for f, dd in DESCRIPTIONS.items()
                       if (dd.composed or (t.loss_impl.value == "litgpt" and separate_head(f))) and not dd.multipliers)
        capped = "" if t.loss_impl.value == "litgpt" else "; without soft-capped logits"
        raise SpecError(f"loss_impl={t.loss_impl.value!r} on {m.family.value} is not modelled ({why}); it is "
                        f"modelled for the decoders composed from parts ({ok}{capped}); use loss_impl='standard'")
    if t.method.value != "full":
        from ..model.params import lora_modules, lora_moe_params

        lora_modules(m, t.lora_targets)  # raises when the targets match nothing
        if t.lora_dropout and lora_moe_params(m, t.lora_targets):
            raise SpecError(f"lora_dropout={t.lora_dropout:g} with lora_targets={t.lora_targets!r} on {m.family.value}: "
                            "peft's ParamWrapper (the router's and experts' adapters) does not work with "
                            "lora_dropout != 0; use lora_dropout=0 or lora_targets='qv'")
