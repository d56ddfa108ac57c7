"""Measure on a CUDA GPU: the caching allocator's own counters around one steady-state step.

After building and priming, one full warm-up step puts the caching allocator in the state a training
loop runs in (blocks cached, cuBLAS handle and workspace created). Then
``torch.cuda.reset_peak_memory_stats()`` and the measured step; ``max_memory_allocated()`` is the
allocated peak (tensors in 512-B blocks plus workspaces PyTorch allocates through the allocator),
``max_memory_reserved()`` the segments the allocator held, and ``torch.cuda.mem_get_info()`` (total −
free) what the device has in use, as ``nvidia-smi`` shows it. The storage tracker runs during the
step too (CUDA storages only) and gives the breakdown; what the allocator counted beyond the tracked
tensors at the peak is reported as ``overhead/workspaces``.

Sources: PyTorch's CUDA memory-management notes and the ``torch.cuda.memory_stats`` /
``max_memory_allocated`` / ``max_memory_reserved`` / ``reset_peak_memory_stats`` / ``mem_get_info``
docs (torch 2.x).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["after_step", "before_step", "require_cuda", "write_calibration"]

#: memory_stats() entries kept with a measurement (allocation retries and OOMs say the step was tight).
_STATS = (
    "allocated_bytes.all.peak", "reserved_bytes.all.peak", "active_bytes.all.peak", "requested_bytes.all.peak",
    "inactive_split_bytes.all.peak", "segment.all.peak", "num_alloc_retries", "num_ooms",
)


def require_cuda() -> None:
    """Raise a one-line `RuntimeError` when PyTorch sees no CUDA GPU."""
    if torch.cuda.is_available():
        return
    if torch.version.cuda is None:
        why = f"this PyTorch build ({torch.__version__}) has no CUDA support"
    else:
        why = f"PyTorch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
    raise RuntimeError(
        f"device='cuda' cannot be measured: {why}; use --device fake (exact accounting without memory) or --device cpu"
    )


def before_step(setup: Any) -> dict[str, Any]:
    """Warm up with one full step, then reset the peak counters; returns the state at step start."""
    setup.step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return {"allocated_at_start": torch.cuda.memory_allocated(), "reserved_at_start": torch.cuda.memory_reserved()}


def after_step(before: dict[str, Any]) -> dict[str, Any]:
    """The allocator's counters after the measured step (call before anything is freed)."""
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    free, total = torch.cuda.mem_get_info()
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    reserved_now = torch.cuda.memory_reserved()
    return {
        **before,
        "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(),
        "reserved_now": reserved_now,
        "device_used": total - free,
        "device_total": total,
        # Everything in use on the device that the caching allocator does not hold: the CUDA context,
        # kernels and library handles (and other processes' memory, if any share the GPU).
        "context": max(0, (total - free) - reserved_now),
        "gpu_name": torch.cuda.get_device_name(index),
        "capability": f"{props.major}.{props.minor}",
        "stats": {k: int(stats.get(k, 0)) for k in _STATS},
        "segments": _segments(),
    }


def _segments() -> list[dict[str, Any]] | None:
    """The allocator's segments now (``torch.cuda.memory._snapshot()``, a private but long-standing API),
    summarised as the replay's are (`trainmem_nb.engine.allocator.segments`); None where it is missing."""
    from ..engine.allocator.segments import segment_summary

    try:
        snap = torch.cuda.memory._snapshot()
    except (AttributeError, RuntimeError):
        return None
    return segment_summary(snap.get("segments", ()))


def write_calibration(measurement: Any, path: str | Path, force: bool = False) -> Path:
    """Write ``{"calibration": {...}, "measurement": {...}}``; `trainmem_nb.spec.calibration.load_calibration`
    reads it. An existing file is never replaced silently: it is refused unless `force`, and the write is
    atomic."""
    from ..files import check_output_file, write_text_atomic
    from .calibration import calibration_from

    out = check_output_file(path, "--save-calibration", force)
    cal = calibration_from(measurement)
    data = {
        "calibration": cal.model_dump(mode="json"),
        "measurement": measurement.to_dict(timeline=False),
        "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return write_text_atomic(out, json.dumps(data, indent=2) + "\n")
