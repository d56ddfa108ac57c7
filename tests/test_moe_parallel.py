"""Mixture-of-experts models under sharded data parallelism: the expert stacks shard so that a rank's
memory falls, not grows, as GPUs are added."""

from __future__ import annotations

import itertools

import trainmem_nb as tm


def _peak(gpus: int) -> int:
    return tm.estimate("mixtral-8x7b", micro_batch=1, seq_len=2048, engine="fsdp", zero=3, gpus=gpus,
                       nodes=max(1, gpus // 8)).peak_allocated_bytes


def test_mixtral_fsdp_zero3_peak_per_gpu_never_grows_with_the_gpu_count() -> None:
    peaks = [_peak(g) for g in (8, 16, 32, 64, 128)]
    assert all(later <= earlier for earlier, later in itertools.pairwise(peaks)), peaks
    assert peaks[-1] < 0.5 * peaks[0]


def test_experts_outnumbered_by_ranks_are_sharded_along_their_second_dim_and_the_estimate_says_so() -> None:
    from trainmem_nb.model.params import ParamTensor
    from trainmem_nb.parallel.ranks import _row_shard

    stack = ParamTensor("layers.mlp.experts.gate_up_proj", (8, 28672, 4096), 32, True, True)
    assert _row_shard(stack, 4).shape == (2, 28672, 4096)  # more experts than ranks: dim 0
    assert _row_shard(stack, 64).shape == (8, 448, 4096)  # fewer: dim 1, no padding to whole experts
    est = tm.estimate("mixtral-8x7b", micro_batch=1, seq_len=2048, engine="fsdp", zero=3, gpus=64, nodes=8)
    assert any("sharded along their second dim" in line for line in est.summary().splitlines())
    small = tm.estimate("mixtral-8x7b", micro_batch=1, seq_len=2048, engine="fsdp", zero=3, gpus=8)
    assert "second dim" not in small.summary()
