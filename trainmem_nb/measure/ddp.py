"""What ``DistributedDataParallel`` lays out when it wraps a model: its reducer's gradient buckets, measured over
PyTorch's fake process group on the CPU (`trainmem_nb.parallel.ddp` models them)."""

from __future__ import annotations

import gc

from ..model.spec import ModelSpec
from ..spec.parallel import ParallelSpec
from ..spec.training import TrainingSpec
from .step import build
from .tracker import StorageTracker

__all__ = ["measure_ddp_buckets"]


def measure_ddp_buckets(m: ModelSpec, t: TrainingSpec, p: ParallelSpec) -> list[int]:
    """The storages (bytes each, largest first) that wrapping `m` in ``DistributedDataParallel`` allocates and
    keeps on one of ``p.dp`` ranks: the reducer's flat gradient buckets and its bookkeeping. The model is built
    as a measured step builds it (LoRA applied), and wrapped with ``find_unused_parameters=True``, what the HF
    Trainer passes for a model that does not checkpoint activations."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=p.dp)
    try:
        model, _inputs = build(m, t, "cpu")
        tracker = StorageTracker()
        tracker.adopt([*model.parameters(), *model.buffers()], "weights", param=True)
        before = len(tracker.records)
        with tracker:
            wrapped = DistributedDataParallel(model, find_unused_parameters=True)
            gc.collect()  # the state broadcast's temporaries go when Python drops them
        kept = sorted((r.nbytes for r in tracker.records[before:] if r.died is None), reverse=True)
        del wrapped
        return kept
    finally:
        dist.destroy_process_group()
