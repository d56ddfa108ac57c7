"""`Measurement`: one measured training step, in the same JSON contract as `MemoryEstimate`.

This module imports neither torch nor transformers, so stored measurements (the ``validation/``
dataset) can be read and compared with estimates where only the estimator is installed.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..engine.breakdown import DETAIL_KEYS, roll_up
from ..model.spec import ModelSpec
from ..spec.training import TrainingSpec
from ..units import format_bytes, format_count

__all__ = ["CONTRACT_KEYS", "Measurement"]

#: Top-level keys shared with ``MemoryEstimate.to_dict()`` (the ``trainmem estimate --json`` contract).
CONTRACT_KEYS: tuple[str, ...] = (
    "model", "family", "device", "n_params", "n_trainable_params", "peak_allocated_bytes",
    "peak_reserved_bytes", "reserved_from", "fragmentation_bytes", "largest_free_block_bytes", "load_peak_bytes",
    "device_total_bytes", "peak_phase", "peak_at", "breakdown_bytes", "detail_bytes",
    "phase_peaks_bytes", "saved_activations_bytes", "overhead_bytes", "calibration", "host_bytes", "host_load_bytes", "parallel",
    "per_rank", "training", "model_spec",
)


def _single_device_layout() -> dict[str, Any]:
    """The parallel layout of a measured step: one device, no sharding (the estimator's default)."""
    try:
        from ..spec.parallel import ParallelSpec
    except ImportError:  # an estimator without parallel layouts
        return {"gpus": 1}
    return ParallelSpec().model_dump(mode="json")


@dataclass(frozen=True)
class Measurement:
    """Memory of one real (or fake-tensor) training step, by category, at its peak.

    All memory fields are ``int`` bytes, each tensor storage rounded up to 512 B as the CUDA caching
    allocator counts it; ``breakdown_bytes`` sums exactly to ``peak_allocated_bytes``. ``mode`` says
    how it was measured: ``fake`` (FakeTensorMode, CPU kernels), ``cpu`` (real CPU tensors) or
    ``cuda`` (the CUDA allocator's counters). ``training.device`` is the kernels' device, so a fake or
    cpu measurement compares with ``estimate(..., device="cpu")``.
    """

    model: ModelSpec
    training: TrainingSpec
    mode: str
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
    peak_live_bytes: int = 0  #: the same peak without 512-B rounding (exact tensor bytes)
    live_at_start_bytes: int = 0  #: what is alive when forward starts (weights, states, inputs)
    timeline: list[list[Any]] = field(default_factory=list)  #: ``[event, live bytes, phase]`` samples
    measured_with: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    saved_activations_bytes: int = 0  #: activations (inputs included) alive when forward ends
    host_bytes: int = 0  #: host memory the step keeps off the device (none: nothing is offloaded)
    parallel: dict[str, Any] | None = None  #: the layout of a measured FSDP rank (None: one device)

    @property
    def breakdown_bytes(self) -> dict[str, int]:
        """The top-level categories at the peak; they sum to ``peak_allocated_bytes``."""
        return roll_up(self.detail_bytes)

    def to_dict(self, timeline: bool = True) -> dict[str, Any]:
        """The JSON contract of ``trainmem measure --json``: the estimate's keys plus how it was measured."""
        out: dict[str, Any] = {
            "model": self.model.name,
            "family": self.model.family.value,
            "device": self.training.device.value,
            "n_params": self.n_params,
            "n_trainable_params": self.n_trainable_params,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "reserved_from": "measured",
            # the allocator's state at its reserved peak and the loading phase are not recorded by a step
            "fragmentation_bytes": None,
            "largest_free_block_bytes": None,
            "load_peak_bytes": None,
            "device_total_bytes": self.device_total_bytes,
            "peak_phase": self.peak_phase,
            "peak_at": self.peak_at,
            "breakdown_bytes": self.breakdown_bytes,
            "detail_bytes": dict(self.detail_bytes),
            "phase_peaks_bytes": dict(self.phase_peaks_bytes),
            "saved_activations_bytes": self.saved_activations_bytes,
            "overhead_bytes": dict(self.overhead_bytes),
            "calibration": self.calibration().model_dump(mode="json") if self.mode == "cuda" else None,
            "host_bytes": self.host_bytes,
            "host_load_bytes": None,  # loading the model is not part of the measured step
            "parallel": self.parallel or _single_device_layout(),
            "per_rank": [],
            "training": self.training.model_dump(mode="json"),
            "stack": self.training.stack_report(),  # what the spec names; `measured_with` has what really ran
            "model_spec": self.model.model_dump(mode="json"),
            "peak_live_bytes": self.peak_live_bytes,
            "live_at_start_bytes": self.live_at_start_bytes,
            "measured_with": dict(self.measured_with),
            "note": self.note,
        }
        if timeline:
            out["timeline"] = [list(p) for p in self.timeline]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Measurement:
        """Rebuild a measurement from `to_dict` output (a dataset line); validates both specs."""
        detail = {k: int(v) for k, v in data["detail_bytes"].items()}
        unknown = sorted(k for k in set(detail) - set(DETAIL_KEYS) if detail[k])
        if unknown:
            raise ValueError(f"unknown breakdown category {unknown[0]!r}; known: {', '.join(DETAIL_KEYS)}")
        # Categories this version does not know and that hold nothing are dropped; known ones that the
        # file predates are zero.
        detail = {k: detail.get(k, 0) for k in DETAIL_KEYS}
        return cls(
            model=ModelSpec.model_validate(data["model_spec"]),
            training=TrainingSpec.model_validate(data["training"]),
            mode=str(data.get("measured_with", {}).get("device", "fake")),
            n_params=int(data["n_params"]),
            n_trainable_params=int(data["n_trainable_params"]),
            peak_allocated_bytes=int(data["peak_allocated_bytes"]),
            peak_reserved_bytes=int(data["peak_reserved_bytes"]),
            device_total_bytes=int(data["device_total_bytes"]),
            peak_phase=str(data["peak_phase"]),
            peak_at=str(data.get("peak_at", "")),
            detail_bytes=detail,
            phase_peaks_bytes={k: int(v) for k, v in data.get("phase_peaks_bytes", {}).items()},
            overhead_bytes={k: int(v) for k, v in data.get("overhead_bytes", {}).items()},
            peak_live_bytes=int(data.get("peak_live_bytes", 0)),
            live_at_start_bytes=int(data.get("live_at_start_bytes", 0)),
            timeline=[list(p) for p in data.get("timeline", [])],
            measured_with=dict(data.get("measured_with", {})),
            note=str(data.get("note", "")),
            saved_activations_bytes=int(data.get("saved_activations_bytes", 0)),
            host_bytes=int(data.get("host_bytes", 0)),
            parallel=data.get("parallel") if data.get("parallel", {}).get("gpus", 1) > 1 else None,
        )

    def calibration(self) -> Any:
        """The `trainmem_nb.device.Calibration` a ``cuda`` measurement yields (context, workspaces, churn)."""
        from .calibration import calibration_from

        return calibration_from(self)

    def summary(self) -> str:
        """A plain-text table for terminals."""
        t = self.training
        lines = [
            f"{self.model.name}: {format_count(self.n_params)} params ({format_count(self.n_trainable_params)} trainable), "
            f"{t.precision.value}, {t.optimizer.value} ({t.resolved_optimizer_impl.value}), micro-batch {t.micro_batch} x "
            f"{t.seq_len} tokens, measured on {self.mode} ({t.device.value} kernels)",
            f"peak allocated {format_bytes(self.peak_allocated_bytes)} during {self.peak_phase} ({self.peak_at})",
        ]
        for key, value in self.breakdown_bytes.items():
            lines.append(f"  {key:<18} {format_bytes(value):>12}")
        lines.append(f"peak reserved  {format_bytes(self.peak_reserved_bytes)}")
        lines.append(f"device total   {format_bytes(self.device_total_bytes)}")
        timing = self.measured_with.get("timing", {})
        if "wall_s" in timing:
            lines.append(f"measured in {timing['wall_s']:.1f} s")
        if self.note:
            lines.append(f"note: {self.note}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(k)}</td><td style='text-align:right'>{format_bytes(v)}</td></tr>"
            for k, v in self.detail_bytes.items() if v
        )
        return (
            f"<div><b>{html.escape(self.model.name)}</b>, measured on {html.escape(self.mode)}: peak allocated "
            f"<b>{format_bytes(self.peak_allocated_bytes)}</b> during {html.escape(self.peak_phase)}"
            f"<table>{rows}</table><small>{html.escape(self.note)}</small></div>"
        )
