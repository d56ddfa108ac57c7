"""Reports about the dataset: ``validation/SUMMARY.md`` and the harness agreement.

Both are regenerated from ``trainmem_nb/data/measured/cases.jsonl`` and ``harness_cases.json`` by
``python -m trainmem_nb.measure.dataset`` (no torch needed for this step).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from ..engine.breakdown import TOP_KEYS
from ..units import format_bytes

__all__ = ["harness_agreement", "write_dataset_reports"]


def harness_agreement(cases_path: Path, harness_path: Path) -> list[dict[str, Any]]:
    """Our stored re-measurement of each harness case against the harness's own numbers."""
    from .harness import compare, load_harness_cases

    ours = {}
    for line in cases_path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            ours[row["id"]] = row
    rows = []
    for case in load_harness_cases(harness_path):
        mine = ours.get(case["id"])
        if mine is None:
            rows.append({"id": case["id"], "missing": True})
            continue
        rows.append(compare(mine, case))
    return rows


def _pct(x: float) -> str:
    return f"{100 * x:+.3f}%"


def write_dataset_reports(cases_path: Path, harness_path: Path | None = None, folder: Path | None = None) -> list[Path]:
    """Write ``SUMMARY.md`` (every case) and ``harness_agreement.{md,json}`` into `folder` (default: next
    to `cases_path`); the harness cases default to the shipped ones."""
    from .paths import HARNESS_FILE

    folder = folder or cases_path.parent
    rows = [json.loads(line) for line in cases_path.read_text().splitlines() if line.strip()]
    written = []
    groups = Counter(r["group"] for r in rows)
    families = Counter(r["family"] for r in rows)
    versions = Counter(
        f"torch {r['measured_with']['torch']}, transformers {r['measured_with']['transformers']}, "
        f"peft {r['measured_with']['peft']}, python {r['measured_with']['python']}" for r in rows
    )
    modes = Counter(r["measured_with"]["device"] for r in rows)
    wall = sum(r["measured_with"]["timing"].get("wall_s", 0.0) for r in rows)
    lines = [
        "# Measured training steps (generated)",
        "",
        f"{len(rows)} cases in `{cases_path.name}`; regenerate with `python -m trainmem_nb.measure.dataset` "
        f"(sum of per-case wall times: {wall / 60:.0f} min). Bytes are 512-B-rounded tensor storages at the peak "
        "(CPU kernels; compare with `estimate(..., device='cpu')`).",
        "",
        "- groups: " + ", ".join(f"{g} {n}" for g, n in sorted(groups.items())),
        "- families: " + ", ".join(f"{f} {n}" for f, n in sorted(families.items())),
        "- modes: " + ", ".join(f"{m} {n}" for m, n in sorted(modes.items())),
        "- versions: " + "; ".join(f"{v} ({n})" for v, n in versions.items()),
        "",
        "| id | params | peak | phase | " + " | ".join(TOP_KEYS) + " | s |",
        "|---|---:|---:|---|" + "---:|" * len(TOP_KEYS) + "---:|",
    ]
    for r in sorted(rows, key=lambda r: r["id"]):
        b = r["breakdown_bytes"]
        lines.append(
            f"| `{r['id']}` | {r['n_params']:,} | {format_bytes(r['peak_allocated_bytes'])} | {r['peak_phase']} | "
            + " | ".join(format_bytes(b.get(k, 0)) for k in TOP_KEYS)
            + f" | {r['measured_with']['timing'].get('wall_s', 0):.1f} |"
        )
    summary = folder / "SUMMARY.md"
    summary.write_text("\n".join(lines) + "\n")
    written.append(summary)
    hpath = harness_path or (folder / "harness_cases.json" if (folder / "harness_cases.json").exists() else HARNESS_FILE)
    if hpath.exists():
        agree = harness_agreement(cases_path, hpath)
        (folder / "harness_agreement.json").write_text(json.dumps(agree, indent=1, sort_keys=True) + "\n")
        written.append(folder / "harness_agreement.json")
        done = [a for a in agree if not a.get("missing")]
        worst = max((abs(a["peak_rel_err"]) for a in done), default=0.0)
        exact = sum(1 for a in done if a["peak_ours"] == a["peak_harness"] and a["live_peak_ours"] == a["live_peak_harness"])
        phase_ok = sum(1 for a in done if a["phase_ours"] == a["phase_harness"])
        md = [
            "# Agreement with the independent harness (generated)",
            "",
            f"{len(done)} of {len(agree)} harness runs re-measured by `trainmem measure` (fake mode; fake == real "
            f"is tested). Peak (512-B rounded) vs the harness's `peak_cuda512`: worst |error| {_pct(worst)}; "
            f"{exact} byte-identical (rounded and unrounded peaks); peak phase equal in {phase_ok}. Categories: "
            "our top-level keys vs the harness's categories mapped onto them (`trainmem_nb.measure.harness.HARNESS_TOP`); "
            "for its real-tensor checkpointed runs, activations and transient are compared as their sum (the harness "
            "README's caveat).",
            "",
            "| harness run | peak ours | peak harness | error | phase ours / harness | worst category error |",
            "|---|---:|---:|---:|---|---|",
        ]
        for a in agree:
            if a.get("missing"):
                md.append(f"| `{a['id']}` | not measured | | | | |")
                continue
            cat = max(a["category_rel_err"].items(), key=lambda kv: abs(kv[1]))
            md.append(
                f"| `{a['id'].removeprefix('harness/')}` | {a['peak_ours']:,} | {a['peak_harness']:,} | "
                f"{_pct(a['peak_rel_err'])} | {a['phase_ours']} / {a['phase_harness']} | {cat[0]} {_pct(cat[1])} |"
            )
        (folder / "harness_agreement.md").write_text("\n".join(md) + "\n")
        written.append(folder / "harness_agreement.md")
    return written
