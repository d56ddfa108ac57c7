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
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["ALLOC_CONF_ENV", "after_step", "apply_alloc_conf", "before_step", "env_alloc_conf", "require_cuda",
           "write_calibration"]

#: where torch 2.13 reads the caching allocator's settings from, first match wins: ``PYTORCH_ALLOC_CONF``,
#: then the older ``PYTORCH_CUDA_ALLOC_CONF`` (c10/core/AllocatorConfig.cpp, AcceleratorAllocatorConfig's
#: parseEnv; the CUDA notes in torch's docs name both)
ALLOC_CONF_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
#: the settings this process's allocator was given by `apply_alloc_conf` (empty: none yet)
_APPLIED: list[str] = []

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


def env_alloc_conf(environ: Mapping[str, str] | None = None) -> str:
    """The allocator settings a process started with this environment runs with ("" = defaults)."""
    env = os.environ if environ is None else environ
    return next((env[k].strip() for k in ALLOC_CONF_ENV if env.get(k, "").strip()), "")


def apply_alloc_conf(conf: str, setter: Any = None) -> None:
    """Run the caching allocator with `conf` (``PYTORCH_CUDA_ALLOC_CONF`` syntax) from here on, before
    the model is built, so the measured step and its replay (`trainmem_nb.step.reserved`) use the same
    rules. The settings are process-wide and parsing only sets the keys it is given, so a second,
    different configuration in one process is refused rather than measured on a mix of both."""
    env = env_alloc_conf()
    if conf and env and conf != env:
        raise RuntimeError(f"alloc_conf={conf!r} differs from the environment's {env!r} (PYTORCH_ALLOC_CONF / "
                           "PYTORCH_CUDA_ALLOC_CONF), which the allocator already read: give one of them")
    effective = conf or env
    if _APPLIED and _APPLIED[-1] != effective:
        raise RuntimeError(f"alloc_conf={effective!r} cannot be measured in this process: an earlier measurement "
                           f"set the caching allocator to {_APPLIED[-1]!r} (its settings are process-wide); "
                           "measure it in a new process")
    if not conf or _APPLIED:  # the environment's settings are in effect already, or ours are
        return
    if setter is None:
        torch.cuda.empty_cache()  # no segment made under the old rules stays cached
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        if setter is None:
            raise RuntimeError(f"this PyTorch ({torch.__version__}) cannot set alloc_conf at run time; "
                               f"start the process with PYTORCH_CUDA_ALLOC_CONF={conf!r} instead")
    setter(conf)
    _APPLIED.append(conf)


def before_step(setup: Any, warm_up: bool = True) -> dict[str, Any]:
    """Release the cached blocks building the model freed (``from_pretrained`` leaves none), warm up with
    one full step (the loop's first: `warm_up`, unless the first step is the one measured), then reset
    the peak counters; returns the state at step start."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if warm_up:
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
