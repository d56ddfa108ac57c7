"""``measure()``: run one training step for real (or on fake tensors) and return a `Measurement`."""

from __future__ import annotations

import contextlib
import datetime
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..engine.breakdown import DETAIL_KEYS
from ..errors import SpecError
from ..model.presets import resolve_model
from ..model.spec import ModelSpec
from ..spec.training import TrainingSpec, build_training
from ..units import format_bytes
from .extra import require_torch
from .result import Measurement

__all__ = ["DEVICES", "available_ram_bytes", "check_fits_in_ram", "measure", "measurement_from_trace", "versions"]

#: Where a step can be measured: fake tensors (CPU kernels, no memory), real CPU tensors, a CUDA GPU.
DEVICES = ("fake", "cpu", "cuda")

#: Head-room left for the Python process, the model code and the allocator when checking that a
#: ``cpu`` step fits in RAM (the harness saw a real run's RSS at its live peak + ~0.5 GB).
_RAM_HEADROOM_BYTES = 1 << 30

_NOTES = {
    "fake": "FakeTensorMode run of PyTorch's CPU kernels: every tensor storage tracked exactly (no data, no "
            "memory used), each rounded up to 512 B as the CUDA caching allocator does; reserved and device "
            "total equal allocated (no caching allocator or CUDA context on CPU); compare with "
            "estimate(..., device='cpu')",
    "cpu": "real CPU tensors: every tensor storage tracked exactly, each rounded up to 512 B as the CUDA caching "
           "allocator does; reserved and device total equal allocated (no caching allocator or CUDA context on "
           "CPU); compare with estimate(..., device='cpu')",
    "cuda": "CUDA caching allocator counters (max_memory_allocated / max_memory_reserved after "
            "reset_peak_memory_stats, mem_get_info for the device total); the breakdown is the tracked tensors "
            "at their peak, overhead/workspaces the rest of what the allocator counted",
}


def versions() -> dict[str, str]:
    """Versions of what a measurement depends on (torch, transformers, peft, python, this package)."""
    from importlib import metadata

    import torch
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version()}
    for dist in ("peft", "trainmem_nb"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    with contextlib.suppress(metadata.PackageNotFoundError):  # fp8 steps run torchao's Float8Linear
        out["torchao"] = metadata.version("torchao")
    return out


def available_ram_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo (Linux), else psutil's figure, else None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def _too_big(need: int, avail: int) -> RuntimeError:
    return RuntimeError(
        f"device='cpu' would need about {format_bytes(need)} of RAM for this step but {format_bytes(avail)} is "
        f"available here; use --device fake (the same accounting on fake tensors, no memory needed)"
    )


def check_fits_in_ram(m: ModelSpec, t: TrainingSpec, available: int | None = None) -> None:
    """Refuse a ``cpu`` step that cannot fit in this machine's RAM, before allocating anything.

    The weights alone are checked first. When a generous bound (weights, gradients, two optimizer
    states, and 128 B per token per layer-width plus 16 B per token per vocabulary entry of
    activations) could take over a quarter of the RAM, the step is measured in fake mode first and
    its exact peak decides.
    """
    avail = available_ram_bytes() if available is None else available
    if avail is None:
        return
    weights = m.n_params * t.param_bytes
    if weights + _RAM_HEADROOM_BYTES > avail:
        raise _too_big(weights + _RAM_HEADROOM_BYTES, avail)
    rough = 4 * weights + t.tokens * (m.n_layers * max(m.hidden, m.ffn) * 128 + m.vocab * 16)
    if rough < avail // 4:
        return
    peak = measure(m, t, device="fake", check_ram=False).peak_live_bytes
    if peak + _RAM_HEADROOM_BYTES > avail:
        raise _too_big(peak + _RAM_HEADROOM_BYTES, avail)


def _resolve(model: Any, hf_config: Any, params: Any) -> ModelSpec:
    given = [x is not None for x in (model, hf_config, params)]
    if sum(given) != 1:
        raise SpecError("name the model exactly once: model=NAME|spec|dict, hf_config=PATH, or params=N")
    if hf_config is not None:
        return ModelSpec.from_hf_config(hf_config)
    if params is not None:
        return ModelSpec.from_params(params)
    return resolve_model(model)


def measure(
    model: str | ModelSpec | Mapping[str, Any] | int | float | None = None,
    training: TrainingSpec | Mapping[str, Any] | None = None,
    device: str = "fake",
    *,
    hf_config: str | Path | Mapping[str, Any] | None = None,
    params: int | float | None = None,
    prime: bool | None = None,
    check_ram: bool = True,
    **options: Any,
) -> Measurement:
    """Run one steady-state training step and return its measured memory.

    `model` and `options` are what `trainmem_nb.estimator.api` takes (a preset name, `ModelSpec`, HF config
    dict or parameter count; `TrainingSpec` fields as keywords). `device` is ``fake`` (FakeTensorMode:
    any size, no memory, CPU kernels), ``cpu`` (real tensors) or ``cuda`` (a GPU's allocator). For
    ``fake`` and ``cpu`` the training spec's device is ``cpu`` (the kernels that ran). A first step (``first_step=True``, or
    ``prime=False``) is measured without priming: the optimizer state is created inside the step.

    >>> r = measure("gpt2", micro_batch=1, seq_len=128, precision="fp32", dropout=0.0)  # doctest: +SKIP
    >>> r.peak_phase, r.breakdown_bytes["weights"]  # doctest: +SKIP
    ('optimizer', 497759232)
    """
    require_torch()
    dev = str(device).strip().lower()
    if dev not in DEVICES:
        raise SpecError(f"device={device!r} cannot be measured; valid values: {', '.join(DEVICES)}")
    m = _resolve(model, hf_config, params)
    options = {k: v for k, v in options.items() if k != "device"}
    if prime is False:
        options["first_step"] = True
    t = build_training(training, device="cuda" if dev == "cuda" else "cpu", **options)
    if dev == "cuda" and not t.alloc_conf:
        from .cuda import env_alloc_conf

        if env_alloc_conf():  # the step runs with the environment's settings: record them, so a replay uses them too
            t = build_training(t, alloc_conf=env_alloc_conf())
    prime = not t.first_step
    from ..estimator.api import check_model_options
    from ..parallel.checks import check_layout
    from ..spec.parallel import ParallelSpec
    from .step import check_measurable, run_step

    check_measurable(m, t, dev)
    check_model_options(m, t)  # what the estimate refuses (an fp8 recipe without its engine...), refused here too
    check_layout(m, ParallelSpec(), t)
    if dev == "cpu" and check_ram:
        check_fits_in_ram(m, t)
    started = datetime.datetime.now(datetime.timezone.utc)
    trace = run_step(m, t, dev, prime=prime)
    return measurement_from_trace(trace, started)


def measurement_from_trace(trace: Any, started: datetime.datetime | None = None) -> Measurement:
    """Turn a traced step (`trainmem_nb.measure.step.StepTrace`) into a `Measurement`.

    On ``cuda`` the peak is the allocator's ``max_memory_allocated``: the tracked tensors at their
    peak plus ``overhead/workspaces`` (what the allocator counted beyond them, e.g. cuBLAS
    workspaces); reserved is ``max_memory_reserved`` and the device total adds the CUDA context.
    """
    import torch

    from .step import summarize

    dev = trace.device
    rounded = summarize(trace)
    exact = summarize(trace, rounding=False, timeline_points=1)
    started = started or datetime.datetime.now(datetime.timezone.utc)
    measured_with: dict[str, Any] = {
        "device": dev, "kernels": "cuda" if dev == "cuda" else "cpu", **versions(),
        "threads": torch.get_num_threads(), "platform": platform.platform(terse=True),
        "date": started.isoformat(timespec="seconds"), "steady_state": not trace.training.first_step,
        "rounding": "each storage rounded up to 512 B (CUDA caching allocator blocks)",
        "timing": {k: round(v, 3) for k, v in trace.timing.items()},
    }
    detail = {k: int(rounded["detail"].get(k, 0)) for k in DETAIL_KEYS}
    peak = int(rounded["peak"])
    reserved = total = peak
    overhead: dict[str, int] = {}
    note = _NOTES[dev]
    phase_peaks = dict(rounded["phase_peaks"])
    if dev == "cuda" and trace.cuda is not None:
        cuda = dict(trace.cuda)
        cuda["workspace_at_start"] = max(0, int(cuda["allocated_at_start"]) - int(rounded["live_at_start"]))
        extra = int(cuda["max_allocated"]) - peak
        if extra >= 0:
            detail["overhead/workspaces"] = extra
            peak = int(cuda["max_allocated"])
        else:
            note += f"; the allocator's peak ({cuda['max_allocated']} B) is below the tracked tensors' ({peak} B)"
        phase_peaks = {k: min(peak, v + cuda["workspace_at_start"]) for k, v in phase_peaks.items()}
        phase_peaks[str(rounded["peak_phase"])] = peak
        reserved = max(int(cuda["max_reserved"]), peak)
        total = reserved + int(cuda["context"])
        overhead = {"cuda_context_bytes": int(cuda["context"]), "reserved_minus_allocated_bytes": reserved - peak,
                    "workspace_at_start_bytes": int(cuda["workspace_at_start"])}
        measured_with["cuda"] = cuda
    return Measurement(
        model=trace.model, training=trace.training, mode=dev, n_params=trace.n_params,
        n_trainable_params=trace.n_trainable, peak_allocated_bytes=peak, peak_reserved_bytes=reserved,
        device_total_bytes=total, peak_phase=str(rounded["peak_phase"]), peak_at=str(rounded["peak_at"]),
        detail_bytes=detail, phase_peaks_bytes=phase_peaks, overhead_bytes=overhead,
        peak_live_bytes=int(exact["peak"]), live_at_start_bytes=int(rounded["live_at_start"]),
        timeline=rounded["timeline"], measured_with=measured_with, note=note,
        saved_activations_bytes=int(rounded["saved_activations"]),
    )
