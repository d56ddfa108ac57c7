"""LoRA through peft, as a fine-tuning run applies it: adapters on a frozen base, optimizer over adapters.

``lora_targets`` is ``'qv'`` (the family's query and value projections), ``'all-linear'`` (peft's own
choice: every linear layer except the output head) or comma-separated module names.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..errors import SpecError
from ..model.families import Family, describe
from ..model.spec import ModelSpec
from ..spec.choices import AdapterDtype, Method
from ..spec.training import TrainingSpec

__all__ = ["apply_lora", "lora_target_modules"]

def lora_target_modules(model_spec: ModelSpec, targets: str) -> list[str] | str:
    """peft's ``target_modules`` for a ``lora_targets`` option.

    >>> from trainmem_nb.model.spec import ModelSpec
    >>> lora_target_modules(ModelSpec(family="gpt2", n_layers=1, hidden=64, n_heads=4, ffn=256, vocab=100), "qv")
    ['c_attn']
    """
    text = targets.strip()
    if text.lower() == "qv":
        return [module.rsplit(".", 1)[-1] for module in describe(model_spec.family).lora_qv]
    if text.lower() in ("all-linear", "all_linear", "all"):
        return "all-linear"
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise SpecError(f"lora_targets={targets!r} names no module; use 'qv', 'all-linear' or module names")
    return names


def apply_lora(model: Any, model_spec: ModelSpec, training_spec: TrainingSpec) -> Any:
    """Wrap `model` with peft LoRA adapters (rank, alpha, dropout, targets from `training_spec`).

    The base model is frozen; only adapter parameters require gradients. peft keeps adapters in fp32
    even on a 16-bit base (``autocast_adapter_dtype=True``, its default); ``lora_dtype='base'`` or ``'weight'``
    turns that off, so the adapters take the base weights' dtype (the same on a 16-bit base).
    """
    if training_spec.method is Method.QLORA:
        raise RuntimeError(
            "method='qlora' cannot be measured here: it needs bitsandbytes CUDA kernels for the NF4 base; "
            "measure method='lora' (the same adapters on a 16-bit base) instead"
        )
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise RuntimeError('method=\'lora\' needs peft: pip install "trainmem_nb[measure]"') from None
    modules = lora_target_modules(model_spec, training_spec.lora_targets)
    alpha: Any = training_spec.lora_alpha  # peft annotates an int; it only divides by the rank
    config = LoraConfig(
        r=training_spec.lora_rank,
        lora_alpha=alpha,
        lora_dropout=training_spec.lora_dropout,
        target_modules=modules,
        bias="none",
        fan_in_fan_out=model_spec.family is Family.GPT2,  # gpt2's layers are Conv1D (weights transposed)
    )
    try:
        with warnings.catch_warnings():
            # peft 0.21 reads transformers' deprecated `is_gradient_checkpointing` alias; nothing to act on.
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
            # peft's default rank pattern for MoE expert weights, when 'all-linear' does not reach them.
            warnings.filterwarnings("ignore", message="The following (rank|alpha)_pattern keys did not match", category=RuntimeWarning)
            return get_peft_model(model, config,
                                  autocast_adapter_dtype=training_spec.lora_dtype is AdapterDtype.FP32)
    except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
        raise SpecError(f"lora_targets={training_spec.lora_targets!r}: {str(exc).splitlines()[0]}") from None
