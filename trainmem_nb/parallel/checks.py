"""Layout constraints that depend on the model, with what would work instead.
"""

from __future__ import annotations

from ..errors import SpecError
from ..model.spec import ModelSpec
from ..spec.parallel import ParallelSpec, PipelineSchedule

__all__ = ['check_layout']


def check_layout(m: ModelSpec, p: ParallelSpec) -> None:
    """Layout constraints that depend on the model, with what would work instead."""
    if m.n_heads % p.tp:
        ok = [d for d in range(1, min(m.n_heads, p.gpus_per_node) + 1) if m.n_heads % d == 0 and m.n_kv_heads % d == 0]
        raise SpecError(f"tp={p.tp} does not divide {m.name}'s n_heads={m.n_heads}; use tp in {ok}")
    if m.n_kv_heads % p.tp and p.tp % m.n_kv_heads:
        raise SpecError(f"tp={p.tp} and n_kv_heads={m.n_kv_heads} must divide one another (kv heads are split or "
                        f"replicated across tensor-parallel ranks)")
    if p.pp > m.n_layers:
        raise SpecError(f"pp={p.pp} exceeds {m.name}'s n_layers={m.n_layers}; use pp <= {m.n_layers}")
    if p.pp * p.virtual_stages > m.n_layers:
        raise SpecError(f"pp*virtual_stages = {p.pp * p.virtual_stages} exceeds n_layers={m.n_layers}")
    if p.pp_schedule is PipelineSchedule.INTERLEAVED and m.n_layers % (p.pp * p.virtual_stages):
        # Megatron-LM requires equal model chunks: megatron/training/arguments.py (validate_args) asserts
        # num_layers % pipeline size == 0 and layers per stage % layers per virtual stage == 0
        ok = [v for v in range(2, m.n_layers // p.pp + 1) if m.n_layers % (p.pp * v) == 0]
        hint = f"use virtual_stages in {ok}" if ok else f"use a pp that divides n_layers={m.n_layers}, or pp_schedule='1f1b'"
        raise SpecError(f"pp_schedule='interleaved' splits {m.name}'s n_layers={m.n_layers} into pp*virtual_stages = "
                        f"{p.pp}*{p.virtual_stages} = {p.pp * p.virtual_stages} equal chunks, which does not divide it; "
                        f"{hint}")
    if p.ep > 1:
        if not m.is_moe:
            raise SpecError(f"ep={p.ep} needs a mixture-of-experts model; {m.name} has no experts (use ep=1)")
        if m.n_experts % p.ep:
            raise SpecError(f"ep={p.ep} does not divide n_experts={m.n_experts}")
        if p.dp % p.ep:
            raise SpecError(f"ep={p.ep} must divide the data-parallel degree dp={p.dp}")
