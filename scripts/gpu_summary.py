"""Estimate beside a GPU measurement, one line per ``trainmem measure --device cuda --out`` file.

On a machine with a GPU, after ``scripts/gpu_check.sh`` (or any ``trainmem measure --device cuda --out``)::

    python scripts/gpu_summary.py m1.json m2.json ...

prints, for each step, the allocator's ``max_memory_allocated`` / ``max_memory_reserved`` and the
device's used memory (total − free) beside `estimate()`'s allocated peak, reserved peak and device total
for the same model and training spec, with the relative error of each. The estimate is rebuilt from the
measurement's own ``model_spec`` and ``training``, so both sides describe one step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from trainmem_nb.estimator.api import estimate
from trainmem_nb.model.spec import ModelSpec
from trainmem_nb.spec.training import TrainingSpec
from trainmem_nb.units import format_bytes


def rows(measurement: dict[str, Any]) -> list[tuple[str, int, int]]:
    """``(what, measured, estimated)`` for the allocated peak, the reserved peak and the device total."""
    cuda = (measurement.get("measured_with") or {}).get("cuda") or {}
    if not cuda:
        raise ValueError("not a --device cuda measurement")
    m = ModelSpec.model_validate(measurement["model_spec"])
    t = TrainingSpec.model_validate(measurement["training"])
    est = estimate(m, t)
    return [("allocated", int(cuda["max_allocated"]), est.peak_allocated_bytes),
            ("reserved", int(cuda["max_reserved"]), est.peak_reserved_bytes),
            ("device", int(cuda["device_used"]), est.device_total_bytes)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("measurements", nargs="+", type=Path, help="JSON files written by trainmem measure --out")
    args = ap.parse_args(argv)
    status = 0
    for path in args.measurements:
        try:
            d = json.loads(path.read_text())
            table = rows(d)
        except (OSError, ValueError, KeyError) as e:
            print(f"{path.name}: {e}", file=sys.stderr)
            status = 1
            continue
        t = d["training"]
        print(f"{path.stem}: {d['model']} mb={t['micro_batch']} seq={t['seq_len']} {t['precision']} {t['method']} "
              f"ckpt={t['checkpointing']} attn={t['attention']} alloc_conf={t.get('alloc_conf') or 'default'}")
        for what, meas, est in table:
            err = (est - meas) / meas * 100 if meas else float("nan")
            print(f"  {what:<10} measured {format_bytes(meas):>12}  estimated {format_bytes(est):>12}  {err:+6.1f} %")
    return status


if __name__ == "__main__":
    sys.exit(main())
