"""Build every preset with transformers on the meta device and record ``sum(p.numel())`` in presets.json.

Usage: python scripts/record_preset_params.py [--check]
With --check it changes nothing and exits 1 if a recorded count, or trainmem_nb's own count, differs
from what transformers builds. Needs the ``measure`` extra (torch, transformers).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainmem_nb.measure.models import hf_param_shapes
from trainmem_nb.model.params import count_params
from trainmem_nb.model.presets import get_model, list_presets

DATA = Path(__file__).resolve().parents[1] / "trainmem_nb" / "data" / "presets.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; write nothing")
    args = parser.parse_args()
    doc = json.loads(DATA.read_text())
    bad = 0
    for entry, preset in zip(doc["presets"], list_presets(), strict=True):
        shapes = hf_param_shapes(preset.config)
        hf_total = sum(_numel(s) for s in shapes.values())
        ours = count_params(get_model(preset.name))  # a multimodal checkpoint's vision tower too
        status = "ok" if ours == hf_total else f"MISMATCH ours={ours}"
        if entry.get("n_params") not in (None, hf_total) and args.check:
            status += f" recorded={entry['n_params']}"
            bad += 1
        if ours != hf_total:
            bad += 1
        print(f"{preset.name:18s} {hf_total:>16,d} {status}")
        entry["n_params"] = hf_total
    if not args.check:
        DATA.write_text(json.dumps(doc, indent=1) + "\n")
    return 1 if bad else 0


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    sys.exit(main())
