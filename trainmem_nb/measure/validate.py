"""``trainmem validate``: the estimator against measured steps, with per-case errors, a table and a chart.

Two sources of measurements: live (measure a matrix now, mostly on fake tensors; needs torch) or the
stored dataset (``--from-dataset``; no torch). For every case the estimate is
``estimate(case.model, case.training)`` (device ``cpu``: the kernels that were measured). Writes
``validation.md``, ``validation.csv`` and ``validation.png`` (matplotlib, if installed) to ``--out``;
the exit status is 1 when any case's peak error exceeds ``--tolerance`` or the estimator fails on it.
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from ..engine.breakdown import TOP_KEYS
from ..units import format_bytes
from .result import Measurement

__all__ = ["CATEGORY_SLACK_BYTES", "CATEGORY_TOLERANCE", "compare", "plot_errors", "run", "write_report"]

#: A category agrees when within ±5 % or 64 MiB of the measurement (issue 2's accuracy target).
CATEGORY_TOLERANCE = 0.05
CATEGORY_SLACK_BYTES = 64 << 20


def _estimate_dict(m: Measurement) -> dict[str, Any]:
    """The estimator's ``to_dict()`` for a measured case (monkeypatched in plumbing tests)."""
    from ..estimator.api import estimate

    return estimate(m.model, m.training).to_dict()


def _rel(est: int, meas: int) -> float:
    if meas:
        return (est - meas) / meas
    return 0.0 if est == 0 else math.inf


def compare(case_id: str, measured: Measurement, tolerance: float,
            estimator: Callable[[Measurement], dict[str, Any]] | None = None) -> dict[str, Any]:
    """One CSV row: measured vs estimated peak, phase and each top-level category."""
    row: dict[str, Any] = {
        "id": case_id, "family": measured.model.family.value, "mode": measured.mode,
        "n_params": measured.n_params, "peak_measured": measured.peak_allocated_bytes,
        "phase_measured": measured.peak_phase,
    }
    try:
        est = (estimator or _estimate_dict)(measured)
    except Exception as exc:  # the estimator may not support a case yet: reported, and a failure
        row.update(peak_estimated="", peak_err="", phase_estimated="", phase_ok=False, categories_ok=False,
                   within_tolerance=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        for k in TOP_KEYS:
            row.update({f"{k}_measured": measured.breakdown_bytes[k], f"{k}_estimated": "", f"{k}_err": ""})
        return row
    peak_err = _rel(int(est["peak_allocated_bytes"]), measured.peak_allocated_bytes)
    cats_ok = True
    for k in TOP_KEYS:
        mv = measured.breakdown_bytes[k]
        ev = int(est["breakdown_bytes"].get(k, 0))
        row[f"{k}_measured"], row[f"{k}_estimated"], row[f"{k}_err"] = mv, ev, _rel(ev, mv)
        if abs(ev - mv) > max(CATEGORY_TOLERANCE * mv, CATEGORY_SLACK_BYTES):
            cats_ok = False
    row.update(
        peak_estimated=int(est["peak_allocated_bytes"]), peak_err=peak_err, phase_estimated=est["peak_phase"],
        phase_ok=est["peak_phase"] == measured.peak_phase, categories_ok=cats_ok,
        within_tolerance=abs(peak_err) <= tolerance, error="",
    )
    return row


def _fmt_err(x: Any) -> str:
    if x == "" or x is None:
        return ""
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{100 * float(x):+.2f}%"


def plot_errors(rows: Sequence[dict[str, Any]], tolerance: float, ax: Any = None) -> list[Any]:
    """Horizontal bars of each case's peak error (%) with the ±tolerance band; returns the artists.

    Green bars are within the tolerance, red ones past it; a case the estimator could not run is
    labelled in grey at zero.
    """
    if ax is None:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(9, max(3.0, 0.14 * len(rows) + 1.2)))
        ax = fig.add_subplot()
    errs = [0.0 if r["peak_err"] == "" else max(-1.0, min(1.0, float(r["peak_err"]))) * 100 for r in rows]
    colors = ["tab:green" if r["within_tolerance"] else "tab:red" for r in rows]
    artists: list[Any] = [ax.barh(range(len(rows)), errs, color=colors)]
    for i, r in enumerate(rows):
        if r["error"]:
            artists.append(ax.text(0, i, " estimator error", color="grey", va="center", fontsize=5))
    artists.append(ax.axvline(100 * tolerance, color="grey", linestyle="--", linewidth=0.8))
    artists.append(ax.axvline(-100 * tolerance, color="grey", linestyle="--", linewidth=0.8))
    ax.set_yticks(range(len(rows)), [r["id"] for r in rows], fontsize=5)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel("estimated peak vs measured (%), clipped to ±100 %")
    ax.set_title(f"estimate vs measure: {sum(bool(r['within_tolerance']) for r in rows)}/{len(rows)} "
                 f"within ±{100 * tolerance:g} %")
    return artists


def write_report(rows: Sequence[dict[str, Any]], out: Path, tolerance: float, source: str) -> list[Path]:
    """Write ``validation.csv``, ``validation.md`` and (with matplotlib) ``validation.png`` into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    columns = ["id", "family", "mode", "n_params", "peak_measured", "peak_estimated", "peak_err", "phase_measured",
               "phase_estimated", "phase_ok"]
    for k in TOP_KEYS:
        columns += [f"{k}_measured", f"{k}_estimated", f"{k}_err"]
    columns += ["categories_ok", "within_tolerance", "error"]
    csv_path = out / "validation.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for r in rows:
            writer.writerow({c: r.get(c, "") for c in columns})
    paths.append(csv_path)
    chart_note = "chart: `validation.png`"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        chart_note = "chart skipped: matplotlib is not installed (pip install matplotlib)"
    else:
        _figure(rows, tolerance).savefig(out / "validation.png", dpi=130, bbox_inches="tight")
        paths.append(out / "validation.png")
    failed = [r for r in rows if not r["within_tolerance"]]
    errors = [r for r in rows if r["error"]]
    lines = [
        "# trainmem validate: estimate vs measure",
        "",
        f"Source: {source}. {len(rows)} cases; {len(rows) - len(failed)} within ±{100 * tolerance:g} % on the peak; "
        f"{sum(bool(r['phase_ok']) for r in rows)} with the peak phase right; "
        f"{sum(bool(r['categories_ok']) for r in rows)} with every category within ±{100 * CATEGORY_TOLERANCE:g} % "
        f"or {CATEGORY_SLACK_BYTES >> 20} MiB; {len(errors)} the estimator could not run. {chart_note}.",
        "",
        "| case | measured peak | estimated peak | error | phase (measured / estimated) | worst category | status |",
        "|---|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        if r["error"]:
            lines.append(f"| `{r['id']}` | {format_bytes(r['peak_measured'])} | | | {r['phase_measured']} / | | "
                         f"estimator error: {r['error']} |")
            continue
        worst = max(TOP_KEYS, key=lambda k: abs(r[f"{k}_estimated"] - r[f"{k}_measured"]))
        lines.append(
            f"| `{r['id']}` | {format_bytes(r['peak_measured'])} | {format_bytes(r['peak_estimated'])} | "
            f"{_fmt_err(r['peak_err'])} | {r['phase_measured']} / {r['phase_estimated']} | "
            f"{worst} {_fmt_err(r[f'{worst}_err'])} | {'ok' if r['within_tolerance'] else 'OVER'} |"
        )
    md_path = out / "validation.md"
    md_path.write_text("\n".join(lines) + "\n")
    paths.insert(0, md_path)
    return paths


def _figure(rows: Sequence[dict[str, Any]], tolerance: float) -> Any:
    """A standalone matplotlib Figure (no pyplot, no global backend) with `plot_errors` drawn on it."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, max(3.0, 0.12 * len(rows) + 1.2)))
    plot_errors(rows, tolerance, ax=fig.add_subplot())
    return fig


def measured_from_dataset(path: Path | None, only: str = "", what: str = "dataset") -> list[tuple[str, Measurement]]:
    """``(id, Measurement)`` of the stored cases whose id contains `only` (errors name `what`)."""
    from .dataset import load_cases

    return [(c.id, c.measurement) for c in load_cases(path, what=what) if only in c.id]


def measured_live(only: str = "", full: bool = False, log: Any = None) -> list[tuple[str, Measurement]]:
    """Measure the quick (default) or full matrix now; needs torch."""
    from .extra import require_torch

    require_torch()
    from .api import measure
    from .dataset import full_matrix, quick_matrix

    out = []
    cases = [c for c in (full_matrix() if full else quick_matrix()) if only in c.id]
    for n, case in enumerate(cases, 1):
        t0 = time.perf_counter()
        r = measure(case.model, case.training, device=case.mode, check_ram=False)
        if log is not None:
            print(f"[{n}/{len(cases)}] {case.id} ({time.perf_counter() - t0:.1f} s)", file=log, flush=True)
        out.append((case.id, r))
    return out


def run(measured: Iterable[tuple[str, Measurement]], out: Path, tolerance: float, source: str,
        estimator: Callable[[Measurement], dict[str, Any]] | None = None) -> tuple[int, list[Path]]:
    """Compare every measured case with its estimate and write the report; returns (exit status, files)."""
    if not math.isfinite(tolerance) or tolerance < 0:
        raise ValueError(f"--tolerance={tolerance!r} must be a non-negative number (0.03 = 3 %)")
    rows = [compare(i, m, tolerance, estimator) for i, m in measured]
    if not rows:
        raise ValueError("no cases to validate (check --only)")
    paths = write_report(rows, out, tolerance, source)
    (out / "validation.json").write_text(json.dumps({"tolerance": tolerance, "source": source, "rows": rows},
                                                    indent=1, default=str) + "\n")
    paths.append(out / "validation.json")
    return (0 if all(r["within_tolerance"] for r in rows) else 1), paths
