"""Measure what DeepSpeed allocates on one rank, in a single process: loading a model for ZeRO-3, and a ZeRO step.

``from_pretrained`` under ZeRO-3 (transformers' ``HfDeepSpeedConfig`` switches it on) builds the model inside
``deepspeed.zero.Init`` and gathers each module's parameters to copy the checkpoint in. DeepSpeed runs here on
its CPU accelerator over PyTorch's fake process group (collectives return without communicating), so the
rank's allocations are real CPU tensors, seen by a `StorageTracker`. The checkpoint is a randomly initialised
model saved to a temporary directory first: nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
import warnings
from typing import Any
from unittest import mock

from ..model.hf_writers import to_hf_config
from ..model.spec import ModelSpec
from ..spec.parallel import ParallelSpec
from ..spec.training import TrainingSpec
from .tracker import StorageTracker

__all__ = ["measure_deepspeed_step", "measure_zero3_load"]


def _environment(world: int, rank: int = 0) -> Any:
    """What DeepSpeed reads from a launcher's environment, for `rank` of `world` on its CPU accelerator."""
    return mock.patch.dict(os.environ, {"DS_ACCELERATOR": "cpu", "LOCAL_RANK": str(rank), "RANK": str(rank),
                                        "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29599"})


def _torch_functions_kept() -> contextlib.ExitStack:
    """``zero.Init`` swaps ``torch.nn.functional.linear`` for its own (``zero3_linear_wrap``) and, as transformers
    enters it, leaves it swapped: every later step in this process would run DeepSpeed's linear. Put back on exit,
    with the tensor constructors it patches while it is active."""
    import torch

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(torch.nn.functional, "linear", torch.nn.functional.linear))
    for name in ("empty", "zeros", "ones", "full", "tensor", "arange"):
        stack.enter_context(mock.patch.object(torch, name, getattr(torch, name)))
    return stack


def _on_host(r: Any) -> bool:
    """The checkpoint's tensors, which rank 0 reads into host memory (``map_location="cpu"``; safetensors hands
    them over with ``set_``)."""
    return bool(r.op.startswith("set_."))


def measure_zero3_load(m: ModelSpec, t: TrainingSpec, p: ParallelSpec) -> tuple[int, ...]:
    """Rank 0's device allocations and frees while ``AutoModelForCausalLM.from_pretrained`` loads `m` in `t`'s
    dtype under ZeRO-3 over ``p.shard_degree`` ranks, as a loading trace; the model stays loaded (nothing of
    it is freed at the end)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from .models import hf_config_object, hf_model_class, instantiate
    from .step import _sanitize_token_ids, model_dtype

    world = p.shard_degree
    cfg_dict = to_hf_config(m)
    cfg = hf_config_object(cfg_dict, use_cache=False)
    _sanitize_token_ids(cfg, m.vocab)
    dtype = model_dtype(t)
    ds = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1,
          "bf16": {"enabled": t.param_bytes == 2}}
    with tempfile.TemporaryDirectory() as path, _environment(world), _torch_functions_kept():
        import deepspeed  # here: DeepSpeed picks its accelerator from the environment when first imported

        instantiate(cfg, cfg_dict["model_type"], "eager", dtype).save_pretrained(path)
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            deepspeed.init_distributed(dist_backend="gloo")
            keep = HfDeepSpeedConfig(ds)  # noqa: F841  (transformers holds it by a weak reference)
            tracker = StorageTracker()
            cls = hf_model_class(cfg_dict["model_type"], cfg_dict.get("architectures"))
            with tracker, warnings.catch_warnings():
                # DeepSpeed 0.19 still calls all_gather_into_tensor, which torch 2.13 deprecates: not the run's concern
                warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
                model = cls.from_pretrained(path, dtype=dtype)
            del model
            return tracker.loading_trace(_on_host)
        finally:
            # transformers keeps ZeRO-3 on while the config lives: every later model would be built in zero.Init
            unset_hf_deepspeed_config()
            gc.collect()
            dist.destroy_process_group()


def measure_deepspeed_step(m: ModelSpec, t: TrainingSpec, p: ParallelSpec,
                           zero_config: dict[str, Any] | None = None, rank: int = 0) -> dict[str, Any]:
    """`rank` (0: the first) of ``p.shard_degree`` running two DeepSpeed ZeRO-``p.zero`` training steps of `m` (DeepSpeed 0.19 on
    its CPU accelerator over the fake process group; torch's AdamW, bf16/fp16 as `t` says, the model built on
    the host and handed to ``deepspeed.initialize``). Every storage counts from the model's parameters on, in
    the CUDA allocator's 512-B blocks. Keys: ``init_peak`` (what ``deepspeed.initialize`` allocates at most),
    ``peak`` (the second step's), ``phase_peaks`` (the second step's forward, backward and ``step()``) and
    ``live_at_start`` (before the second step). `zero_config`: further ``zero_optimization`` settings (ZeRO-3's
    ``stage3_*`` limits, a reduce bucket, scaled down to measure at a small model's scale what they do to a large
    one)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .step import build, make_optimizer
    from .tracker import cuda_round

    world = p.shard_degree
    ds = {"zero_optimization": {"stage": p.zero, **(zero_config or {})}, "train_micro_batch_size_per_gpu": t.micro_batch,
          "gradient_accumulation_steps": t.grad_accum, "bf16": {"enabled": t.precision.value.startswith("bf16")},
          "fp16": {"enabled": t.precision.value.startswith("fp16")},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    client = t.optimizer.value not in ("adamw", "none")  # another torch optimizer, handed to deepspeed.initialize
    if client:
        del ds["optimizer"]
        ds["zero_allow_untested_optimizer"] = True
    with _environment(world, rank), _torch_functions_kept(), warnings.catch_warnings():
        # DeepSpeed 0.19's own use of APIs torch 2.13 deprecates (torch.jit.script_method, all_gather_into_tensor)
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        import deepspeed

        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            deepspeed.init_distributed(dist_backend="gloo")
            model, inputs = build(m, t.model_copy(update={"precision": t.precision.__class__("fp32")}), "cpu")
            # real CPU tensors only: DeepSpeed keeps a meta-device copy of every parameter's shape
            # (stage_1_and_2.py `round_robin_bit16_meta`: `torch.zeros_like(param.data, device="meta")`), no memory
            tracker = StorageTracker(device_type="cpu")
            tracker.adopt(list(model.parameters()), "weights", param=True)
            marks: dict[str, int] = {}
            with tracker:
                opt = make_optimizer(t, list(model.parameters()), model) if client else None
                engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds,
                                                  optimizer=opt)
                marks["init"] = len(tracker.events)
                for step in range(2):
                    for micro in range(t.grad_accum):
                        if step == 1 and micro == 0:
                            marks["start"] = len(tracker.events)
                        loss = engine(**inputs).loss
                        if step == 1 and micro == t.grad_accum - 1:
                            marks["forward"] = len(tracker.events)
                        engine.backward(loss)
                        if step == 1 and micro == t.grad_accum - 1:
                            marks["backward"] = len(tracker.events)
                        engine.step()
                        del loss
                marks["end"] = len(tracker.events)
            del engine, model
        finally:
            gc.collect()
            dist.destroy_process_group()
            _forget_groups()
    live, best = 0, 0
    phase_peaks: dict[str, int] = {}
    out: dict[str, Any] = {"phase_peaks": phase_peaks}
    order = [("init", "init_peak"), ("start", None), ("forward", "forward"), ("backward", "backward"), ("end", "optimizer")]
    k = 0
    for i, (idx, sign) in enumerate(tracker.events):
        while k < len(order) and i >= marks[order[k][0]]:
            name, key = order[k]
            if name == "init":
                out["init_peak"] = best
            elif name == "start":
                out["live_at_start"] = live
            else:
                phase_peaks[str(key)] = best
            best, k = live, k + 1
        live += sign * cuda_round(tracker.records[idx].nbytes)
        best = max(best, live)
    phase_peaks["optimizer"] = best
    out["peak"] = max(phase_peaks.values())
    return out


def _forget_groups() -> None:
    """DeepSpeed keeps the process groups it made (``deepspeed.utils.groups``) and its communication backend
    (``deepspeed.comm.comm.cdb``) in module globals; the next measurement's process group is a new one."""
    from deepspeed.comm import comm
    from deepspeed.utils import groups

    comm.cdb = None
    for name, value in list(vars(groups).items()):
        if name.startswith("_") and name.isupper() and not name.startswith("__"):
            if isinstance(value, dict):
                value.clear()
            elif not callable(value) and not isinstance(value, (int, str, float, bool)):
                setattr(groups, name, None)
