"""Launch configs load in the real libraries' own parsers and config classes.

* DeepSpeed (``deepspeed``, in the ``measure`` extra, installed without building its ops): the exported
  JSON is read by ``deepspeed.runtime.config.DeepSpeedConfig``, which validates every section with
  DeepSpeed's pydantic models (``extra="forbid"``) and asserts ``train_batch_size = micro_batch x
  grad_accum x data-parallel world size``. No process group is started: the world size comes from an
  ``mpu`` that answers ``get_data_parallel_world_size``, as Megatron's does.
* accelerate (in the ``measure`` extra through peft): the exported YAML is loaded by
  ``ClusterConfig.from_yaml_file``, run through ``accelerate launch``'s own argument parser and
  validation, turned into the launcher's environment, and read back by ``FullyShardedDataParallelPlugin``.
* torch: the torchrun line is parsed by torch's own argument parser.

Each skips (saying which library is missing) without the measure extra; nothing is mirrored by hand.
"""

from __future__ import annotations

import doctest
import json
import shlex
from pathlib import Path
from typing import Any

import pytest

import trainmem_nb.planning.launch as launch_module
from trainmem_nb.errors import SpecError
from trainmem_nb.planning.launch import (
    accelerate_fsdp_config,
    deepspeed_config,
    to_yaml,
    torchrun_command,
    write_launch_files,
)


class _DataParallelMPU:
    """What DeepSpeedConfig asks of an ``mpu``: the data-parallel world size."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def get_data_parallel_world_size(self) -> int:
        return self.world_size


def load_deepspeed(cfg: dict[str, Any], world_size: int, monkeypatch: pytest.MonkeyPatch) -> Any:
    """DeepSpeed's own ``DeepSpeedConfig`` on our JSON, for `world_size` data-parallel ranks."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is in the measure extra")
    import deepspeed.comm
    from deepspeed.runtime.config import DeepSpeedConfig

    # DeepSpeedConfig asks deepspeed.comm for the rank first and falls back to world size 1 without a
    # process group; a rank of 0 lets it take the world size from the mpu instead
    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda group=None: 0)
    return DeepSpeedConfig(json.loads(json.dumps(cfg)), mpu=_DataParallelMPU(world_size))


def load_accelerate(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """``accelerate launch --config_file path train.py`` up to the FSDP plugin a training script builds:
    ClusterConfig.from_yaml_file (unknown keys raise), the launcher's parser and validation, the
    environment it exports, and FullyShardedDataParallelPlugin reading it. Returns (config, plugin)."""
    config_args = pytest.importorskip("accelerate.commands.config.config_args",
                                      reason="accelerate is in the measure extra")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    cfg = config_args.ClusterConfig.from_yaml_file(str(path))
    parser = launch_command_parser()
    launch_args = {a.dest for a in parser._actions}
    unknown = sorted(set(cfg.fsdp_config or {}) - launch_args)
    assert not unknown, f"accelerate launch has no argument for {unknown}"
    args, _defaults, _mp = _validate_launch_command(parser.parse_args(["--config_file", str(path), "train.py"]))
    for key, value in prepare_multi_gpu_env(args).items():
        monkeypatch.setenv(key, value)
    return cfg, FullyShardedDataParallelPlugin()


OPTION = {"gpu": "H100 SXM 80GB", "n_gpus": 16, "nodes": 2, "gpus_per_node": 8, "engine": "fsdp", "zero": 3,
          "tp": 1, "pp": 1, "precision": "bf16-mixed", "micro_batch": 4, "grad_accum": 2, "checkpointing": "full",
          "offload": "none", "hybrid_shard": False, "family": "llama"}


@pytest.mark.torch
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed", "fp32"])
def test_deepspeed_config_passes_deepspeeds_own_validation(zero: int, precision: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = deepspeed_config({**OPTION, "zero": zero, "precision": precision})
    ds = load_deepspeed(cfg, OPTION["n_gpus"], monkeypatch)
    assert ds.zero_optimization_stage == zero == cfg["zero_optimization"]["stage"]
    assert (ds.train_batch_size, ds.train_micro_batch_size_per_gpu, ds.gradient_accumulation_steps) == (128, 4, 2)
    assert ds.bfloat16_config.enabled is (precision == "bf16-mixed")
    assert ds.float16_config.enabled is (precision == "fp16-mixed")
    if zero:  # the bucket sizes the memory estimate assumed are the ones DeepSpeed will use
        assert ds.zero_config.reduce_bucket_size == launch_module.DEEPSPEED_DEFAULTS["reduce_bucket_size"]
    if zero == 3:
        assert ds.zero_config.max_live_parameters == launch_module.DEEPSPEED_DEFAULTS["stage3_max_live_parameters"]


@pytest.mark.torch
def test_deepspeed_rejects_a_batch_that_does_not_split_over_the_data_parallel_ranks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above is real: DeepSpeed's batch assertion and forbidden extra keys fire."""
    cfg = deepspeed_config(OPTION)
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        load_deepspeed({**cfg, "train_batch_size": 127}, OPTION["n_gpus"], monkeypatch)
    with pytest.raises(ValueError, match="bogus"):
        load_deepspeed({**cfg, "zero_optimization": {**cfg["zero_optimization"], "bogus": 1}}, 16, monkeypatch)


@pytest.mark.torch
@pytest.mark.parametrize(("offload", "params_on_cpu"), [("optimizer", False), ("optimizer+params", True)])
def test_deepspeed_offload_sections_validate_and_need_zero(offload: str, params_on_cpu: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = deepspeed_config({**OPTION, "engine": "deepspeed", "offload": offload})
    ds = load_deepspeed(cfg, 16, monkeypatch)
    assert ds.zero_config.offload_optimizer.device == "cpu" and ds.zero_config.offload_optimizer.pin_memory
    assert (ds.zero_config.offload_param is not None) is params_on_cpu
    with pytest.raises(SpecError, match="ZeRO stage >= 1"):
        deepspeed_config({**OPTION, "zero": 0, "offload": "optimizer"})


def test_deepspeed_batch_counts_data_parallel_ranks_only() -> None:
    with pytest.raises(SpecError, match="Megatron"):
        deepspeed_config({**OPTION, "tp": 2})


@pytest.mark.torch
def test_accelerate_fsdp_config_loads_like_accelerate_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "accelerate_fsdp.yaml"
    path.write_text(to_yaml(accelerate_fsdp_config(OPTION)), encoding="utf-8")
    cfg, plugin = load_accelerate(path, monkeypatch)
    assert (cfg.num_machines, cfg.num_processes, cfg.distributed_type.value) == (2, 16, "FSDP")
    assert cfg.downcast_bf16 == "no"  # a string, not YAML's boolean no
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True  # ZeRO-3: FULL_SHARD
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert plugin.activation_checkpointing is True
    assert type(plugin.cpu_offload).__name__ == "OffloadPolicy"  # nothing offloaded


@pytest.mark.torch
def test_accelerate_offload_is_fsdp2s_cpu_offload_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fsdp_offload_params: true`` becomes CPUOffloadPolicy (parameters, gradients and optimizer on the
    CPU), which is what ``offload='optimizer+params'`` estimates; an optimizer-only offload is refused."""
    path = tmp_path / "accelerate_fsdp.yaml"
    path.write_text(to_yaml(accelerate_fsdp_config({**OPTION, "offload": "optimizer+params"})), encoding="utf-8")
    _cfg, plugin = load_accelerate(path, monkeypatch)
    assert type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy"
    with pytest.raises(SpecError, match=r"use offload='optimizer\+params', or engine='deepspeed'"):
        accelerate_fsdp_config({**OPTION, "offload": "optimizer"})


@pytest.mark.torch
def test_accelerate_zero2_is_fsdp2_without_resharding_and_single_node_is_static(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "accelerate_fsdp.yaml"
    path.write_text(to_yaml(accelerate_fsdp_config({**OPTION, "zero": 2, "n_gpus": 8, "nodes": 1})), encoding="utf-8")
    cfg, plugin = load_accelerate(path, monkeypatch)
    assert plugin.reshard_after_forward is False  # SHARD_GRAD_OP
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


@pytest.mark.torch
def test_launch_files_are_written_for_the_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = write_launch_files(OPTION, tmp_path)
    assert [p.name for p in paths] == ["ds_config.json", "accelerate_fsdp.yaml", "launch.sh"]
    load_deepspeed(json.loads((tmp_path / "ds_config.json").read_text()), 16, monkeypatch)
    load_accelerate(tmp_path / "accelerate_fsdp.yaml", monkeypatch)
    assert "torchrun --nnodes 2" in (tmp_path / "launch.sh").read_text()


def test_an_optimizer_only_offload_writes_no_fsdp_config(tmp_path: Path) -> None:
    """DeepSpeed can offload the optimizer alone; FSDP cannot, so no accelerate FSDP file is written."""
    paths = write_launch_files({**OPTION, "engine": "deepspeed", "offload": "optimizer"}, tmp_path)
    assert [p.name for p in paths] == ["ds_config.json", "launch.sh"]


def test_a_plan_row_or_an_estimate_is_accepted() -> None:
    import trainmem_nb as tm

    est = tm.estimate("gpt2", micro_batch=2, seq_len=512)
    cfg = deepspeed_config(est)
    assert cfg["train_batch_size"] == 2 and "bf16" in cfg
    with pytest.raises(SpecError, match="plan option"):
        deepspeed_config(42)


def test_module_examples_run() -> None:
    assert doctest.testmod(launch_module).failed == 0
