"""``estimate()``: simulate one training step and report per-device memory, its peak and when.

(Work in progress: the simulation body is being written; the API and the result type are stable.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .breakdown import TOP_KEYS, roll_up
from .device import Calibration, load_calibration
from .presets import resolve_model
from .specs import ModelSpec, SpecError, TrainingSpec, build_training
from .units import format_bytes, format_count

__all__ = ["MemoryEstimate", "estimate"]


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-device memory of one training step: the peak, when it happens and what it is made of.

    All memory fields are ``int`` bytes. ``breakdown_bytes`` (weights, gradients, optimizer_states,
    activations, transient, overhead) sums exactly to ``peak_allocated_bytes``; ``detail_bytes`` splits
    it further with slash keys (``activations/layers``).
    """

    model: ModelSpec
    training: TrainingSpec
    n_params: int
    n_trainable_params: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_total_bytes: int
    peak_phase: str
    peak_at: str
    detail_bytes: dict[str, int]
    phase_peaks_bytes: dict[str, int]
    overhead_bytes: dict[str, int] = field(default_factory=dict)
    calibration: Calibration | None = None

    @property
    def breakdown_bytes(self) -> dict[str, int]:
        """The top-level categories at the peak; they sum to ``peak_allocated_bytes``."""
        return roll_up(self.detail_bytes)

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract (``trainmem estimate --json``)."""
        return {
            "model": self.model.name,
            "family": self.model.family.value,
            "device": self.training.device.value,
            "n_params": self.n_params,
            "n_trainable_params": self.n_trainable_params,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "device_total_bytes": self.device_total_bytes,
            "peak_phase": self.peak_phase,
            "peak_at": self.peak_at,
            "breakdown_bytes": self.breakdown_bytes,
            "detail_bytes": dict(self.detail_bytes),
            "phase_peaks_bytes": dict(self.phase_peaks_bytes),
            "overhead_bytes": dict(self.overhead_bytes),
            "training": self.training.model_dump(mode="json"),
            "model_spec": self.model.model_dump(mode="json"),
        }

    def summary(self) -> str:
        """A plain-text table for terminals."""
        lines = [
            f"{self.model.name}: {format_count(self.n_params)} params ({format_count(self.n_trainable_params)} trainable), "
            f"{self.training.precision.value}, {self.training.optimizer.value}, micro-batch {self.training.micro_batch} x "
            f"{self.training.seq_len} tokens, device {self.training.device.value}",
            f"peak allocated {format_bytes(self.peak_allocated_bytes)} during {self.peak_phase} ({self.peak_at})",
        ]
        for key, value in self.breakdown_bytes.items():
            lines.append(f"  {key:<18} {format_bytes(value):>12}")
        lines.append(f"peak reserved  {format_bytes(self.peak_reserved_bytes)}")
        lines.append(f"device total   {format_bytes(self.device_total_bytes)}  (what nvidia-smi shows)")
        return "\n".join(lines)


def estimate(
    model: str | ModelSpec | Mapping[str, Any] | int | float | None = None,
    training: TrainingSpec | Mapping[str, Any] | None = None,
    *,
    hf_config: str | Path | Mapping[str, Any] | None = None,
    params: int | float | None = None,
    calibration: Calibration | Mapping[str, Any] | str | Path | None = None,
    **options: Any,
) -> MemoryEstimate:
    """Simulate one steady-state training step and return its per-device memory.

    `model` is a preset name or repo id, a `ModelSpec`, a config dict or a parameter count (or use
    ``hf_config=`` / ``params=``); `options` are `TrainingSpec` fields (micro_batch, seq_len, precision...).
    """
    m = _resolve(model, hf_config, params)
    t = build_training(training, **options)
    cal = load_calibration(calibration)
    from .simulate import simulate

    return simulate(m, t, cal)


def _resolve(model: Any, hf_config: Any, params: Any) -> ModelSpec:
    given = [x is not None for x in (model, hf_config, params)]
    if sum(given) != 1:
        raise SpecError("name the model exactly once: model=NAME|spec|dict, hf_config=PATH, or params=N")
    if hf_config is not None:
        return ModelSpec.from_hf_config(hf_config)
    if params is not None:
        return ModelSpec.from_params(params)
    return resolve_model(model)


_ = TOP_KEYS
