"""What a CUDA measurement teaches the estimator: a `trainmem_nb.device.Calibration` (no torch needed)."""

from __future__ import annotations

from typing import Any

__all__ = ["calibration_from"]


def calibration_from(measurement: Any) -> Any:
    """A `trainmem_nb.device.Calibration` from a ``cuda`` `Measurement`.

    * ``cuda_context_bytes`` = device memory in use (total − free) − ``memory_reserved()``;
    * ``workspace_bytes`` = allocated bytes at step start that are not tracked tensors (cuBLAS
      workspaces allocated through the caching allocator);
    * ``reserved_churn_fraction`` = (peak reserved − peak allocated) / (activations + transient bytes
      at the peak): the allocator's overhead per byte that churns within a step.
    """
    from ..spec.calibration import Calibration

    cuda = measurement.measured_with.get("cuda")
    if measurement.mode != "cuda" or not cuda:
        raise RuntimeError("a calibration needs a measurement on device='cuda' (--device cuda)")
    b = measurement.breakdown_bytes
    churn = max(1, b["activations"] + b["transient"])
    fraction = max(0.0, (measurement.peak_reserved_bytes - measurement.peak_allocated_bytes) / churn)
    return Calibration(
        gpu_name=str(cuda["gpu_name"]),
        total_memory_bytes=int(cuda["device_total"]),
        cuda_context_bytes=int(cuda["context"]),
        workspace_bytes=int(cuda["workspace_at_start"]),
        reserved_churn_fraction=min(fraction, 10.0),
        torch_version=str(measurement.measured_with.get("torch", "")),
        measured_on=str(measurement.measured_with.get("date", "")),
        source=(
            f"trainmem measure --device cuda: {measurement.model.name}, {measurement.training.precision.value}, "
            f"micro-batch {measurement.training.micro_batch} x {measurement.training.seq_len}"
        ),
    )
