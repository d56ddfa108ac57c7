"""Measure what loading a model for DeepSpeed ZeRO-3 allocates on one rank, in a single process.

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
from collections.abc import Iterator

from ..model.hf_writers import to_hf_config
from ..model.spec import ModelSpec
from ..spec.parallel import ParallelSpec
from ..spec.training import TrainingSpec
from .tracker import StorageTracker

__all__ = ["measure_zero3_load"]


@contextlib.contextmanager
def _environment(world: int) -> Iterator[None]:
    """What DeepSpeed reads from a launcher's environment, for rank 0 of `world` on its CPU accelerator."""
    values = {"DS_ACCELERATOR": "cpu", "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": str(world),
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29599"}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _torch_functions_kept() -> Iterator[None]:
    """``zero.Init`` swaps ``torch.nn.functional.linear`` for its own (``zero3_linear_wrap``) and, as transformers
    enters it, leaves it swapped: every later step in this process would run DeepSpeed's linear. Put back here."""
    import torch

    saved = {name: getattr(torch.nn.functional, name) for name in ("linear",)}
    saved_torch = {name: getattr(torch, name) for name in ("empty", "zeros", "ones", "full", "tensor", "arange")}
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.functional, name, fn)
        for name, fn in saved_torch.items():
            setattr(torch, name, fn)


def _device_trace(tracker: StorageTracker) -> tuple[int, ...]:
    """The tracker's events as a loading trace (``e >= 0`` mallocs ``e`` bytes, ``~i`` frees allocation ``i``),
    without what a GPU run would not allocate on the device: empty storages, and the checkpoint's tensors,
    which rank 0 reads into host memory (``map_location="cpu"``; safetensors hands them over with ``set_``)."""
    number: dict[int, int] = {}
    trace: list[int] = []
    for i, sign in tracker.events:
        r = tracker.records[i]
        if r.nbytes == 0 or r.op.startswith("set_."):
            continue
        if sign > 0:
            number[i] = len(number)
            trace.append(r.nbytes)
        else:
            trace.append(~number[i])
    return tuple(trace)


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
            return _device_trace(tracker)
        finally:
            # transformers keeps ZeRO-3 on while the config lives: every later model would be built in zero.Init
            unset_hf_deepspeed_config()
            gc.collect()
            dist.destroy_process_group()
