"""The options every ``trainmem`` subcommand shares: the model, the training step and the layout.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from ..spec.choices import (
    AdafactorImpl,
    Attention,
    Checkpointing,
    Fp8Recipe,
    LossImpl,
    Method,
    OptimizerImpl,
    OptimizerName,
    Precision,
)
from ..spec.stack import COMPONENTS

__all__ = ['add_model_options', 'add_training_options', 'model_from_args', 'parallel_options_from_args', 'training_options_from_args']


def _choices(enum: Any) -> list[str]:
    return [m.value for m in enum]


def nonempty(text: str) -> str:
    """An argparse type for names and paths: ``--model ''`` is a mistake, not "no model"."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give a value (or leave the option out)")
    return text


def positive_int(text: str) -> int:
    """An argparse type for counts only the CLI has (``--top``, ``--max-gpus``, ``--jobs``): an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """``--model NAME | --hf-config PATH | --params N``: exactly one names the model."""
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--model", type=nonempty, help="preset short name or Hugging Face repo id (see `trainmem presets`)")
    group.add_argument("--hf-config", type=nonempty, metavar="PATH", help="a Hugging Face config.json (file or folder)")
    group.add_argument("--params", type=nonempty, metavar="N", help="a bare parameter count, e.g. 7e9 (llama-shaped)")


def add_training_options(parser: argparse.ArgumentParser, device_choices: Sequence[str] = ("cuda", "cpu")) -> None:
    """The training-step options shared by ``estimate`` and ``measure``."""
    g = parser.add_argument_group("training step")
    g.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (default 1)")
    g.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    g.add_argument("--grad-accum", type=int, default=1, help="gradient-accumulation steps (default 1)")
    g.add_argument("--precision", default=None, metavar="|".join([*_choices(Precision), "fp8"]),
                   help="default: bf16-mixed; bf16-true (a 16-bit frozen base) with --method lora or qlora; fp8 is "
                        "bf16-true with --fp8 tensorwise")
    g.add_argument("--fp8", default=None, metavar="|".join(_choices(Fp8Recipe)),
                   help="fp8 matmuls in the transformer blocks' linears (torchao Float8Linear, eager) with tensorwise "
                        "or rowwise scaling; with --engine megatron Transformer Engine's delayed or tensorwise "
                        "(current) scaling (default: none)")
    g.add_argument("--fp8-all-gather", action="store_true",
                   help="with --fp8 tensorwise under FSDP2: all-gather the converted weights in fp8 (torchao's "
                        "enable_fsdp_float8_all_gather)")
    g.add_argument("--optimizer", default="adamw", metavar="|".join(_choices(OptimizerName)))
    g.add_argument("--optimizer-impl", default=None, metavar="|".join(_choices(OptimizerImpl)),
                   help="default: the device's PyTorch default (cuda: foreach, cpu: for-loop)")
    g.add_argument("--adafactor", default=None, metavar="|".join(_choices(AdafactorImpl)),
                   help="--optimizer adafactor: torch.optim's or transformers' (what the HF Trainer's "
                        "optim='adafactor' builds); default: the stack's, else torch")
    g.add_argument("--checkpointing", default="none", metavar="|".join(_choices(Checkpointing)))
    g.add_argument("--attention", default="sdpa", metavar="|".join(_choices(Attention)))
    g.add_argument("--loss-impl", default=None, metavar="|".join(_choices(LossImpl)),
                   help="the head's loss: transformers' (standard, the default), torchtune's chunked, Liger's fused "
                        "linear cross-entropy or Cut Cross-Entropy (the last two: CUDA); default: the stack's")
    g.add_argument("--loss-chunks", type=int, default=None, help="--loss-impl chunked: chunks of tokens (default 8)")
    g.add_argument("--dropout", type=float, default=None, help="every dropout rate (default: the stack's, else the "
                   "config's)")
    g.add_argument("--device", default=device_choices[0], choices=list(device_choices))
    s = parser.add_argument_group("training stack")
    s.add_argument("--stack", default="", metavar="NAME[@VERSION]|PATH",
                   help="the stack that runs the step (`trainmem stacks`): e.g. hf-trainer@4.38 (transformers 4.38), "
                        "torchtune, litgpt, or a stack file; default: today's versions")
    for comp in COMPONENTS:
        s.add_argument(f"--{comp}", default=None, metavar="VERSION", help=f"the {comp} version (default: the stack's)")
    p = parser.add_argument_group("parallel layout")
    p.add_argument("--gpus", type=int, default=1, help="GPUs in total (default 1)")
    p.add_argument("--nodes", type=int, default=1, help="nodes they are spread over (default 1)")
    p.add_argument("--engine", default=None, metavar="ddp|fsdp|deepspeed|megatron",
                   help="default: deepspeed with --zero 2/3 or --offload (as the API), else ddp")
    p.add_argument("--zero", type=int, default=None, choices=[0, 1, 2, 3],
                   help="ZeRO stage (default 0; fsdp: 2 shard-grad-op, 3 full-shard, its default, 0 no-shard)")
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
    p.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="--engine megatron: its jit-fused vocab-parallel cross-entropy (one more fp32 copy of the "
                        "logits while the loss runs)")
    p.add_argument("--no-grad-accum-fusion", action="store_true",
                   help="--engine megatron: --no-gradient-accumulation-fusion (each linear makes a 16-bit weight "
                        "gradient before adding it into main_grad)")
    p.add_argument("--fsdp-version", type=int, default=None, choices=[1, 2],
                   help="--engine fsdp: 2 fully_shard, 1 FullyShardedDataParallel (default: the stack's, else 2)")
    p.add_argument("--no-use-orig-params", action="store_true",
                   help="--fsdp-version 1: FullyShardedDataParallel(use_orig_params=False)")
    p.add_argument("--sync-module-states", action="store_true",
                   help="--fsdp-version 1: FullyShardedDataParallel(sync_module_states=True), as the HF Trainer sets it")
    f = parser.add_argument_group("fine-tuning")
    f.add_argument("--method", default="full", metavar="|".join(_choices(Method)))
    f.add_argument("--lora-rank", type=int, default=None, help="--method lora|qlora: the adapters' rank (16)")
    f.add_argument("--lora-alpha", type=float, default=None, help="--method lora|qlora: (32)")
    f.add_argument("--lora-targets", default=None,
                   help="--method lora|qlora: 'qv' (the default), 'all-linear' or comma-separated module names")
    f.add_argument("--lora-dropout", type=float, default=None, help="default: the stack's, else 0")
    f.add_argument("--lora-dtype", default=None, metavar="fp32|base|weight",
                   help="adapter dtype: fp32 (peft's default since 0.12), base (the model's dtype: litgpt, torchtune) or "
                        "weight (the adapted weight's if floating, else fp32: peft < 0.12) (default: the stack's, else fp32)")
    f.add_argument("--qlora-quant-storage", default=None, metavar="uint8|base",
                   help="QLoRA: bnb_4bit_quant_storage, uint8 (bitsandbytes' default) or the model's dtype (FSDP-QLoRA) "
                        "(default: the stack's, else uint8)")
    f.add_argument("--qlora-single-quant", action="store_true",
                   help="QLoRA without double quantization of the NF4 block scales")
    parser.add_argument("--first-step", action="store_true",
                        help="the very first step: the optimizer creates its state inside step()")
    parser.add_argument("--alloc-conf", default="", metavar="CONF",
                        help="PYTORCH_CUDA_ALLOC_CONF for the caching allocator's replay, e.g. "
                             "'expandable_segments:True' or 'max_split_size_mb:128'")


def model_from_args(args: argparse.Namespace) -> Any:
    """The `ModelSpec` named by ``--model``, ``--hf-config`` or ``--params``."""
    from ..errors import SpecError, finite_number
    from ..model.presets import resolve_model
    from ..model.spec import ModelSpec

    if args.model is not None:
        return resolve_model(args.model)
    if args.hf_config is not None:
        from pathlib import Path

        from ..errors import read_json

        path = Path(args.hf_config)
        if path.is_dir():
            path = path / "config.json"
        data = read_json(path, "--hf-config")
        if not isinstance(data, dict):
            raise SpecError(f"--hf-config {path} must hold a JSON object, got {type(data).__name__}")
        return ModelSpec.from_hf_config(data, name=path.parent.name or path.stem)
    return ModelSpec.from_params(finite_number(args.params, "--params"))


def _adapter_options(args: argparse.Namespace) -> dict[str, Any]:
    """The LoRA and QLoRA flags given, refused where the method has no adapters or no 4-bit base (they would
    be ignored without a word)."""
    from ..errors import SpecError

    method = Method.parse(args.method, "--method")
    given = {flag: value for flag, value in (
        ("--lora-rank", args.lora_rank), ("--lora-alpha", args.lora_alpha), ("--lora-targets", args.lora_targets),
        ("--lora-dropout", args.lora_dropout), ("--lora-dtype", args.lora_dtype)) if value is not None}
    if given and method is Method.FULL:
        flag = next(iter(given))
        raise SpecError(f"{flag} sets the LoRA adapters, which --method {method.value} has none of: "
                        f"add --method lora (or qlora), or drop {flag}")
    quant = [flag for flag, on in (("--qlora-single-quant", args.qlora_single_quant),
                                   ("--qlora-quant-storage", args.qlora_quant_storage is not None)) if on]
    if quant and method is not Method.QLORA:
        raise SpecError(f"{quant[0]} sets QLoRA's 4-bit base, which --method {method.value} does not have: "
                        f"add --method qlora, or drop {quant[0]}")
    names = {"--lora-rank": "lora_rank", "--lora-alpha": "lora_alpha", "--lora-targets": "lora_targets"}
    return {**{names[flag]: value for flag, value in given.items() if flag in names},
            "qlora_double_quant": not args.qlora_single_quant}


def training_options_from_args(args: argparse.Namespace, device: str | None = None) -> dict[str, Any]:
    """Keyword options for `TrainingSpec` from parsed arguments."""
    return {
        "micro_batch": args.micro_batch, "seq_len": args.seq_len, "grad_accum": args.grad_accum,
        "precision": args.precision, "optimizer": args.optimizer, "optimizer_impl": args.optimizer_impl,
        "checkpointing": args.checkpointing, "attention": args.attention,
        "device": device or args.device, "method": args.method, **_adapter_options(args),
        "first_step": args.first_step,
        "alloc_conf": args.alloc_conf, "stack": args.stack,
        **({"lora_dtype": args.lora_dtype} if args.lora_dtype is not None else {}),
        **({"qlora_quant_storage": args.qlora_quant_storage} if args.qlora_quant_storage is not None else {}),
        **({"fsdp_version": args.fsdp_version} if getattr(args, "fsdp_version", None) is not None else {}),
        **({"use_orig_params": False} if getattr(args, "no_use_orig_params", False) else {}),
        **({"sync_module_states": True} if getattr(args, "sync_module_states", False) else {}),
        **({"loss_impl": args.loss_impl} if args.loss_impl is not None else {}),
        **({"adafactor": args.adafactor} if getattr(args, "adafactor", None) is not None else {}),
        **({"fp8": args.fp8} if args.fp8 is not None else {}),
        **({"fp8_all_gather": True} if getattr(args, "fp8_all_gather", False) else {}),
        **({"loss_chunks": args.loss_chunks} if args.loss_chunks is not None else {}),
        **({"dropout": args.dropout} if args.dropout is not None else {}),
        **({"lora_dropout": args.lora_dropout} if args.lora_dropout is not None else {}),
        **{comp: getattr(args, comp) for comp in COMPONENTS if getattr(args, comp) is not None},
    }


def parallel_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword options for `ParallelSpec` from parsed arguments."""
    return {
        "gpus": args.gpus, "nodes": args.nodes, "engine": args.engine, "zero": args.zero,
        "hybrid_shard": args.hybrid_shard, "tp": args.tp, "sp": args.sp, "pp": args.pp,
        "pp_schedule": args.pp_schedule, "virtual_stages": args.virtual_stages, "cp": args.cp, "ep": args.ep,
        "offload": args.offload, "ddp_bucket_view": args.ddp_bucket_view,
        "pp_return_outputs": None if args.no_pp_return_outputs is None else not args.no_pp_return_outputs,
        "grad_accum_fusion": None if args.no_grad_accum_fusion is None else not args.no_grad_accum_fusion,
        "loss_fusion": args.cross_entropy_loss_fusion,
    }
