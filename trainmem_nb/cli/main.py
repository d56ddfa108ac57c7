"""``trainmem``: estimate (and, with the measure extra, measure) one training step's memory.

Every subcommand takes the same model and training options; bad input prints one line and exits 2."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

from ..errors import SpecError
from .options import (
    add_model_options,
    add_training_options,
    model_from_args,
    nonempty,
    parallel_options_from_args,
    positive_int,
    training_options_from_args,
)

__all__ = ['main']


def _cmd_estimate(args: argparse.Namespace) -> int:
    from ..estimator.api import estimate

    verdict = None
    if args.gpu is None and args.headroom is not None:
        raise SpecError("--headroom is the memory kept free on --gpu NAME: add --gpu (see `trainmem gpus`), "
                        "or drop --headroom")
    if args.gpu is not None:  # check the card before the estimate: a typo fails at once
        from ..planning.assumptions import PlanAssumptions, check_headroom
        from ..planning.gpus import get_gpu

        card = get_gpu(args.gpu)
        headroom = check_headroom(PlanAssumptions().headroom if args.headroom is None else args.headroom)
    from ..spec.calibration import load_calibration

    calibration = load_calibration(args.calibration, what="--calibration")
    est = estimate(model_from_args(args), calibration=calibration, **training_options_from_args(args),
                   **parallel_options_from_args(args))
    if args.gpu is not None:
        from ..planning.fit import fit

        verdict = fit(est, card, headroom)
    if args.json:
        data = est.to_dict()
        if verdict is not None:
            data["fit"] = verdict.to_dict()
        print(json.dumps(data, indent=2, allow_nan=False))
    else:
        print(est.summary())
        if verdict is not None:
            print(verdict.message)
            for note in verdict.notes:
                print(f"note: {note}")
    return 0


def _cmd_presets(args: argparse.Namespace) -> int:
    from ..model.presets import get_model, list_presets
    from ..units import format_count

    presets = list_presets()
    if args.json:
        print(json.dumps([{"name": p.name, "hf_id": p.hf_id, "n_params": get_model(p.name).n_params,
                           "source": p.source, "config_date": p.config_date} for p in presets], indent=2))
        return 0
    width = max(len(p.name) for p in presets)
    for p in presets:
        print(f"{p.name:<{width}}  {format_count(get_model(p.name).n_params):>7}  {p.config_date or '-':<10}  {p.hf_id}")
    return 0


def _cmd_stacks(args: argparse.Namespace) -> int:
    from ..spec.stack import list_stacks, resolve_stack

    stacks = [resolve_stack(name) for name in list_stacks()]
    if args.json:
        print(json.dumps([s.to_dict() for s in stacks], indent=2))
        return 0
    width = max(len(s.name) for s in stacks)
    for s in stacks:
        sets = ", ".join(f"{k}={a.value}" for k, a in s.options.items()) or "nothing"
        lib = f"{s.library} {s.version}" if s.library else "torch " + s.components["torch"]
        print(f"{s.name:<{width}}  {lib:<18}  {s.title}; sets {sets}")
    print("NAME@VERSION takes another version of the stack's library (hf-trainer@4.38: transformers 4.38); "
          "--torch, --transformers, --bitsandbytes, --peft and --cuda set one component")
    return 0


def _add_planner_subcommands(sub: Any) -> None:
    """``trainmem plan`` (which GPU, how many, how long, how much) and ``trainmem gpus`` (the catalog)."""
    pl = sub.add_parser("plan", help="which GPU, how many, how long and what it costs (searches layouts)")
    add_model_options(pl)
    add_training_options(pl)
    # what is not given is searched: leave the layout, micro-batch, accumulation and checkpointing unset
    pl.set_defaults(micro_batch=None, grad_accum=None, checkpointing=None, gpus=None, nodes=None, engine=None,
                    zero=None, hybrid_shard=None, tp=None, sp=None, pp=None, pp_schedule=None, virtual_stages=None,
                    cp=None, ep=None, offload=None, ddp_bucket_view=None,
                    no_pp_return_outputs=None, no_grad_accum_fusion=None, cross_entropy_loss_fusion=None)
    g = pl.add_argument_group("planning")
    g.add_argument("--gpu", action="append", type=nonempty, metavar="NAME",
                   help="GPU type to try (repeat; default: the whole catalog)")
    g.add_argument("--gpu-file", type=nonempty, metavar="PATH",
                   help="your own GPUs (CSV/YAML/JSON with the catalog's columns)")
    g.add_argument("--target-global-batch", type=positive_int, metavar="N", help="sequences per optimizer step to reach")
    g.add_argument("--tokens", type=nonempty, metavar="N", help="total training tokens, e.g. 2e9 (gives time and cost)")
    g.add_argument("--prices", type=nonempty, metavar="PATH", help="your prices (CSV/YAML/JSON); default: the dated snapshot")
    g.add_argument("--no-prices", action="store_true", help="do not cost the options")
    g.add_argument("--provider", type=nonempty, metavar="NAME", help="only this provider's prices")
    g.add_argument("--mfu", type=float, metavar="F", help="utilisation of the dense peak (default: per GPU class)")
    g.add_argument("--headroom", type=float, default=0.10, metavar="F", help="fraction of memory kept free (0.10)")
    g.add_argument("--max-gpus", type=positive_int, default=512, metavar="N", help="largest GPU count to try (512)")
    g.add_argument("--spot-rate", type=float, metavar="F", help="spot interruptions per node-hour (default 1/24)")
    g.add_argument("--storage-gbs", type=float, metavar="F", help="checkpoint write GB/s per node (default 1)")
    g.add_argument("--top", type=positive_int, default=15, metavar="N", help="rows in the table (15)")
    g.add_argument("--export", type=nonempty, metavar="DIR",
                   help="write ds_config.json, accelerate_fsdp.yaml, launch.sh for the best option (and a manifest)")
    g.add_argument("--force", action="store_true", help="let --export replace the files of an earlier export")
    g.add_argument("--best", default="cost", choices=["cost", "time", "gpus"], help="which option --export takes")
    pl.add_argument("--json", action="store_true", help="print the JSON contract instead of a table")
    pl.set_defaults(func=_cmd_plan)
    gp = sub.add_parser("gpus", help="list the GPU catalog (usable memory, dense TFLOPS, links, prices)")
    gp.add_argument("--json", action="store_true")
    gp.set_defaults(func=_cmd_gpus)


#: plan()'s argument names and the flags that set them, so an error names what the user typed.
_PLAN_FLAGS = {"storage_gbs": "--storage-gbs", "spot_interruptions_per_node_hour": "--spot-rate",
               "headroom": "--headroom", "mfu": "--mfu", "tokens": "--tokens", "max_gpus": "--max-gpus",
               "provider": "--provider", "target_global_batch": "--target-global-batch", "gpus": "--gpus"}


@contextmanager
def _flags_for(names: Mapping[str, str]) -> Iterator[None]:
    """Re-word a `SpecError` that starts with an argument name (``storage_gbs=0: ...``) with its flag."""
    try:
        yield
    except SpecError as exc:
        text = str(exc)
        for name, flag in names.items():
            if text.startswith((f"{name}=", f"{name}[")):
                raise SpecError(flag + text[len(name):]) from None
        raise


def _cmd_plan(args: argparse.Namespace) -> int:
    from ..errors import finite_number
    from ..planning.cost import SPOT_INTERRUPTIONS_PER_NODE_HOUR, STORAGE_WRITE_GBS_PER_NODE
    from ..planning.gpus import load_gpus, load_prices
    from ..planning.launch import MANIFEST, check_launch_dir, write_launch_files
    from ..planning.search import plan

    if args.export is not None:  # before the search: a folder we may not write into fails at once
        check_launch_dir(args.export, args.force, "--export")
    catalog = load_gpus(args.gpu_file, what="--gpu-file") if args.gpu_file is not None else []
    gpu_names = [n.strip() for item in args.gpu or [] for n in item.split(",")]
    if any(not n for n in gpu_names):
        raise SpecError(f"--gpu {','.join(gpu_names)!r} has an empty name; see `trainmem gpus` for the catalog")
    prices: Any = None if args.prices is None else load_prices(args.prices, catalog, what="--prices")
    par = {k: v for k, v in parallel_options_from_args(args).items() if v is not None}
    with _flags_for(_PLAN_FLAGS):
        result = plan(
            model_from_args(args), gpu=gpu_names or None, catalog=catalog, target_global_batch=args.target_global_batch,
            tokens=finite_number(args.tokens, "--tokens") if args.tokens is not None else None,
            prices=False if args.no_prices else prices, provider=args.provider, mfu=args.mfu,
            headroom=args.headroom, max_gpus=args.max_gpus,
            spot_interruptions_per_node_hour=SPOT_INTERRUPTIONS_PER_NODE_HOUR if args.spot_rate is None else args.spot_rate,
            storage_gbs=STORAGE_WRITE_GBS_PER_NODE if args.storage_gbs is None else args.storage_gbs,
            **training_options_from_args(args), **par,
        )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, allow_nan=False))
    else:
        print(result.summary(max_rows=args.top))
    if args.export is not None:
        best = result.best(args.best) or result.best("time") or result.best("gpus")  # unpriced: fastest, smallest
        if best is None:
            raise SpecError("--export: no option fits, nothing to export")
        command = "trainmem " + " ".join(shlex.quote(a) for a in (args.argv or []))
        paths = write_launch_files({**best, "family": result.model.family.value}, args.export, force=args.force,
                                   command=command)
        print(f"wrote {', '.join(str(p) for p in paths)} for {best['n_gpus']}x {best['gpu']} ({best['layout']}); "
              f"{MANIFEST} says which plan wrote them", file=sys.stderr if args.json else sys.stdout)
    return 0


def _cmd_gpus(args: argparse.Namespace) -> int:
    from ..planning.gpus import list_gpus, list_prices
    from ..units import format_bytes

    rows = []
    for g in list_gpus():
        offers = [p for p in list_prices(g) if p.on_demand_usd_per_gpu_hour is not None]
        cheapest = min(offers, key=lambda p: p.on_demand_usd_per_gpu_hour or 0.0, default=None)
        rows.append((g, cheapest))
    if args.json:
        print(json.dumps([{**g.model_dump(mode="json"), "interconnect_kind": g.interconnect_kind,
                           "cheapest_on_demand": p.model_dump(mode="json") if p else None} for g, p in rows], indent=2))
        return 0
    print(f"{'gpu':<30} {'usable':>11} {'bf16 TF':>8} {'link':<16} {'per node':>8}  cheapest on-demand $/GPU-h (seen)")
    for g, p in rows:
        link = f"{g.interconnect_kind} {_known(g.scale_up_bidir_gbs)}"
        price = f"{p.on_demand_usd_per_gpu_hour:.2f} {p.provider} ({p.date_seen})" if p else "-"
        bf16 = _known(g.bf16_tflops if g.supports_bf16 else None)
        print(f"{g.name:<30} {format_bytes(g.memory_bytes):>11} {bf16:>8} {link:<16} {g.gpus_per_node:>8}  {price}")
    print("usable = nvidia-smi memory.total; TFLOPS are dense ('-': not in the catalog, or no bf16); links "
          "bidirectional GB/s; prices are a dated snapshot")
    return 0


def _known(value: float | None) -> str:
    """A catalog number, or '-' when the catalog does not know it (never a misleading 0)."""
    return "-" if value is None else f"{value:g}"


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag gets one line (not the whole usage block) and exit status 2, and no
    flag is abbreviated (``--gpu`` must never silently mean ``--gpus``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if message.endswith("expected one argument"):  # '--params -7e9': argparse takes '-7e9' for a flag
            flag = message.split()[1].rstrip(":") if message.startswith("argument ") else "--flag"
            message += f" (for a negative or signed value write {flag}=VALUE, e.g. {flag}=-1)"
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``trainmem`` argument parser with all subcommands (they inherit its class)."""
    parser = _Parser(
        prog="trainmem", description="How much GPU memory does one training step need, and where does it go?"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    est = sub.add_parser("estimate", help="estimate one training step's memory (no torch needed)")
    add_model_options(est)
    add_training_options(est)
    est.add_argument("--calibration", type=nonempty, metavar="PATH",
                     help="a calibration JSON from `trainmem measure --device cuda`")
    est.add_argument("--gpu", type=nonempty, metavar="NAME",
                     help="also say whether the step fits this GPU (see `trainmem gpus`)")
    est.add_argument("--headroom", type=float, default=None, metavar="F",
                     help="with --gpu: fraction of its memory kept free (0.10)")
    est.add_argument("--json", action="store_true", help="print the JSON contract instead of a table")
    est.set_defaults(func=_cmd_estimate)
    pre = sub.add_parser("presets", help="list the model presets")
    pre.add_argument("--json", action="store_true")
    pre.set_defaults(func=_cmd_presets)
    stk = sub.add_parser("stacks", help="list the named training stacks and what each sets")
    stk.add_argument("--json", action="store_true")
    stk.set_defaults(func=_cmd_stacks)
    _add_planner_subcommands(sub)
    try:
        from .measure import add_subcommands
    except ImportError:  # the measure package is part of the wheel; its torch imports are lazy
        pass
    else:
        add_subcommands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``trainmem`` console script; returns the exit status.

    Bad input prints one line naming what is wrong and exits 2. Nothing from inside the package ever
    reaches the user as a traceback: an unexpected error is one line too, asking for a report
    (``TRAINMEM_DEBUG=1`` shows the traceback)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # output piped into `head`: not an error
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        return 130
    except (SpecError, ValueError, RuntimeError, OSError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"trainmem {args.command}: error: {message}", file=sys.stderr)
        return 2
    except Exception as exc:  # a bug: one line, never a traceback (unless asked for)
        if os.environ.get("TRAINMEM_DEBUG"):
            raise
        text = str(exc).splitlines()[0] if str(exc) else ""
        print(f"trainmem {args.command}: internal error: {type(exc).__name__}: {text} (a bug: please report the "
              f"command; TRAINMEM_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
