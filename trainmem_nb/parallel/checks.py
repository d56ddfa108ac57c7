"""Layout constraints that depend on the model, with what would work instead.
"""

from __future__ import annotations

from ..errors import SpecError
from ..model.spec import ModelSpec
from ..spec.choices import Fp8Recipe, Method
from ..spec.parallel import Engine, ParallelSpec, PipelineSchedule
from ..spec.training import TrainingSpec

__all__ = ['CP_CHUNKS_PER_RANK', 'check_layout', 'fsdp1_gap', 'keeps_grads_modelled', 'runs_fsdp1']


def keeps_grads_modelled(p: ParallelSpec) -> bool:
    """Is ``zero_grad(set_to_none=False)`` modelled on layout `p`? On one device, DDP, and FSDP without pipelining
    or offload. DeepSpeed and Megatron keep gradients in their own buffers and clear them themselves (torch's
    default does not reach them); a pipeline stage's accumulated gradients and an offloaded step's are modelled
    as set_to_none=True leaves them."""
    return p.single_device or not (p.engine in (Engine.DEEPSPEED, Engine.MEGATRON) or p.pp > 1
                                   or p.offload.value != "none")

#: Context parallelism cuts each sequence into ``2 * cp`` equal chunks and gives rank r chunks r and
#: ``2 * cp - 1 - r`` (a causal mask then costs every rank the same): PyTorch's ``context_parallel``
#: (torch/distributed/tensor/experimental/_context_parallel/_load_balancer.py, _HeadTailLoadBalancer:
#: raises unless ``seq_length % (world_size * 2) == 0``) and Megatron-LM (megatron/training/utils.py,
#: get_batch_on_this_cp_rank: ``val.view(..., 2 * cp_size, val.shape[seq_dim] // (2 * cp_size), ...)``).
CP_CHUNKS_PER_RANK = 2


def check_layout(m: ModelSpec, p: ParallelSpec, t: TrainingSpec | None = None) -> None:
    """Layout constraints that depend on the model (and, given `t`, on the batch shape), with what
    would work instead."""
    if t is not None:
        _check_context_parallel(t, p)
        _check_fsdp1(m, t, p)
        _check_fp8(m, t, p)
        if p.engine is Engine.MEGATRON and t.optimizer.value in ("adafactor", "adamw-8bit", "lion"):
            # megatron/training/arguments.py: ``--optimizer`` chooses 'adam' or 'sgd' (with --sgd-momentum); a paged
            # AdamW is counted as Megatron's own Adam (its states on the device)
            raise SpecError(f"optimizer={t.optimizer.value!r} with engine='megatron': Megatron-LM's distributed "
                            "optimizer is Adam(W) or SGD (--optimizer adam|sgd); use one of adamw, adam, sgd, "
                            "sgd-momentum (or none: no optimizer step), or another engine")
        if t.method is Method.QLORA and p.engine is Engine.MEGATRON:
            # Megatron-LM builds its own 16-bit layers (megatron/core/transformer) and has no bitsandbytes
            # path; QLoRA is a transformers + peft + bitsandbytes recipe
            raise SpecError("method='qlora' with engine='megatron': Megatron-LM has no 4-bit (bitsandbytes NF4) "
                            "weights; use method='lora' with megatron, or qlora with engine='ddp', 'fsdp' or "
                            "'deepspeed'")
        if not t.zero_grad_set_to_none and not keeps_grads_modelled(p) and "zero_grad_set_to_none" in t.model_fields_set:
            raise SpecError(f"zero_grad_set_to_none=False (torch < 2.0's zero_grad) with engine={p.engine.value!r}, "
                            f"pp={p.pp}, offload={p.offload.value!r} is not modelled; it is modelled on one device, with "
                            "ddp, and with fsdp without pp or offload")
        if t.loss_impl.value != "standard" and (p.engine is Engine.MEGATRON or p.tp > 1 or p.cp > 1):
            # Megatron (and tensor parallelism) shard the head over the vocabulary with their own
            # vocab-parallel cross-entropy; the modelled losses take the whole head on one rank
            by = "" if "loss_impl" in t.model_fields_set else f"the stack {t.stack!r} sets "
            raise SpecError(f"{by}loss_impl={t.loss_impl.value!r} with engine={p.engine.value!r}, tp={p.tp}, cp={p.cp} "
                            "is not modelled (a vocabulary-sharded head has its own vocab-parallel cross-entropy); "
                            "use it with ddp, fsdp or deepspeed and tp=1, cp=1, or loss_impl='standard'")
    if m.n_heads % p.tp:
        ok = [d for d in range(1, min(m.n_heads, p.gpus_per_node) + 1) if m.n_heads % d == 0 and m.n_kv_heads % d == 0]
        raise SpecError(f"tp={p.tp} does not divide {m.name}'s n_heads={m.n_heads}; use tp in {ok}")
    if m.n_kv_heads % p.tp and p.tp % m.n_kv_heads:
        raise SpecError(f"tp={p.tp} and n_kv_heads={m.n_kv_heads} must divide one another (kv heads are split or "
                        f"replicated across tensor-parallel ranks)")
    if p.pp > m.n_layers:
        raise SpecError(f"pp={p.pp} exceeds {m.name}'s n_layers={m.n_layers}; use pp <= {m.n_layers}")
    if p.pp * p.virtual_stages > m.n_layers:
        raise SpecError(f"pp*virtual_stages = {p.pp * p.virtual_stages} exceeds n_layers={m.n_layers}")
    if p.pp_schedule is PipelineSchedule.INTERLEAVED and m.n_layers % (p.pp * p.virtual_stages):
        # Megatron-LM requires equal model chunks: megatron/training/arguments.py (validate_args) asserts
        # num_layers % pipeline size == 0 and layers per stage % layers per virtual stage == 0
        ok = [v for v in range(2, m.n_layers // p.pp + 1) if m.n_layers % (p.pp * v) == 0]
        hint = f"use virtual_stages in {ok}" if ok else f"use a pp that divides n_layers={m.n_layers}, or pp_schedule='1f1b'"
        raise SpecError(f"pp_schedule='interleaved' splits {m.name}'s n_layers={m.n_layers} into pp*virtual_stages = "
                        f"{p.pp}*{p.virtual_stages} = {p.pp * p.virtual_stages} equal chunks, which does not divide it; "
                        f"{hint}")
    if p.ep > 1:
        if not m.is_moe:
            raise SpecError(f"ep={p.ep} needs a mixture-of-experts model; {m.name} has no experts (use ep=1)")
        if m.n_experts % p.ep:
            raise SpecError(f"ep={p.ep} does not divide n_experts={m.n_experts}")
        if p.dp % p.ep:
            raise SpecError(f"ep={p.ep} must divide the data-parallel degree dp={p.dp}")
        if p.zero and p.shard_degree % p.ep:
            raise SpecError(f"ep={p.ep} must divide the ranks ZeRO/FSDP shards over ({p.shard_degree}): each expert "
                            "shards over shard_degree / ep ranks; use an ep that divides it")


def _check_fp8(m: ModelSpec, t: TrainingSpec, p: ParallelSpec) -> None:
    """fp8 is modelled as torchao's Float8Linear on each rank of a data-parallel layout (DDP, FSDP2, ZeRO), and
    as Transformer Engine's linears under Megatron; what neither models is refused, saying which."""
    if t.fp8_all_gather and not (p.engine is Engine.FSDP and p.zero >= 2 and t.fsdp_version == 2 and p.pp == 1
                                 and p.offload.value == "none"):
        raise SpecError(f"fp8_all_gather=True (FSDP2's float8 all-gather) is modelled for engine='fsdp' with zero 2 or 3, "
                        f"pp=1 and no offload, not with engine={p.engine.value!r}, zero={p.zero}, pp={p.pp}, "
                        f"offload={p.offload.value!r}; use that layout or fp8_all_gather=False")
    if t.fp8.value == "none":
        return
    how = f"fp8={t.fp8.value!r}"
    if p.engine is Engine.MEGATRON:  # Transformer Engine's linears (`trainmem_nb.engine.ops.te_fp8`)
        if t.fp8 is Fp8Recipe.ROWWISE:
            raise SpecError(f"{how} is torchao's recipe; under engine='megatron' Transformer Engine's 'delayed' "
                            "(DelayedScaling, Megatron's default) and 'tensorwise' (Float8CurrentScaling) are modelled, "
                            "not its mxfp8 or blockwise recipes: use fp8='delayed' or 'tensorwise'")
        if m.n_experts:
            raise SpecError(f"{how} with engine='megatron' and a mixture-of-experts model: Transformer Engine's grouped "
                            "expert linears in fp8 are not modelled; use fp8='none', or engine='fsdp' (torchao leaves "
                            "the expert stacks in bf16)")
        return
    if t.fp8 is Fp8Recipe.DELAYED:
        raise SpecError(f"{how} is Transformer Engine's DelayedScaling, modelled under engine='megatron'; torchao's "
                        f"recipes (engine={p.engine.value!r}) are 'tensorwise' and 'rowwise'")
    if t.mixed and not (p.engine is Engine.FSDP and p.zero >= 2 and t.fsdp_version == 2):
        # under autocast Float8Linear casts its input to the GPU's autocast dtype (float8_linear.py: a check of
        # CUDA's autocast only); FSDP2's MixedPrecisionPolicy instead gathers the fp32 weights in bf16
        raise SpecError(f"{how} with precision={t.precision.value!r} is modelled under FSDP2 (engine='fsdp', zero 2 or "
                        "3: fp32 shards gathered in bf16, as torchtitan runs fp8), not under autocast; use that layout, "
                        "or precision='bf16-true'")
    if p.engine is Engine.DEEPSPEED:
        raise SpecError(f"{how} with engine='deepspeed' is not modelled (torchao's Float8Linear under ZeRO's "
                        "parameter partitioning is measured nowhere); use engine='fsdp' (as torchtitan runs it) or "
                        "'ddp'")
    if p.tp > 1 or p.cp > 1:
        raise SpecError(f"{how} with tp={p.tp}, cp={p.cp}: torchao's float8 tensor-parallel styles (Float8ColwiseParallel) "
                        "are not modelled; use tp=1 and cp=1 with fp8")
    if p.engine is Engine.FSDP and t.fsdp_version == 1:
        raise SpecError(f"{how} with fsdp_version=1 is not modelled (torchao's float8 is FSDP2's: torchtitan); use "
                        "fsdp_version=2")


def fsdp1_gap(m: ModelSpec, t: TrainingSpec, p: ParallelSpec) -> str:
    """Why FSDP1 (`trainmem_nb.parallel.fsdp1`) is not modelled for this step, or "" when it is: FULL_SHARD
    and SHARD_GRAD_OP over data-parallel ranks, in the parameters' own dtype, one dtype and one kind of layer
    per model."""
    from ..model.params import weight_tensors

    if t.mixed:
        return (f"precision={t.precision.value!r}: FSDP1's MixedPrecision policies are not modelled; use 'bf16-true' "
                "or 'fp32' (what Fabric's 'bf16-true' runs)")
    if p.pp > 1 or p.tp > 1 or p.cp > 1 or p.ep > 1 or p.offload.value != "none":
        return "pp, tp, cp or ep > 1 or offload: only data-parallel sharding is modelled"
    if p.zero < 2:
        return f"zero={p.zero}: use zero=3 (FULL_SHARD) or zero=2 (SHARD_GRAD_OP)"
    if t.method is Method.QLORA:
        return "QLoRA: its 4-bit weights under FSDP1 (bnb_4bit_quant_storage, LoRA units of their own) are not modelled"
    if t.method is Method.LORA and not t.use_orig_params:
        return ("LoRA and use_orig_params=False: a FlatParameter needs uniform requires_grad, so the adapters would be "
                "FSDP units of their own (peft's fsdp_auto_wrap_policy), which is not modelled; use use_orig_params=True")
    if t.method is Method.LORA and t.adapter_bytes != t.param_bytes:
        return ("peft's fp32 adapters in 16-bit blocks: a FlatParameter holds one dtype (torch refuses to flatten "
                "both); use lora_dtype='base', the adapters in the base dtype, as Fabric's init_module builds them")
    if len({k.moe for k in m.layer_kinds}) > 1:
        return f"{m.name}'s dense and MoE layers: FSDP1 is modelled for models whose layers are alike"
    if len({dt for _p, dt, _t in weight_tensors(m, t)}) > 1:
        return (f"{m.name} keeps some parameters in another dtype (an fp32 router): torch's FSDP1 flattens one dtype "
                "per FlatParameter")
    if not t.zero_grad_set_to_none:
        return "torch < 2.0's zero_grad (set_to_none=False), which is not modelled with it"
    if t.optimizer.value == "paged-adamw":
        return "a paged optimizer, whose unified-memory states are not modelled with it"
    return ""


def runs_fsdp1(m: ModelSpec, t: TrainingSpec, p: ParallelSpec) -> bool:
    """Is the step modelled as FSDP1: ``engine='fsdp'`` with ``fsdp_version=1`` where FSDP1 is modelled? A stack's
    FSDP1 where it is not (`fsdp1_gap`) is modelled as FSDP2, and the estimate's notes say so."""
    return p.engine is Engine.FSDP and t.fsdp_version == 1 and not fsdp1_gap(m, t, p)


def _check_fsdp1(m: ModelSpec, t: TrainingSpec, p: ParallelSpec) -> None:
    """An FSDP1 the user asked for (``fsdp_version=1`` given, not a stack's) that is not modelled is refused,
    saying why and what works; so is an FSDP1 option the user set where the step is not FSDP1's."""
    asked = [f"{k}={getattr(t, k)}" for k, default in (("use_orig_params", True), ("sync_module_states", False))
             if k in t.model_fields_set and getattr(t, k) != default]
    if asked and not (p.engine is Engine.FSDP and t.fsdp_version == 1):
        raise SpecError(f"{', '.join(asked)} is an option of FullyShardedDataParallel: add engine='fsdp' and "
                        "fsdp_version=1 (with gpus), or leave it out")
    if "fsdp_version" not in t.model_fields_set or t.fsdp_version != 1:
        return
    if p.engine is not Engine.FSDP:
        raise SpecError(f"fsdp_version=1 is an option of engine='fsdp' (got engine={p.engine.value!r})")
    why = fsdp1_gap(m, t, p)
    if why:
        raise SpecError(f"fsdp_version=1 (FullyShardedDataParallel) is not modelled with {why}; or use "
                        "fsdp_version=2 (fully_shard)")


def _check_context_parallel(t: TrainingSpec, p: ParallelSpec) -> None:
    """Context parallelism needs a sequence its ``2 * cp`` chunks divide (`CP_CHUNKS_PER_RANK`): at
    least two tokens per rank, and none left over."""
    chunks = CP_CHUNKS_PER_RANK * p.cp
    if p.cp == 1 or t.seq_len % chunks == 0:
        return
    ok = [c for c in range(1, min(p.cp, t.seq_len // CP_CHUNKS_PER_RANK) + 1)
          if t.seq_len % (CP_CHUNKS_PER_RANK * c) == 0 and p.gpus % c == 0][-4:] or [1]
    raise SpecError(f"cp={p.cp} needs seq_len divisible by 2*cp = {chunks} (context parallelism cuts each sequence "
                    f"into 2*cp equal chunks); seq_len={t.seq_len} is not: use a seq_len that is a multiple of "
                    f"{chunks}, or cp in {ok}")
