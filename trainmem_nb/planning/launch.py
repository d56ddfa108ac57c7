"""Launch what the planner chose: a DeepSpeed JSON config, an accelerate FSDP config and a torchrun command.

Each takes one option of a plan (a row of `Plan.rows`, e.g. ``plan.best()``) or a `MemoryEstimate`
made with a parallel layout. The configs keep the numbers the memory estimate assumed: the batch split,
the precision recipe, the ZeRO stage and its bucket sizes (DeepSpeed's own defaults), offload and
activation checkpointing.

>>> from trainmem_nb.planning.launch import torchrun_command
>>> torchrun_command({"n_gpus": 16, "nodes": 2, "gpus_per_node": 8})
'torchrun --nnodes 2 --nproc-per-node 8 --rdzv-id trainmem --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500 train.py'
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SpecError
from ..files import write_text_atomic
from ..model.families import describe
from ..parallel.ranks import (
    DS_ALLGATHER_BUCKET,
    DS_REDUCE_BUCKET,
    DS_STAGE3_MAX_LIVE,
    DS_STAGE3_PERSISTENCE,
    DS_STAGE3_PREFETCH,
)

__all__ = [
    "DEEPSPEED_DEFAULTS",
    "LAUNCH_FILES",
    "MANIFEST",
    "accelerate_fsdp_config",
    "check_launch_dir",
    "deepspeed_config",
    "to_yaml",
    "torchrun_command",
    "write_launch_files",
]

#: DeepSpeed's own ZeRO defaults (deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig): written out so
#: the config says what the memory estimate assumed (the estimator's constants, one source of truth).
DEEPSPEED_DEFAULTS = {
    "reduce_bucket_size": DS_REDUCE_BUCKET,
    "allgather_bucket_size": DS_ALLGATHER_BUCKET,
    "stage3_prefetch_bucket_size": DS_STAGE3_PREFETCH,
    "stage3_param_persistence_threshold": DS_STAGE3_PERSISTENCE,
    "stage3_max_live_parameters": DS_STAGE3_MAX_LIVE,
    "stage3_max_reuse_distance": 1_000_000_000,  # not used by the estimate
}

#: DeepSpeed's dynamic loss scaling for fp16 (deepspeed/runtime/precision_config.py, FP16_FORMAT).
DEEPSPEED_FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                  "hysteresis": 2, "min_loss_scale": 1}

#: torchrun's default rendezvous port (torch.distributed.run: --master-port 29500).
RDZV_PORT = 29500


@dataclass(frozen=True)
class _Launch:
    """What a launcher needs to know about one plan option."""

    n_gpus: int
    nodes: int
    gpus_per_node: int
    engine: str
    zero: int
    hybrid_shard: bool
    offload: str
    tp: int
    pp: int
    precision: str
    micro_batch: int
    grad_accum: int
    checkpointing: str
    family: str | None  # None: the option names none (only the FSDP config needs it)
    ep: int = 1  # expert parallelism: no DeepSpeed JSON or accelerate FSDP config expresses it
    fp8: str = "none"  # the fp8 recipe (`TrainingSpec.fp8`): set in the training code, not in these configs
    fp8_all_gather: bool = False

    @property
    def dp(self) -> int:
        return self.n_gpus // (self.tp * self.pp)


def _layer_class(family: str | None) -> str:
    """The transformer block FSDP wraps: the family's, never a guess when the option names none."""
    if family is None:
        raise SpecError("the plan option names no model family ('family'), so the transformer block FSDP wraps is "
                        "unknown; pass a row of Plan.rows or a MemoryEstimate, or layer_cls=")
    return describe(family).layer_class


def _launch(option: Any) -> _Launch:
    """Normalize a plan row (mapping) or a `MemoryEstimate` into a `_Launch`."""
    if hasattr(option, "parallel") and hasattr(option, "training"):
        p, t = option.parallel, option.training
        return _Launch(p.gpus, p.nodes, p.gpus_per_node, p.engine.value, p.zero, p.hybrid_shard, p.offload.value,
                       p.tp, p.pp, t.precision.value, t.micro_batch, t.grad_accum, t.checkpointing.value,
                       option.model.family.value, p.ep, t.fp8.value, t.fp8_all_gather)
    if not isinstance(option, Mapping):
        raise SpecError(f"expected a plan option (a row of Plan.rows) or a MemoryEstimate, got {type(option).__name__}")
    n = int(option.get("n_gpus", 1))
    nodes = int(option.get("nodes", 1))
    if n < 1 or nodes < 1 or n % nodes:
        raise SpecError(f"n_gpus={n} must be a positive multiple of nodes={nodes}")
    return _Launch(
        n, nodes, int(option.get("gpus_per_node", n // nodes)), str(option.get("engine", "ddp")),
        int(option.get("zero", 0)), bool(option.get("hybrid_shard", False)), str(option.get("offload", "none")),
        int(option.get("tp", 1)), int(option.get("pp", 1)), str(option.get("precision", "bf16-mixed")),
        int(option.get("micro_batch", 1)), int(option.get("grad_accum", 1)), str(option.get("checkpointing", "none")),
        None if option.get("family") is None else str(option["family"]), int(option.get("ep", 1)),
        str(option.get("fp8", "none")), bool(option.get("fp8_all_gather", False)),
    )


def _fp8_launch_note(s: _Launch) -> str:
    """What a launcher config cannot say about fp8 training: torchao's conversion is the training code's
    (torchtitan's flags, or ``convert_to_float8_training`` in your script)."""
    if s.fp8 == "none":
        return ""
    if s.engine == "megatron":  # megatron/training/arguments.py: --fp8-format, --fp8-recipe
        return (f"fp8={s.fp8!r} is Transformer Engine's fp8 under Megatron, which its training script switches on "
                f"(pretrain_gpt.py: --fp8-format hybrid --fp8-recipe {s.fp8})")
    flags = f"--model.converters float8 --float8.recipe_name {s.fp8}"
    if s.fp8_all_gather:
        flags += " --float8.enable_fsdp_float8_all_gather"
    return (f"fp8={s.fp8!r} is torchao's Float8 training, which the training code switches on (torchtitan: {flags}; "
            "your own script: torchao.float8.convert_to_float8_training)")


def deepspeed_config(option: Any, *, gradient_clipping: float = 1.0, steps_per_print: int = 100) -> dict[str, Any]:
    """A DeepSpeed config (``ds_config.json``) for one option: batch split, precision, ZeRO stage, offload.

    ``train_batch_size = micro_batch x grad_accum x data-parallel ranks``, as DeepSpeed checks it.
    Activation checkpointing stays with the model (``model.gradient_checkpointing_enable()``).

    >>> cfg = deepspeed_config({"n_gpus": 8, "zero": 3, "micro_batch": 4, "grad_accum": 2})
    >>> cfg["train_batch_size"], cfg["zero_optimization"]["stage"], cfg["bf16"]
    (64, 3, {'enabled': True})
    """
    s = _launch(option)
    if s.fp8 != "none":
        raise SpecError(f"{_fp8_launch_note(s)}; DeepSpeed's JSON config has no such option, and fp8 under DeepSpeed "
                        "is not modelled: plan fp8 with engine='fsdp' or 'ddp'")
    if s.ep > 1:
        raise SpecError(f"ep={s.ep}: DeepSpeed's JSON config does not express expert parallelism (its MoE layers "
                        "take ep_size in the model code); torchtitan's --parallelism.expert_parallel_degree does")
    if s.tp > 1 or s.pp > 1:
        raise SpecError(f"tp={s.tp}, pp={s.pp}: DeepSpeed's JSON config covers data parallel and ZeRO; "
                        "tensor/pipeline parallel layouts are launched with Megatron-LM")
    cfg: dict[str, Any] = {
        "train_batch_size": s.micro_batch * s.grad_accum * s.dp,
        "train_micro_batch_size_per_gpu": s.micro_batch,
        "gradient_accumulation_steps": s.grad_accum,
        "gradient_clipping": gradient_clipping,
        "steps_per_print": steps_per_print,
        "wall_clock_breakdown": False,
    }
    if s.precision.startswith("bf16"):
        cfg["bf16"] = {"enabled": True}
    elif s.precision.startswith("fp16"):
        cfg["fp16"] = dict(DEEPSPEED_FP16)
    zero: dict[str, Any] = {"stage": s.zero, "overlap_comm": s.zero == 3, "contiguous_gradients": True,
                            "reduce_bucket_size": DEEPSPEED_DEFAULTS["reduce_bucket_size"]}
    if s.zero in (1, 2):
        zero["allgather_bucket_size"] = DEEPSPEED_DEFAULTS["allgather_bucket_size"]
    if s.zero == 3:
        for key in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                    "stage3_max_live_parameters", "stage3_max_reuse_distance"):
            zero[key] = DEEPSPEED_DEFAULTS[key]
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if s.offload in ("optimizer", "optimizer+params"):
        if s.zero == 0:
            raise SpecError("offload needs ZeRO stage >= 1 in DeepSpeed")
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if s.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg["zero_optimization"] = zero
    return cfg


def accelerate_fsdp_config(option: Any, *, layer_cls: str | None = None, main_process_port: int = RDZV_PORT) -> dict[str, Any]:
    """An accelerate config (the dict behind ``accelerate launch --config_file``) for an FSDP2 option.

    ZeRO-3 is ``fsdp_reshard_after_forward: true`` (FULL_SHARD), ZeRO-2 ``false`` (SHARD_GRAD_OP), per
    accelerate's FSDP1-vs-FSDP2 guide. `layer_cls` defaults to the family's decoder-block class.

    >>> accelerate_fsdp_config({"n_gpus": 8, "engine": "fsdp", "zero": 3, "family": "llama"})["fsdp_config"]["fsdp_reshard_after_forward"]
    True
    """
    s = _launch(option)
    if s.zero not in (2, 3):
        raise SpecError(f"zero={s.zero}: an FSDP config shards gradients (zero=2) or everything (zero=3); "
                        "for plain data parallel use torchrun_command()")
    if s.fp8 != "none":
        raise SpecError(f"{_fp8_launch_note(s)}; the modelled step is torchao's, which accelerate's FSDP config "
                        "does not set up: launch it with torchrun")
    if s.tp > 1 or s.pp > 1 or s.ep > 1:
        raise SpecError(f"tp={s.tp}, pp={s.pp}, ep={s.ep}: accelerate's FSDP config covers data parallel sharding "
                        "only (expert parallelism: torchtitan's --parallelism.expert_parallel_degree)")
    if s.offload == "optimizer":
        # fsdp_offload_params is CPUOffloadPolicy: parameters, gradients and optimizer move together
        raise SpecError("offload='optimizer': FSDP offloads parameters, gradients and optimizer together: use "
                        "offload='optimizer+params', or engine='deepspeed' to offload only the optimizer")
    if s.hybrid_shard:
        raise SpecError("hybrid_shard: FSDP2 needs a 2-D device mesh; build it in code (accelerate ParallelismConfig "
                        f"dp_replicate_size={s.nodes}, dp_shard_size={s.n_gpus // s.nodes})")
    mixed = "bf16" if s.precision.startswith("bf16") else ("fp16" if s.precision.startswith("fp16") else "no")
    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": "FSDP",
        "downcast_bf16": "no",
        "enable_cpu_affinity": False,
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": layer_cls or _layer_class(s.family),
            "fsdp_reshard_after_forward": s.zero == 3,
            "fsdp_offload_params": s.offload != "none",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_activation_checkpointing": s.checkpointing == "full",
        },
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": mixed,
        "num_machines": s.nodes,
        "num_processes": s.n_gpus,
        "rdzv_backend": "static" if s.nodes == 1 else "c10d",
        "same_network": True,
        "tpu_env": [],
        "tpu_use_cluster": False,
        "tpu_use_sudo": False,
        "use_cpu": False,
    }
    if s.nodes > 1:
        cfg["main_process_ip"] = "MASTER_ADDR"
        cfg["main_process_port"] = main_process_port
    return cfg


def torchrun_command(option: Any, script: str = "train.py", script_args: Sequence[str] = (),
                     rdzv_endpoint: str = f"$MASTER_ADDR:{RDZV_PORT}") -> str:
    """The ``torchrun`` line that starts one process per GPU (run it on every node for several nodes)."""
    s = _launch(option)
    per_node = s.n_gpus // s.nodes
    if s.nodes == 1:
        args = ["torchrun", "--standalone", "--nproc-per-node", str(per_node)]
    else:
        args = ["torchrun", "--nnodes", str(s.nodes), "--nproc-per-node", str(per_node), "--rdzv-id", "trainmem",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint]
    words = [*args, script, *script_args]
    return " ".join(w if w.startswith("$") else shlex.quote(w) for w in words)


def to_yaml(data: Mapping[str, Any], indent: int = 0) -> str:
    """A small YAML writer for flat configs (scalars, nested mappings, lists of scalars); every string is
    double-quoted, so 'no' stays a string. Needs no PyYAML."""
    pad = " " * indent
    lines = []
    for key, value in data.items():
        if isinstance(value, Mapping):
            lines.append(f"{pad}{key}:")
            lines.append(to_yaml(value, indent + 2).rstrip("\n"))
        elif isinstance(value, (list, tuple)):
            lines.append(f"{pad}{key}: [{', '.join(json.dumps(v) for v in value)}]")
        else:
            lines.append(f"{pad}{key}: {json.dumps(value)}")
    return "\n".join(lines) + "\n"


#: Every file `write_launch_files` may write into a folder, and the manifest that says which plan wrote them.
LAUNCH_FILES = ("ds_config.json", "accelerate_fsdp.yaml", "launch.sh")
MANIFEST = "trainmem_plan.json"


def check_launch_dir(directory: str | Path, force: bool = False, what: str = "directory") -> Path:
    """The folder an export may write into, checked before anything is computed or written: not a file,
    its parent exists, and (unless `force`) it holds neither a file an export would write nor another
    plan's manifest."""
    if not str(directory).strip():
        raise SpecError(f"{what}='' names no folder")
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise SpecError(f"{what} {out}: exists and is not a folder")
    if not out.exists():
        if not out.parent.is_dir():
            raise SpecError(f"{what} {out}: its parent folder {out.parent} does not exist")
        return out
    taken = [name for name in (*LAUNCH_FILES, MANIFEST) if (out / name).exists()]
    if taken and not force:
        whose = "another plan's files" if MANIFEST in taken else "files trainmem did not write"
        raise SpecError(f"{what} {out}: would overwrite {', '.join(n for n in taken if n != MANIFEST) or MANIFEST} "
                        f"({whose}); pass --force (force=True) to replace them, or choose an empty folder")
    return out


def write_launch_files(option: Any, directory: str | Path, script: str = "train.py", *, force: bool = False,
                       command: str = "") -> list[Path]:
    """Write ``ds_config.json`` (ZeRO layouts), ``accelerate_fsdp.yaml`` (ZeRO-2/3 without TP/PP, and
    without an optimizer-only offload, which FSDP cannot do) and ``launch.sh`` (the torchrun line) into
    `directory`; returns the paths written.

    Nothing a user made is lost: a folder that already holds one of these files, or another plan's
    manifest, is refused unless `force`. With `force`, the files the previous plan's manifest lists and
    this one does not write are removed, so the folder holds one plan's files, and
    ``trainmem_plan.json`` says which option (and `command`) wrote them."""
    s = _launch(option)
    out = check_launch_dir(directory, force)
    out.mkdir(exist_ok=True)
    texts: dict[str, str] = {}
    fp8 = _fp8_launch_note(s)
    if s.tp == 1 and s.pp == 1 and s.ep == 1 and not fp8:
        texts["ds_config.json"] = json.dumps(deepspeed_config(option), indent=2) + "\n"
    if (s.zero in (2, 3) and s.tp == 1 and s.pp == 1 and s.ep == 1 and not s.hybrid_shard
            and s.offload != "optimizer" and not fp8):
        texts["accelerate_fsdp.yaml"] = to_yaml(accelerate_fsdp_config(option))
    texts["launch.sh"] = ("#!/bin/sh\n# one line per node; set MASTER_ADDR on every node for several nodes\n"
                          + (f"# {fp8}\n" if fp8 else "") + torchrun_command(option, script) + "\n")
    previous = _manifest_files(out / MANIFEST)
    for name in previous:
        if name not in texts and name in LAUNCH_FILES and (out / name).exists():
            (out / name).unlink()  # the last plan's file this plan does not write: stale, and trainmem's own
    written = []
    for name, text in texts.items():
        write_text_atomic(out / name, text)
        written.append(out / name)
    option_fields = {k: getattr(s, k) for k in s.__dataclass_fields__}
    if isinstance(option, Mapping):
        option_fields.update({k: option[k] for k in ("gpu", "layout", "model") if k in option})
    manifest = {"written_by": f"trainmem_nb {_version()}", "command": command, "files": list(texts),
                "option": option_fields}
    write_text_atomic(out / MANIFEST, json.dumps(manifest, indent=2, default=str) + "\n")
    return written


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainmem_nb")
    except PackageNotFoundError:
        return "unknown"


def _manifest_files(path: Path) -> list[str]:
    """The files a previous export's manifest lists (none when there is no readable manifest)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    files = data.get("files") if isinstance(data, dict) else None
    return [f for f in files if isinstance(f, str)] if isinstance(files, list) else []
