"""Launch configs load in the real libraries' parsers, or in schemas copied from their source.

DeepSpeed and accelerate are not installed here (and are not installed for this), so their config
classes are mirrored below field by field from their source, with the file and commit named; torch is
installed, so the torchrun line is parsed by torch's own argument parser.
"""

from __future__ import annotations

import dataclasses
import doctest
import json
import shlex
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field

import trainmem_nb.launch as launch_module
from trainmem_nb.launch import (
    accelerate_fsdp_config,
    deepspeed_config,
    to_yaml,
    torchrun_command,
    write_launch_files,
)
from trainmem_nb.specs import SpecError

# --- DeepSpeed: deepspeed/runtime/config_utils.py (DeepSpeedConfigModel: extra="forbid"),
# deepspeed/runtime/zero/config.py @ 03dc2b92 (DeepSpeedZeroConfig), zero/offload_config.py @ 0510cb40,
# runtime/precision_config.py @ 19431f80 (bf16/fp16), runtime/config.py (_batch_assertion:
# train_batch == micro_batch * grad_acc * world_size, where world_size is the data-parallel size).

_DS = ConfigDict(extra="forbid", populate_by_name=True)


class _Offload(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class DSOffloadParam(BaseModel):
    model_config = _DS
    device: _Offload = _Offload.none
    nvme_path: str | None = None
    buffer_count: int = Field(5, ge=0)
    buffer_size: int = Field(100_000_000, ge=0)
    max_in_cpu: int = Field(1_000_000_000, ge=0)
    pin_memory: bool = False


class DSOffloadOptimizer(BaseModel):
    model_config = _DS
    device: _Offload = _Offload.none
    nvme_path: str | None = None
    buffer_count: int = Field(4, ge=0)
    pin_memory: bool = False
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = Field(1.0, ge=0.0, le=1.0)


class DSZero(BaseModel):
    model_config = _DS
    stage: int = Field(0, ge=0, le=3)
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = Field(500_000_000, ge=0)
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: int = Field(500_000_000, ge=0)
    overlap_comm: bool | None = None
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    offload_param: DSOffloadParam | None = None
    offload_optimizer: DSOffloadOptimizer | None = None
    sub_group_size: int = Field(1_000_000_000, ge=0)
    prefetch_bucket_size: int = Field(50_000_000, ge=0, alias="stage3_prefetch_bucket_size")
    param_persistence_threshold: int = Field(100_000, ge=0, alias="stage3_param_persistence_threshold")
    model_persistence_threshold: int = Field(2**63 - 1, ge=0, alias="stage3_model_persistence_threshold")
    max_live_parameters: int = Field(1_000_000_000, ge=0, alias="stage3_max_live_parameters")
    max_reuse_distance: int = Field(1_000_000_000, ge=0, alias="stage3_max_reuse_distance")
    gather_16bit_weights_on_model_save: bool = Field(False, alias="stage3_gather_16bit_weights_on_model_save")
    ignore_unused_parameters: bool = True
    round_robin_gradients: bool = False
    zero_hpz_partition_size: int = Field(1, ge=0)
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False
    memory_efficient_linear: bool = True


class DSBF16(BaseModel):
    model_config = _DS
    enabled: bool = False
    immediate_grad_update: bool = False
    check_grad_overflow: bool = False


class DSFP16(BaseModel):
    model_config = _DS
    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = 0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: int = 1


#: Top-level keys DeepSpeed reads (deepspeed/runtime/constants.py); it reads them with dict.get.
DS_TOP_LEVEL = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping", "steps_per_print", "wall_clock_breakdown", "bf16", "fp16", "zero_optimization",
                "optimizer", "scheduler", "activation_checkpointing", "communication_data_type"}


def load_deepspeed(cfg: dict[str, Any], world_size: int) -> None:
    """What DeepSpeedConfig does with our keys: validate the sub-configs, then the batch assertion."""
    assert set(cfg) <= DS_TOP_LEVEL, set(cfg) - DS_TOP_LEVEL
    DSZero(**cfg.get("zero_optimization", {}))
    DSBF16(**cfg.get("bf16", {}))
    DSFP16(**cfg.get("fp16", {}))
    assert not (cfg.get("bf16", {}).get("enabled") and cfg.get("fp16", {}).get("enabled"))
    mb, ga, tb = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["train_batch_size"]
    assert tb == mb * ga * world_size, "DeepSpeed: train_batch_size != micro_batch * grad_acc * world_size"


# --- accelerate: src/accelerate/commands/config/config_args.py @ 002dd35a (ClusterConfig, loaded by
# from_yaml_file: unknown keys raise ValueError; the dataclass rejects the rest), DistributedType values
# (src/accelerate/utils/dataclasses.py), FSDP launch arguments (src/accelerate/commands/launch.py @ 00785cd9,
# "FSDP Arguments" group) plus FSDP2's fsdp_version and fsdp_reshard_after_forward
# (docs/source/concept_guides/fsdp1_vs_fsdp2.md @ 04a5ffbd).


@dataclasses.dataclass
class ClusterConfig:
    compute_environment: str
    distributed_type: str
    mixed_precision: str
    use_cpu: bool
    debug: bool
    num_processes: int = -1
    machine_rank: int = 0
    num_machines: int = 1
    gpu_ids: str | None = None
    main_process_ip: str | None = None
    main_process_port: int | None = None
    rdzv_backend: str | None = "static"
    same_network: bool | None = False
    main_training_function: str = "main"
    enable_cpu_affinity: bool = False
    fp8_config: dict | None = None  # type: ignore[type-arg]
    deepspeed_config: dict | None = None  # type: ignore[type-arg]
    fsdp_config: dict | None = None  # type: ignore[type-arg]
    tp_config: dict | None = None  # type: ignore[type-arg]
    megatron_lm_config: dict | None = None  # type: ignore[type-arg]
    ipex_config: dict | None = None  # type: ignore[type-arg]
    mpirun_config: dict | None = None  # type: ignore[type-arg]
    downcast_bf16: bool | str = False
    tpu_name: str | None = None
    tpu_zone: str | None = None
    tpu_use_cluster: bool = False
    tpu_use_sudo: bool = False
    command_file: str | None = None
    commands: list[str] | None = None
    tpu_vm: list[str] | None = None
    tpu_env: list[str] | None = None
    dynamo_config: dict | None = None  # type: ignore[type-arg]


DISTRIBUTED_TYPES = {"NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_XPU", "DEEPSPEED", "FSDP", "XLA",
                     "MEGATRON_LM"}
FSDP_LAUNCH_ARGS = {"fsdp_offload_params", "fsdp_min_num_params", "fsdp_sharding_strategy", "fsdp_auto_wrap_policy",
                    "fsdp_transformer_layer_cls_to_wrap", "fsdp_backward_prefetch", "fsdp_state_dict_type",
                    "fsdp_forward_prefetch", "fsdp_use_orig_params", "fsdp_cpu_ram_efficient_loading",
                    "fsdp_sync_module_states", "fsdp_activation_checkpointing", "fsdp_version",
                    "fsdp_reshard_after_forward"}
FSDP2_REMOVED = {"fsdp_sharding_strategy", "fsdp_backward_prefetch", "fsdp_forward_prefetch",
                 "fsdp_sync_module_states", "fsdp_use_orig_params"}


def load_accelerate(text: str) -> ClusterConfig:
    """accelerate's from_yaml_file on our YAML: PyYAML's safe_load, the unknown-key check, the dataclass."""
    yaml = pytest.importorskip("yaml")
    data = yaml.safe_load(text)
    extra = sorted(set(data) - {f.name for f in dataclasses.fields(ClusterConfig)})
    assert not extra, f"accelerate would reject unknown keys {extra}"
    cfg = ClusterConfig(**data)
    assert cfg.distributed_type in DISTRIBUTED_TYPES
    assert cfg.mixed_precision in ("no", "fp16", "bf16", "fp8")
    keys = set(cfg.fsdp_config or {})
    assert keys <= FSDP_LAUNCH_ARGS, keys - FSDP_LAUNCH_ARGS
    if (cfg.fsdp_config or {}).get("fsdp_version") == 2:
        assert not keys & FSDP2_REMOVED
    return cfg


OPTION = {"gpu": "H100 SXM 80GB", "n_gpus": 16, "nodes": 2, "gpus_per_node": 8, "engine": "fsdp", "zero": 3,
          "tp": 1, "pp": 1, "precision": "bf16-mixed", "micro_batch": 4, "grad_accum": 2, "checkpointing": "full",
          "offload": "none", "hybrid_shard": False, "family": "llama"}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed", "fp32"])
def test_deepspeed_config_passes_deepspeeds_own_validation(zero: int, precision: str) -> None:
    cfg = deepspeed_config({**OPTION, "zero": zero, "precision": precision})
    load_deepspeed(json.loads(json.dumps(cfg)), world_size=OPTION["n_gpus"])
    assert cfg["zero_optimization"]["stage"] == zero


def test_deepspeed_offload_sections_validate_and_need_zero() -> None:
    cfg = deepspeed_config({**OPTION, "offload": "optimizer+params"})
    load_deepspeed(cfg, world_size=16)
    assert cfg["zero_optimization"]["offload_param"]["device"] == "cpu"
    with pytest.raises(SpecError, match="ZeRO stage >= 1"):
        deepspeed_config({**OPTION, "zero": 0, "offload": "optimizer"})


def test_deepspeed_batch_counts_data_parallel_ranks_only() -> None:
    with pytest.raises(SpecError, match="Megatron"):
        deepspeed_config({**OPTION, "tp": 2})


def test_accelerate_fsdp_config_loads_like_accelerate_launch() -> None:
    cfg = load_accelerate(to_yaml(accelerate_fsdp_config(OPTION)))
    assert (cfg.num_machines, cfg.num_processes, cfg.distributed_type) == (2, 16, "FSDP")
    assert cfg.fsdp_config["fsdp_reshard_after_forward"] is True  # type: ignore[index]
    assert cfg.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"  # type: ignore[index]
    assert cfg.fsdp_config["fsdp_activation_checkpointing"] is True  # type: ignore[index]
    assert cfg.downcast_bf16 == "no"  # a string, not YAML's boolean no


def test_accelerate_zero2_is_fsdp2_without_resharding_and_single_node_is_static() -> None:
    cfg = load_accelerate(to_yaml(accelerate_fsdp_config({**OPTION, "zero": 2, "n_gpus": 8, "nodes": 1})))
    assert cfg.fsdp_config["fsdp_reshard_after_forward"] is False  # type: ignore[index]
    assert cfg.rdzv_backend == "static" and cfg.main_process_ip is None


def test_accelerate_refuses_layouts_fsdp_cannot_express() -> None:
    with pytest.raises(SpecError, match="torchrun"):
        accelerate_fsdp_config({**OPTION, "zero": 0})
    with pytest.raises(SpecError, match="ParallelismConfig"):
        accelerate_fsdp_config({**OPTION, "hybrid_shard": True})


@pytest.mark.torch
def test_torchrun_command_parses_with_torchs_own_parser() -> None:
    run = pytest.importorskip("torch.distributed.run")
    for option, nnodes, nproc in ((OPTION, "2", "8"), ({**OPTION, "n_gpus": 4, "nodes": 1}, "1:1", "4")):
        words = shlex.split(torchrun_command(option, "train.py", ["--lr", "3e-4"]))
        assert words[0] == "torchrun"
        args = run.get_args_parser().parse_args(words[1:])
        assert (args.nproc_per_node, args.training_script, args.training_script_args) == (nproc, "train.py",
                                                                                        ["--lr", "3e-4"])
        assert args.nnodes == nnodes
        if option["nodes"] > 1:
            assert args.rdzv_backend == "c10d" and args.rdzv_endpoint.endswith(":29500")


def test_launch_files_are_written_for_the_option(tmp_path: Path) -> None:
    paths = write_launch_files(OPTION, tmp_path)
    assert [p.name for p in paths] == ["ds_config.json", "accelerate_fsdp.yaml", "launch.sh"]
    load_deepspeed(json.loads((tmp_path / "ds_config.json").read_text()), world_size=16)
    load_accelerate((tmp_path / "accelerate_fsdp.yaml").read_text())
    assert "torchrun --nnodes 2" in (tmp_path / "launch.sh").read_text()


def test_a_plan_row_or_an_estimate_is_accepted() -> None:
    import trainmem_nb as tm

    est = tm.estimate("gpt2", micro_batch=2, seq_len=512)
    cfg = deepspeed_config(est)
    assert cfg["train_batch_size"] == 2 and "bf16" in cfg
    with pytest.raises(SpecError, match="plan option"):
        deepspeed_config(42)


def test_module_examples_run() -> None:
    assert doctest.testmod(launch_module).failed == 0
