"""Mixture-of-experts models under sharded data parallelism: the expert stacks shard so that a rank's
memory falls, not grows, as GPUs are added."""

from __future__ import annotations

import itertools

import pytest

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


_DENSE_THEN_MOE = dict(family="deepseek_v3", n_layers=4, hidden=32, n_heads=4, head_dim=8, ffn=64, vocab=8,
                       tie_embeddings=False, max_positions=4096, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                       kv_lora_rank=16, q_lora_rank=0, n_experts=4, experts_top_k=1, n_expert_groups=2,
                       topk_groups=1, expert_ffn=32, n_shared_experts=0, dense_layers=(0,))


def test_fsdp_gradients_of_dense_and_moe_layers_are_each_their_own_layers_shards() -> None:
    """A layer unit holds only its kind's parameters (a dense layer no expert, an MoE layer no dense MLP):
    the sharded gradients before the optimizer step are the trainable parameters' shards, once each, and
    no category goes negative when a pipeline stage starts with a dense layer (it did: zero_grad freed
    every layer's union of dense and MoE gradients)."""
    from trainmem_nb.engine.breakdown import TOP_KEYS
    from trainmem_nb.engine.program import timeline
    from trainmem_nb.model.params import weight_tensors
    from trainmem_nb.model.spec import ModelSpec
    from trainmem_nb.parallel.ranks import _padded_shard

    m = ModelSpec.model_validate(_DENSE_THEN_MOE)
    opts = dict(micro_batch=1, seq_len=4, precision="fp32", optimizer="sgd", engine="fsdp", zero=2, gpus=2)
    est = tm.estimate(m, **opts)
    t = tm.TrainingSpec(precision="fp32", optimizer="sgd")
    # FSDP2 makes one flat sharded-gradient tensor per unit (the root, each layer), 512-byte rounded
    dense = [p for p, _dt, trainable in weight_tensors(m, t) if trainable and p.kind != "moe"]
    moe = [p for p, _dt, trainable in weight_tensors(m, t) if trainable and p.kind != "dense"]
    def unit(params: list, in_layer: bool) -> int:
        return -(-sum(_padded_shard(p, 2) * 4 for p in params if p.in_layer == in_layer) // 512) * 512
    shards = unit(dense, False) + unit(dense, True) + 3 * unit(moe, True)
    points = timeline(est.rank_programs[0], *est.rank_shape, max_points=10**7)
    grads = [p.by_category[TOP_KEYS.index("gradients")] for p in points]
    before_zero_grad = next(i for i, p in enumerate(points) if p.phase == "zero") - 1
    assert grads[before_zero_grad] == shards
    assert grads[-1] == 0  # zero_grad frees exactly those
    staged = tm.estimate(m, **opts | dict(pp=2, gpus=4))
    for prog in staged.rank_programs:
        assert min(min(p.by_category) for p in timeline(prog, *staged.rank_shape, max_points=10**7)) >= 0


# -- expert parallelism (torchtitan's all-to-all dispatch; experts shard over dp_shard_cp / ep) ----------------

_EP_LAYOUTS = [dict(engine="fsdp", zero=3, gpus=16, nodes=2), dict(engine="deepspeed", zero=3, gpus=16, nodes=2),
               dict(engine="deepspeed", zero=1, gpus=16, nodes=2), dict(engine="megatron", zero=1, gpus=16, nodes=2)]


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v3"])
@pytest.mark.parametrize("layout", _EP_LAYOUTS, ids=lambda lay: f"{lay['engine']}-zero{lay['zero']}")
def test_expert_parallelism_moves_experts_between_ranks_without_dropping_their_states(name: str, layout: dict) -> None:
    # the ep ranks of a group hold different experts, each sharded over the other dp / ep ranks: a rank's
    # share of the optimizer states is the same whatever ep is (to the padding of a shard), never 1/ep of it
    states = [tm.estimate(name, micro_batch=1, seq_len=1024, ep=ep, **layout).breakdown_bytes["optimizer_states"]
              for ep in (1, 2, 8)]
    assert max(states) - min(states) <= 0.01 * states[0], states


def test_expert_parallel_ranks_still_route_every_token_to_top_k_experts() -> None:
    # mixtral routes each token to 2 of 8 experts; with one expert per rank (ep=8) a rank's experts still
    # process tokens * top_k rows (balanced routing): its saved activations grow by the dispatch's
    # permuted_indices alone (int64 per row, one tensor per MoE layer) instead of shrinking to one expert's share
    kw = dict(micro_batch=2, seq_len=1024, engine="fsdp", zero=3, gpus=16, nodes=2)
    no_ep, ep8 = (tm.estimate("mixtral-8x7b", ep=ep, **kw) for ep in (1, 8))
    rows = 2 * 1024 * 2  # b * s * top_k
    assert ep8.saved_activations_bytes - no_ep.saved_activations_bytes == 32 * rows * 8


def test_expert_parallelism_gathers_only_the_ranks_own_experts_under_fsdp() -> None:
    from trainmem_nb.model.presets import get_model

    m = get_model("mixtral-8x7b")
    kw = dict(micro_batch=2, seq_len=2048, engine="fsdp", zero=3, gpus=16, nodes=2)
    gathered = {}
    for ep in (1, 8):
        est = tm.estimate(m, ep=ep, **kw)  # the most weights alive at any point, less the rank's own shards
        gathered[ep] = max(p.by_category[0] for p in est.timeline(10**6)) - est.detail_bytes["weights/params"]
    expert = 3 * m.hidden * m.expert_width * 2  # one expert's gate, up and down projections in bf16
    # the root and one layer gathered at most: 8 experts without expert parallelism, the rank's one with ep=8
    assert gathered[1] - gathered[8] == 7 * expert


def test_deepseek_v3_trains_with_its_own_expert_parallel_degree() -> None:
    # DeepSeek-V3 was trained with EP=64 (arXiv 2412.19437, sec. 3.4): 4 of its 256 routed experts per rank,
    # its router still scoring all 256 in 8 groups
    est = tm.estimate("deepseek-v3", micro_batch=1, seq_len=4096, checkpointing="full", engine="fsdp", zero=3,
                      gpus=256, nodes=32, ep=64)
    assert est.peak_allocated_bytes < 80 * 2**30
    with pytest.raises(tm.SpecError, match=r"ep=64 must divide the ranks ZeRO/FSDP shards over \(8\)"):
        tm.estimate("deepseek-v3", micro_batch=1, seq_len=4096, engine="fsdp", zero=3, hybrid_shard=True,
                    gpus=256, nodes=32, ep=64)



def test_expert_parallel_ranks_load_their_own_experts_sharded_over_their_group() -> None:
    # each rank loads its n_experts / ep experts, sharded over the shard_degree / ep ranks holding them: what
    # it loads is what it holds, whatever ep is (it loaded 1/ep of its experts' share)
    for ep in (1, 8):
        est = tm.estimate("mixtral-8x7b", micro_batch=1, seq_len=1024, engine="fsdp", zero=3, gpus=16, nodes=2, ep=ep)
        assert est.load_peak_bytes == pytest.approx(est.detail_bytes["weights/params"], rel=0.001), ep
