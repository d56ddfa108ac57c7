"""Independent checks of the storage tracker: PyTorch's MemTracker and the process's resident memory.

* `memtracker_peak`: the same steady-state step under ``torch.distributed._tools.mem_tracker.MemTracker``
  (also a dispatch mode with weakrefs, written by PyTorch); its peak should equal our exact peak.
  It cannot track models with frozen parameters (LoRA): registering its grad hooks raises "cannot
  register a hook on a tensor that doesn't require gradient" in torch 2.13, which is why the product
  uses its own tracker.
* `rss_step_delta`: in a fresh process with glibc told to return freed memory at once
  (``MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0``), the resident high-water mark
  (``VmHWM`` reset through ``/proc/self/clear_refs``) grows during a real CPU step by the live
  tensor bytes plus a small allocator/runtime overhead.

Both run real CPU tensors (small models only) and are kept as tests (``tests/test_measure_crosscheck.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..model.spec import ModelSpec
from ..spec.training import TrainingSpec

__all__ = ["MALLOC_ENV", "memtracker_peak", "rss_step_delta"]

#: glibc settings that make RSS follow live memory (large blocks mmap'ed and unmapped on free).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def memtracker_peak(m: ModelSpec, t: TrainingSpec) -> dict[str, int]:
    """PyTorch MemTracker's peak (bytes, unrounded on CPU) of one steady-state step, by its categories."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from .step import _Setup, quiet_transformers

    with quiet_transformers():
        setup = _Setup(m, t, "cpu", prime=True)
        tracker = MemTracker()
        tracked: list[Any] = [setup.model, *setup.inputs.values()]
        if setup.opt is not None:
            tracked.append(setup.opt)
        tracker.track_external(*tracked)
        with tracker:
            setup.step()
        snapshot = tracker.get_tracker_snapshot("peak")
    out: dict[str, int] = {}
    for per_device in snapshot.values():
        for key, value in per_device.items():
            name = getattr(key, "value", str(key))
            out[name] = out.get(name, 0) + int(value)
    return out


def _read_status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _child(spec_json: str) -> dict[str, Any]:
    """In the subprocess: one warm-up step, reset VmHWM, one step; then the same step tracked."""
    from .step import StepTrace, _categorize, _Setup, quiet_transformers, summarize, traced_step

    data = json.loads(spec_json)
    m = ModelSpec.model_validate(data["model"])
    t = TrainingSpec.model_validate(data["training"])
    with quiet_transformers():
        setup = _Setup(m, t, "cpu", prime=True)
        setup.step()  # warm-up: thread pools, kernel caches and autograd's own state exist afterwards
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        rss_before = _read_status("VmRSS")
        setup.step()
        rss_hwm = _read_status("VmHWM")
        tracker = traced_step(setup)
        tracker.close()
    _categorize(tracker, setup.grad_records)
    trace = StepTrace(tracker, m, t, "cpu", 0, 0, {})
    s = summarize(trace, rounding=False, timeline_points=1)
    return {"rss_delta": rss_hwm - rss_before, "rss_before": rss_before, "rss_hwm": rss_hwm,
            "live_delta": int(s["peak"]) - int(s["live_at_start"]), "live_peak": int(s["peak"])}


def rss_step_delta(m: ModelSpec, t: TrainingSpec, timeout_s: float = 600) -> dict[str, Any]:
    """Run a real CPU step in a fresh process; returns its RSS growth and the tracker's live growth."""
    if not Path("/proc/self/clear_refs").exists():
        raise RuntimeError("rss_step_delta needs Linux /proc (VmHWM and clear_refs)")
    spec = json.dumps({"model": m.model_dump(mode="json"), "training": t.model_dump(mode="json")})
    env = {**os.environ, **MALLOC_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "trainmem_nb.measure.crosscheck", spec],
        capture_output=True, text=True, env=env, timeout=timeout_s, check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the RSS subprocess failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1])))
