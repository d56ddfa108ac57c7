"""The planner's assumptions, validated in one place: every number finite and in range, counts whole,
and the per-GPU forms (``mfu={gpu: ...}``, ``prices={gpu: ...}``) checked like the scalar ones, with GPU
names resolved as `get_gpu` resolves them (an unknown name is refused with a did-you-mean, never
ignored). `plan`, `fit`, `max_micro_batch` and `fewest_gpus` and the CLI all go through here, so a
negative bandwidth or an ``mfu`` of 5 is refused with the field, the value and what is valid.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import Field

from ..errors import SpecError, did_you_mean, finite_number, show_value, whole_number
from ..spec.base import _FROZEN, SpecModel, _validate
from .cost import KEEP_CHECKPOINTS, RESTART_OVERHEAD_S, SPOT_INTERRUPTIONS_PER_NODE_HOUR, STORAGE_WRITE_GBS_PER_NODE
from .gpus import GPU, Price, get_gpu
from .throughput import INTER_NODE_GBS_PER_GPU, check_fraction, check_mfu

__all__ = ["MAX_GPUS_LIMIT", "PlanAssumptions", "check_count", "check_fraction", "check_headroom", "check_mfu",
           "check_provider", "resolve_gpus"]

#: The largest GPU count any search goes to: 2**20, beyond every machine built (a few 10**5 GPUs).
MAX_GPUS_LIMIT = 1 << 20


class PlanAssumptions(SpecModel):
    """What a plan assumes about the run and the machines, each bounded as a user would expect.

    >>> PlanAssumptions(storage_gbs=0)
    Traceback (most recent call last):
    ...
    trainmem_nb.errors.SpecError: storage_gbs=0: Input should be greater than 0
    """

    model_config = _FROZEN

    headroom: float = Field(default=0.10, ge=0.0, lt=1.0, description="fraction of each GPU kept free")
    target_global_batch: int | None = Field(default=None, ge=1, le=1 << 30, description="sequences per step")
    tokens: float | None = Field(default=None, gt=0.0, description="total training tokens")
    n_gpus: int | None = Field(default=None, ge=1, le=MAX_GPUS_LIMIT, description="the GPU count, fixed")
    max_gpus: int = Field(default=512, ge=1, le=MAX_GPUS_LIMIT, description="largest GPU count tried")
    scale_out: int = Field(default=2, ge=0, le=64, description="doublings tried past the fewest GPUs that fit")
    inter_node_gbs: float = Field(default=INTER_NODE_GBS_PER_GPU, gt=0.0, description="GB/s per GPU between nodes")
    storage_gbs: float = Field(default=STORAGE_WRITE_GBS_PER_NODE, gt=0.0, description="checkpoint GB/s per node")
    spot_interruptions_per_node_hour: float = Field(default=SPOT_INTERRUPTIONS_PER_NODE_HOUR, ge=0.0)
    restart_minutes: float = Field(default=RESTART_OVERHEAD_S / 60, ge=0.0)
    checkpoint_interval_hours: float | None = Field(default=None, gt=0.0, description="None: Young's optimum")
    keep_checkpoints: int = Field(default=KEEP_CHECKPOINTS, ge=1, le=1 << 20)


def check_headroom(headroom: Any) -> float:
    """A headroom fraction in [0, 1): the share of each GPU kept free."""
    value = finite_number(headroom, "headroom") if not isinstance(headroom, (list, tuple, dict)) else math.nan
    if not 0.0 <= value < 1.0:
        raise SpecError(f"headroom={show_value(headroom)} must be a fraction in [0, 1), e.g. 0.10 for 10% kept free")
    return value


def check_count(value: Any, field: str, minimum: int = 1, maximum: int = MAX_GPUS_LIMIT) -> int:
    """A whole number in [minimum, maximum] (numpy integers too; no bools, text or fractions)."""
    if isinstance(value, str):
        raise SpecError(f"{field}={value!r} must be an integer from {minimum} to {maximum}, not text")
    return whole_number(value, field, minimum, maximum)


def check_provider(provider: Any, prices: Iterable[Price]) -> str | None:
    """A provider that sells something in `prices` (case-insensitive), or None for all of them."""
    if provider is None:
        return None
    if not isinstance(provider, str) or not provider.strip():
        raise SpecError(f"provider={provider!r} must name a provider of the prices (e.g. 'AWS')")
    names = sorted({p.provider for p in prices})
    if not names:
        raise SpecError(f"provider={provider!r} chooses among prices, but there are none (prices=False / --no-prices)")
    if provider.strip().lower() not in {n.lower() for n in names}:
        raise SpecError(f"provider={provider!r} sells nothing in the prices{did_you_mean(provider, names)}; "
                        f"providers: {', '.join(names)}")
    return provider.strip()


def resolve_gpus(gpu: Any, catalog: Iterable[GPU], field: str = "gpu") -> list[GPU] | None:
    """GPU types from a name, a `GPU` or a list of them (None: the whole catalog)."""
    if gpu is None:
        return None
    items = [gpu] if isinstance(gpu, (str, GPU)) else gpu
    if isinstance(items, Mapping) or not isinstance(items, Iterable):
        raise SpecError(f"{field}={show_value(gpu)} must name GPU types: a name such as 'H100', a GPU, or a list "
                        "of them (see `trainmem gpus`)")
    cat = list(catalog)
    out: list[GPU] = []
    for item in items:
        if not isinstance(item, (str, GPU)):
            raise SpecError(f"{field}: {show_value(item)} is not a GPU name or a GPU")
        g = get_gpu(item, cat)
        if g not in out:
            out.append(g)
    if not out:
        raise SpecError(f"{field}=[] names no GPU; leave it out to search the whole catalog")
    return out


def plan_assumptions(**values: Any) -> PlanAssumptions:
    """A validated `PlanAssumptions` (None values take the defaults)."""
    return _validate(PlanAssumptions, {k: v for k, v in values.items() if v is not None})
