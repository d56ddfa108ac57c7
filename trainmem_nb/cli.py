"""``trainmem``: estimate (and, with the measure extra, measure) one training step's memory.

Every subcommand takes the same model and training options; bad input prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from .specs import Attention, Checkpointing, Method, OptimizerImpl, OptimizerName, Precision, SpecError

__all__ = [
    "add_model_options", "add_training_options", "main", "model_from_args", "parallel_options_from_args",
    "training_options_from_args",
]


def _choices(enum: Any) -> list[str]:
    return [m.value for m in enum]


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """``--model NAME | --hf-config PATH | --params N``: exactly one names the model."""
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--model", help="preset short name or Hugging Face repo id (see `trainmem presets`)")
    group.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json (file or folder)")
    group.add_argument("--params", metavar="N", help="a bare parameter count, e.g. 7e9 (llama-shaped)")


def add_training_options(parser: argparse.ArgumentParser, device_choices: Sequence[str] = ("cuda", "cpu")) -> None:
    """The training-step options shared by ``estimate`` and ``measure``."""
    g = parser.add_argument_group("training step")
    g.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    g.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    g.add_argument("--grad-accum", type=int, default=1, help="gradient-accumulation steps (default 1)")
    g.add_argument("--precision", default="bf16-mixed", metavar="|".join(_choices(Precision)))
    g.add_argument("--optimizer", default="adamw", metavar="|".join(_choices(OptimizerName)))
    g.add_argument("--optimizer-impl", default=None, metavar="|".join(_choices(OptimizerImpl)),
                   help="default: the device's PyTorch default (cuda: foreach, cpu: for-loop)")
    g.add_argument("--checkpointing", default="none", metavar="|".join(_choices(Checkpointing)))
    g.add_argument("--attention", default="sdpa", metavar="|".join(_choices(Attention)))
    g.add_argument("--dropout", type=float, default=None, help="every dropout rate (default: the config's)")
    g.add_argument("--device", default=device_choices[0], choices=list(device_choices))
    p = parser.add_argument_group("parallel layout")
    p.add_argument("--gpus", type=int, default=1, help="GPUs in total (default 1)")
    p.add_argument("--nodes", type=int, default=1, help="nodes they are spread over (default 1)")
    p.add_argument("--engine", default="ddp", metavar="ddp|fsdp|deepspeed|megatron")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage (fsdp: 2 shard-grad-op, 3 full-shard)")
    p.add_argument("--hybrid-shard", action="store_true", help="FSDP HYBRID_SHARD: shard within a node only")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--sp", action="store_true", help="sequence parallel (with --tp)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages")
    p.add_argument("--pp-schedule", default="1f1b", metavar="1f1b|interleaved|gpipe")
    p.add_argument("--virtual-stages", type=int, default=1)
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (MoE)")
    p.add_argument("--offload", default="none", metavar="none|optimizer|optimizer+params")
    p.add_argument("--ddp-bucket-view", action="store_true",
                   help="DDP gradient_as_bucket_view: gradients are views into the all-reduce buckets")
    p.add_argument("--no-pp-return-outputs", action="store_true",
                   help="the pipeline loop passes return_outputs=False: the last stage keeps no micro-batch's logits")
    f = parser.add_argument_group("fine-tuning")
    f.add_argument("--method", default="full", metavar="|".join(_choices(Method)))
    f.add_argument("--lora-rank", type=int, default=16)
    f.add_argument("--lora-alpha", type=float, default=32.0)
    f.add_argument("--lora-targets", default="qv", help="'qv', 'all-linear' or comma-separated module names")
    f.add_argument("--lora-dropout", type=float, default=0.0)
    f.add_argument("--lora-dtype", default="fp32", metavar="fp32|base",
                   help="adapter dtype: fp32 (peft's default) or the base weights' dtype")
    f.add_argument("--qlora-single-quant", action="store_true",
                   help="QLoRA without double quantization of the NF4 block scales")
    parser.add_argument("--first-step", action="store_true",
                        help="the very first step: the optimizer creates its state inside step()")


def model_from_args(args: argparse.Namespace) -> Any:
    """The `ModelSpec` named by ``--model``, ``--hf-config`` or ``--params``."""
    from .presets import get_model
    from .specs import ModelSpec, finite_number

    if args.model:
        return get_model(args.model)
    if args.hf_config:
        return ModelSpec.from_hf_config(args.hf_config)
    return ModelSpec.from_params(finite_number(args.params, "--params"))


def training_options_from_args(args: argparse.Namespace, device: str | None = None) -> dict[str, Any]:
    """Keyword options for `TrainingSpec` from parsed arguments."""
    return {
        "micro_batch": args.micro_batch, "seq_len": args.seq_len, "grad_accum": args.grad_accum,
        "precision": args.precision, "optimizer": args.optimizer, "optimizer_impl": args.optimizer_impl,
        "checkpointing": args.checkpointing, "attention": args.attention, "dropout": args.dropout,
        "device": device or args.device, "method": args.method, "lora_rank": args.lora_rank,
        "lora_alpha": args.lora_alpha, "lora_targets": args.lora_targets, "lora_dropout": args.lora_dropout,
        "lora_dtype": args.lora_dtype, "qlora_double_quant": not args.qlora_single_quant, "first_step": args.first_step,
    }


def parallel_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword options for `ParallelSpec` from parsed arguments."""
    return {
        "gpus": args.gpus, "nodes": args.nodes, "engine": args.engine, "zero": args.zero,
        "hybrid_shard": args.hybrid_shard, "tp": args.tp, "sp": args.sp, "pp": args.pp,
        "pp_schedule": args.pp_schedule, "virtual_stages": args.virtual_stages, "cp": args.cp, "ep": args.ep,
        "offload": args.offload, "ddp_bucket_view": args.ddp_bucket_view,
        "pp_return_outputs": None if args.no_pp_return_outputs is None else not args.no_pp_return_outputs,
    }


def _cmd_estimate(args: argparse.Namespace) -> int:
    from .estimate import estimate

    est = estimate(model_from_args(args), calibration=args.calibration, **training_options_from_args(args),
                   **parallel_options_from_args(args))
    if args.json:
        print(json.dumps(est.to_dict(), indent=2))
    else:
        print(est.summary())
    return 0


def _cmd_presets(args: argparse.Namespace) -> int:
    from .presets import get_model, list_presets
    from .units import format_count

    rows = [(p.name, p.hf_id, format_count(get_model(p.name).n_params)) for p in list_presets()]
    if args.json:
        print(json.dumps([{"name": n, "hf_id": h, "n_params": get_model(n).n_params} for n, h, _ in rows], indent=2))
        return 0
    width = max(len(r[0]) for r in rows)
    for name, hf_id, count in rows:
        print(f"{name:<{width}}  {count:>7}  {hf_id}")
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
                    no_pp_return_outputs=None)
    g = pl.add_argument_group("planning")
    g.add_argument("--gpu", action="append", metavar="NAME", help="GPU type to try (repeat; default: the whole catalog)")
    g.add_argument("--gpu-file", metavar="PATH", help="your own GPUs (CSV/YAML/JSON with the catalog's columns)")
    g.add_argument("--target-global-batch", type=int, metavar="N", help="sequences per optimizer step to reach")
    g.add_argument("--tokens", metavar="N", help="total training tokens, e.g. 2e9 (gives time and cost)")
    g.add_argument("--prices", metavar="PATH", help="your prices (CSV/YAML/JSON); default: the dated snapshot")
    g.add_argument("--no-prices", action="store_true", help="do not cost the options")
    g.add_argument("--provider", metavar="NAME", help="only this provider's prices")
    g.add_argument("--mfu", type=float, metavar="F", help="utilisation of the dense peak (default: per GPU class)")
    g.add_argument("--headroom", type=float, default=0.10, metavar="F", help="fraction of memory kept free (0.10)")
    g.add_argument("--max-gpus", type=int, default=512, metavar="N", help="largest GPU count to try (512)")
    g.add_argument("--spot-rate", type=float, metavar="F", help="spot interruptions per node-hour (default 1/24)")
    g.add_argument("--storage-gbs", type=float, metavar="F", help="checkpoint write GB/s per node (default 1)")
    g.add_argument("--top", type=int, default=15, metavar="N", help="rows in the table (15)")
    g.add_argument("--export", metavar="DIR", help="write ds_config.json, accelerate_fsdp.yaml, launch.sh for the best option")
    g.add_argument("--best", default="cost", choices=["cost", "time", "gpus"], help="which option --export takes")
    pl.add_argument("--json", action="store_true", help="print the JSON contract instead of a table")
    pl.set_defaults(func=_cmd_plan)
    gp = sub.add_parser("gpus", help="list the GPU catalog (usable memory, dense TFLOPS, links, prices)")
    gp.add_argument("--json", action="store_true")
    gp.set_defaults(func=_cmd_gpus)


def _cmd_plan(args: argparse.Namespace) -> int:
    from .gpus import load_gpus
    from .launch import write_launch_files
    from .planner import SPOT_INTERRUPTIONS_PER_NODE_HOUR, STORAGE_WRITE_GBS_PER_NODE, plan
    from .specs import finite_number

    catalog = load_gpus(args.gpu_file) if args.gpu_file else []
    gpu_names = [n.strip() for item in args.gpu or [] for n in item.split(",") if n.strip()] or None
    par = {k: v for k, v in parallel_options_from_args(args).items() if v is not None}
    par["n_gpus"] = par.pop("gpus", None)  # plan(gpus=...) names GPU types; --gpus is the count
    result = plan(
        model_from_args(args), gpus=gpu_names, catalog=catalog, target_global_batch=args.target_global_batch,
        tokens=finite_number(args.tokens, "--tokens") if args.tokens else None,
        prices=False if args.no_prices else args.prices, provider=args.provider, mfu=args.mfu,
        headroom=args.headroom, max_gpus=args.max_gpus,
        spot_interruptions_per_node_hour=SPOT_INTERRUPTIONS_PER_NODE_HOUR if args.spot_rate is None else args.spot_rate,
        storage_gbs=STORAGE_WRITE_GBS_PER_NODE if args.storage_gbs is None else args.storage_gbs,
        **training_options_from_args(args), **par,
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.summary(max_rows=args.top))
    if args.export:
        best = result.best(args.best) or result.best("time") or result.best("gpus")  # unpriced: fastest, smallest
        if best is None:
            raise SpecError("--export: no option fits, nothing to export")
        paths = write_launch_files({**best, "family": result.model.family.value}, args.export)
        print(f"wrote {', '.join(str(p) for p in paths)} for {best['n_gpus']}x {best['gpu']} ({best['layout']})",
              file=sys.stderr if args.json else sys.stdout)
    return 0


def _cmd_gpus(args: argparse.Namespace) -> int:
    from .gpus import list_gpus, list_prices
    from .units import format_bytes

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
        link = f"{g.interconnect_kind} {g.scale_up_bidir_gbs or 0:g}"
        price = f"{p.on_demand_usd_per_gpu_hour:.2f} {p.provider} ({p.date_seen})" if p else "-"
        print(f"{g.name:<30} {format_bytes(g.memory_bytes):>11} {g.bf16_tflops or 0:>8g} {link:<16} "
              f"{g.gpus_per_node:>8}  {price}")
    print("usable = nvidia-smi memory.total; TFLOPS are dense; links bidirectional GB/s; prices are a dated snapshot")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag gets one line (not the whole usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
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
    est.add_argument("--calibration", metavar="PATH", help="a calibration JSON from `trainmem measure --device cuda`")
    est.add_argument("--json", action="store_true", help="print the JSON contract instead of a table")
    est.set_defaults(func=_cmd_estimate)
    pre = sub.add_parser("presets", help="list the model presets")
    pre.add_argument("--json", action="store_true")
    pre.set_defaults(func=_cmd_presets)
    _add_planner_subcommands(sub)
    try:
        from .measure.cli import add_subcommands
    except ImportError:  # the measure package is part of the wheel; its torch imports are lazy
        pass
    else:
        add_subcommands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``trainmem`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # output piped into `head`: not an error
        sys.stderr.close()
        return 0
    except (SpecError, ValueError, RuntimeError, OSError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"trainmem {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
