"""What a reader of a verdict must know that the numbers alone do not say: notes next to every fit
verdict (`trainmem_nb.planning.fit.fit`, plan rows, the explorer, ``trainmem estimate --gpu``) and
under ``MemoryEstimate.summary()``.
"""

from __future__ import annotations

from ..model.families import Family
from ..model.params import vision_inventory
from ..model.spec import ModelSpec
from ..recipes.registry import loss_gap, runs_loss
from ..spec.choices import LossImpl, Method
from ..spec.parallel import Engine, ParallelSpec
from ..spec.training import TrainingSpec
from ..units import format_bytes

__all__ = ["estimate_notes"]


def estimate_notes(m: ModelSpec, t: TrainingSpec, p: ParallelSpec | None = None) -> tuple[str, ...]:
    """Notes on a step of `m` trained as `t` on layout `p`: a LoRA base counted in fp32 under a mixed
    recipe, QLoRA leaving an MoE model's fused expert tensors unquantized, FSDP ranks outnumbering the
    experts, SDPA counted as eager where transformers has none (Gemma 2), Gemma 3's vision tower held but never run."""
    notes = []
    if p is not None and p.engine is Engine.FSDP and t.fsdp_version == 1 and "fsdp_version" not in t.model_fields_set:
        from ..parallel.checks import fsdp1_gap

        gap = fsdp1_gap(m, t, p)
        if gap:
            notes.append(f"the stack {t.stack!r} runs FSDP1 (FullyShardedDataParallel), not modelled with {gap}: "
                         "counted as FSDP2 (fully_shard)")
    if t.loss_impl is LossImpl.LITGPT and runs_loss(m, t) is not LossImpl.LITGPT:
        notes.append(f"the stack {t.stack!r} runs lit-gpt's chunked head and loss, not modelled for "
                     f"{m.family.value} ({loss_gap(m, t)}): counted as transformers' loss")
    if p is not None and p.engine is Engine.FSDP and m.is_moe and p.shard_degree // p.ep > m.n_experts // p.ep:
        notes.append(
            f"FSDP over {p.shard_degree // p.ep} ranks per expert stack with {m.n_experts // p.ep} "
            f"expert{'s' if m.n_experts // p.ep != 1 else ''} per expert-parallel rank: the expert stacks are "
            "counted sharded along their second dim (torchtitan's "
            "shard_placement_fn); plain "
            "fully_shard shards dim 0, pads each rank to a whole expert and all-gathers the padding, so its memory "
            "grows with the GPU count")
    if t.fp8.value != "none" and p is not None and p.engine is Engine.MEGATRON:
        recipe = "DelayedScaling" if t.fp8.value == "delayed" else "Float8CurrentScaling"
        proj = ("the attention's output projection saves its 16-bit input (Megatron's set_save_original_input)"
                if t.fp8.value != "delayed" else "the attention output stays saved by attention as well")
        notes.append(f"fp8={t.fp8.value!r} under Megatron is Transformer Engine's {recipe} on a Hopper GPU: each block "
                     "linear keeps an fp8 copy of its weight and its transpose across micro-batches (2 bytes a "
                     "parameter, weights/fp8_workspaces) and saves its input as a 1-byte fp8 transpose instead of "
                     f"the 16-bit input ({proj}); Blackwell keeps one copy instead of two, and --fp8-param-gather "
                     "(fp8 parameters, no 16-bit weights) is not modelled")
    elif t.fp8.value != "none":
        if m.family is Family.GPT2:
            notes.append(f"fp8={t.fp8.value!r} on gpt2: its projections are Conv1D, not nn.Linear, which torchao's "
                         "convert_to_float8_training leaves as they are: no matmul runs in fp8, the step is bf16's")
        else:
            gather = ("FSDP2's float8 all-gather (fp8_all_gather=True) halves the gathered weights" if not
                      t.fp8_all_gather else "the float8 all-gather is counted (fp8 gathered weights, their casts before "
                      "the gather)")
            notes.append(f"fp8={t.fp8.value!r} is torchao's Float8Linear in eager mode: it saves the bf16 input and weight "
                         "for backward, so weights, gradients, states and activations stay what they are without fp8, "
                         "and each block linear adds its casts' temporaries (an fp32 copy of each operand, six casts a linear); torch.compile "
                         f"fuses those casts (not modelled); {gather}")
    if t.method is not Method.FULL and t.mixed:
        notes.append(
            f"{t.method.value} with precision={t.precision.value!r}: the frozen base is counted in fp32 (autocast "
            "with fp32 weights); peft users usually load the base in 16 bits (torch_dtype=torch.bfloat16): "
            "precision='bf16-true' (the default for lora and qlora) counts that, about half the weights")
    if t.method is Method.QLORA and m.is_moe:
        from ..model.params import param_inventory, quantized

        kept = [p for p in param_inventory(m) if p.in_layer and p.matmul and len(p.shape) > 2 and not quantized(p)]
        if kept:
            size = sum(p.numel * p.count for p in kept) * t.param_bytes
            notes.append(
                f"qlora on {m.name}: bitsandbytes quantizes nn.Linear layers only, and transformers stores the "
                f"{m.n_experts} experts of each layer as fused 3-D parameters: {format_bytes(size)} of expert "
                f"weights stay in {8 * t.param_bytes}-bit, not NF4")
    from ..model.families import describe
    from ..spec.choices import Attention

    d = describe(m.family)
    if t.attention is Attention.SDPA and not d.sdpa:
        why = ("its attention sinks run in the eager path" if d.attention == "sinks"
               else "SDPA has no logit soft-capping")
        flash = ("" if d.attention == "sinks"
                 else "; attention='flash' counts FlashAttention-2, which soft-caps")
        notes.append(
            f"{m.family.value} has no SDPA path in transformers ({d.hf_class}: _supports_sdpa = False, as {why}): "
            "attention='sdpa' is counted as the eager attention Hugging Face runs by default, whose (b, heads, s, s) "
            f"scores dominate at long sequences{flash}")
    if m.vision is not None:
        where = ("" if p is None or p.single_device else
                 "; FSDP2 shards it in the root module's group and gathers it with the embeddings; DeepSpeed casts "
                 "it to the model's 16-bit dtype, partitions it under ZeRO-3 and keeps an fp32 master and optimizer "
                 "state for what of it requires a gradient; elsewhere whole on every rank, and DDP's buckets hold a "
                 "slot for each of its parameters that requires a gradient")
        notes.append(f"{m.name}: Gemma3ForConditionalGeneration (what AutoModelForCausalLM builds from a multimodal "
                     "config): its SigLIP vision tower and projector "
                     f"({format_bytes(sum(p.numel * p.count for p in vision_inventory(m)) * t.param_bytes)}"
                     f"{' before NF4' if t.method is Method.QLORA else ''}) are held as weights and never run on text "
                     f"(no gradients, no optimizer state){where}")
        if m.vocab <= GEMMA3_IMAGE_TOKEN_ID:
            notes.append(f"{m.name}: a vocabulary of {m.vocab:,} (not above the image token id {GEMMA3_IMAGE_TOKEN_ID:,}, "
                         "unlike the released checkpoints) makes Gemma3Model clone the input ids and mask the image "
                         "token (8 + 1 bytes a token): not counted")
    elif m.family is Family.GEMMA3:
        notes.append("gemma3: the language model only (Gemma3ForCausalLM, a gemma3_text config); a multimodal "
                     "gemma3 config adds its vision tower's weights (ModelSpec.vision)")
    return tuple(notes)


#: Gemma3Config's ``image_token_index`` default (configuration_gemma3.py): ids at or above the vocabulary make
#: Gemma3Model.forward clone ``input_ids`` (``if self.config.image_token_id >= self.vocab_size``).
GEMMA3_IMAGE_TOKEN_ID = 262_144
