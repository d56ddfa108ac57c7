"""``trainmem measure`` and ``trainmem validate``, added to the main CLI by `add_subcommands`.

Nothing here imports torch at module import time: the estimator's CLI must work without the extra,
and ``trainmem validate --from-dataset`` needs only the stored dataset.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..errors import SpecError

__all__ = ["add_subcommands"]


def add_subcommands(sub: Any) -> None:
    """Add ``measure`` and ``validate`` to the ``trainmem`` subparsers."""
    from .options import add_model_options, add_training_options, nonempty, positive_int

    p = sub.add_parser(
        "measure", help="measure one real training step (fake tensors, CPU or a CUDA GPU; needs the measure extra)",
        description="Run one steady-state training step of the Hugging Face model and report its memory in the "
                    "JSON contract of `trainmem estimate`. --device fake runs PyTorch's CPU kernels on fake tensors: "
                    "exact accounting of any size without memory; compare with `trainmem estimate --device cpu`.",
    )
    add_model_options(p)
    add_training_options(p, device_choices=("fake", "cpu", "cuda"))
    p.add_argument("--json", action="store_true", help="print the JSON contract instead of a table")
    p.add_argument("--timeline", action="store_true", help="include the live-bytes timeline in --json output")
    p.add_argument("--out", type=nonempty, metavar="PATH", help="also write the JSON (with the timeline) to PATH")
    p.add_argument("--save-calibration", type=nonempty, metavar="PATH",
                   help="write what only the GPU shows (context, workspaces, reserved churn) as a calibration "
                        "JSON for `trainmem estimate --calibration` (--device cuda only)")
    p.add_argument("--force", action="store_true", help="let --out and --save-calibration replace existing files")
    if "--first-step" not in p._option_string_actions:  # unless the shared training options already have it
        p.add_argument("--first-step", action="store_true",
                       help="measure the first step (optimizer state created inside it), not a steady-state step")
    p.set_defaults(func=_cmd_measure)

    v = sub.add_parser(
        "validate", help="estimate vs measure over a matrix; writes a table, a CSV and a chart",
        description="Compare the estimator with measured steps. By default measures a quick matrix now (every "
                    "family, mostly fake mode, a few minutes on 2 cores); --from-dataset uses the stored dataset "
                    "(no torch needed); --remeasure regenerates the dataset first (10-15 minutes).",
    )
    src = v.add_mutually_exclusive_group()
    src.add_argument("--from-dataset", nargs="?", const="", default=None, metavar="PATH",
                     help="compare with the stored dataset (default: the one shipped with trainmem_nb)")
    src.add_argument("--remeasure", action="store_true",
                     help="measure the whole dataset matrix again into the --out folder (cases.jsonl), then compare")
    src.add_argument("--full", action="store_true", help="measure the whole dataset matrix live instead of the quick one")
    v.add_argument("--only", default="", metavar="TEXT", help="only cases whose id contains TEXT")
    v.add_argument("--out", type=nonempty, default="validation-report", metavar="DIR",
                   help="output folder (default validation-report); --remeasure writes its cases.jsonl there too")
    v.add_argument("--tolerance", type=float, default=0.03, help="allowed relative peak error (default 0.03)")
    v.add_argument("--jobs", type=positive_int, default=1, help="worker processes for --remeasure")
    v.add_argument("--force", action="store_true", help="let --remeasure replace a cases.jsonl already in --out")
    v.set_defaults(func=_cmd_validate)


def _cmd_measure(args: argparse.Namespace) -> int:
    from ..files import check_output_file
    from ..measure.extra import require_torch
    from .options import model_from_args, training_options_from_args

    # every output is checked before the step runs: a finished measurement must never be thrown away
    if args.out is not None:
        check_output_file(args.out, "--out", args.force)
    if args.save_calibration is not None:
        if args.device != "cuda":
            raise SpecError(f"--save-calibration needs --device cuda (got --device {args.device}): only a GPU shows "
                            f"its context and allocator overheads")
        check_output_file(args.save_calibration, "--save-calibration", args.force)
    layout = _fsdp_layout(args)
    model = model_from_args(args)
    options = training_options_from_args(args)
    options.pop("device")  # the kernels follow --device: cuda for cuda, cpu for fake and cpu
    require_torch()
    from ..measure.api import measure

    try:
        first = bool(getattr(args, "first_step", False))
        if layout is not None:
            result = _measure_fsdp_rank(model, options, layout, args.device)
        else:
            result = measure(model, device=args.device, prime=False if first else None, **options)
    except (SpecError, ValueError, RuntimeError, OSError):
        raise
    except MemoryError:
        raise RuntimeError("the step ran out of memory; use --device fake (exact accounting, no memory)") from None
    except Exception as exc:  # third-party code failed: one line, unless asked for the traceback
        if os.environ.get("TRAINMEM_DEBUG"):
            raise
        text = str(exc).splitlines()[0] if str(exc) else ""
        raise RuntimeError(f"the measured step failed: {type(exc).__name__}: {text} (TRAINMEM_DEBUG=1 for details)") from None
    # the result first, then the files: if a write fails, the measurement is on the screen
    if args.json:
        print(json.dumps(result.to_dict(timeline=args.timeline), indent=2))
    else:
        print(result.summary())
    return _write_measure_outputs(args, result)


def _write_measure_outputs(args: argparse.Namespace, result: Any) -> int:
    """Write --out and --save-calibration after the result is printed; a failure is one line saying the
    measurement is above (exit 2), never a lost measurement."""
    from ..files import write_text_atomic

    status = 0
    writes: list[tuple[str, str, Any]] = []
    if args.out is not None:
        writes.append(("--out", args.out, lambda: write_text_atomic(args.out, json.dumps(result.to_dict(), indent=2) + "\n")))
    if args.save_calibration is not None:
        from ..measure.cuda import write_calibration

        writes.append(("--save-calibration", args.save_calibration,
                       lambda: write_calibration(result, args.save_calibration, force=True)))
    for flag, path, write in writes:
        try:
            write()
        except (OSError, SpecError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            print(f"trainmem measure: error: {flag} {path}: could not write ({why}); the measurement is printed above",
                  file=sys.stderr)
            status = 2
        else:
            print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return status


def _fsdp_layout(args: argparse.Namespace) -> Any:
    """The FSDP2 layout to measure one rank of, None for one device; other layouts are refused: only
    FSDP2's data parallelism runs here (one process plays a rank over PyTorch's fake process group)."""
    from ..spec.parallel import Engine, ParallelSpec, build_parallel
    from .options import parallel_options_from_args

    layout = build_parallel(**parallel_options_from_args(args))
    if layout == ParallelSpec():
        return None
    fsdp = (layout.engine is Engine.FSDP and layout.zero >= 2 and layout.tp == layout.pp == layout.cp == layout.ep == 1
            and layout.offload.value == "none" and not layout.hybrid_shard)
    if not fsdp:
        changed = sorted(k for k, v in layout.model_dump().items() if v != getattr(ParallelSpec(), k))
        raise SpecError(
            f"trainmem measure runs one device, or one rank of an FSDP2 job (--engine fsdp --zero 2|3 --gpus N); "
            f"the layout ({', '.join('--' + k.replace('_', '-') for k in changed)}) is modelled by `trainmem estimate` only"
        )
    if args.device == "cuda":
        raise SpecError("an FSDP2 rank is measured with --device fake or cpu (one process, fake process group): "
                        "a multi-GPU CUDA job needs NCCL and several GPUs")
    return layout


def _measure_fsdp_rank(model: Any, options: dict[str, Any], layout: Any, device: str) -> Any:
    """Rank 0 (the largest shards) of an FSDP2 job, measured in this process."""
    from ..measure.api import measurement_from_trace
    from ..measure.fsdp import run_fsdp_step
    from ..spec.training import TrainingSpec

    t = TrainingSpec.model_validate({**options, "device": "cpu"})
    import dataclasses

    result = measurement_from_trace(run_fsdp_step(model, t, layout, rank=0, device=device))
    note = (f"{result.note}; rank 0 of {layout.dp} FSDP2 ranks over PyTorch's fake process group (collectives "
            "allocate their outputs as NCCL does, without gloo's copies)")
    return dataclasses.replace(result, parallel=layout.model_dump(mode="json"), note=note)


def _cmd_validate(args: argparse.Namespace) -> int:
    from ..measure.validate import measured_from_dataset, measured_live, run

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise SpecError(f"--out {out}: exists and is not a folder")
    if args.remeasure:  # into the folder the user names, never into the installed package
        from ..files import check_output_file
        from ..measure.dataset import regenerate
        from ..measure.extra import require_torch

        if not out.parent.is_dir() and str(out.parent):
            raise SpecError(f"--out {out}: its parent folder {out.parent} does not exist")
        out.mkdir(exist_ok=True)
        cases = check_output_file(out / "cases.jsonl", "--out", args.force)
        require_torch()
        _n, failures = regenerate(cases, only=args.only, keep=bool(args.only) and cases.exists(), jobs=args.jobs)
        from ..measure.report import write_dataset_reports

        write_dataset_reports(cases, folder=out)
        if failures:
            raise RuntimeError(f"{len(failures)} cases failed to measure, first: {failures[0]['id']}: {failures[0]['error']}")
        measured = measured_from_dataset(cases, args.only, what="--out")
        source = f"freshly re-measured dataset {cases}"
    elif args.from_dataset is not None:
        path = Path(args.from_dataset) if args.from_dataset else None
        measured = measured_from_dataset(path, args.only, what="--from-dataset")
        source = f"stored dataset {path or 'shipped with trainmem_nb (data/measured/cases.jsonl)'}"
    else:
        measured = measured_live(args.only, full=args.full, log=sys.stderr)
        source = f"live measurement of the {'full' if args.full else 'quick'} matrix"
    if not measured:
        raise SpecError(f"--only {args.only!r} matches no measured case")
    status, paths = run(measured, out, args.tolerance, source)
    for p in paths:
        print(f"wrote {p}")
    summary = json.loads((out / "validation.json").read_text())["rows"]
    over = [r for r in summary if not r["within_tolerance"]]
    print(f"{len(summary) - len(over)}/{len(summary)} cases within ±{100 * args.tolerance:g} % on the peak")
    return status
