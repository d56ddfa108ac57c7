"""The named choices of a training step: precision, optimizer and its implementation, checkpointing,
attention kernel, device, method and adapter dtype. Each member's comment says what it means.
"""

from __future__ import annotations

from .base import _Choice

__all__ = ['CHECKPOINTING_HELP', 'AdapterDtype', 'Attention', 'Checkpointing', 'Device', 'Fp8Recipe', 'LossImpl', 'Method', 'OptimizerImpl', 'OptimizerName', 'Precision', 'QuantStorage']


class Precision(_Choice):
    """How weights, gradients, optimizer states and activations are stored for one step."""

    FP32 = "fp32"  #: everything fp32
    BF16_MIXED = "bf16-mixed"  #: fp32 weights/grads/states, autocast bf16 compute (HF Trainer bf16=True)
    FP16_MIXED = "fp16-mixed"  #: as bf16-mixed with fp16 autocast (and a loss scaler)
    BF16_TRUE = "bf16-true"  #: weights, grads, states and activations all bf16
    FP16_TRUE = "fp16-true"  #: weights, grads, states and activations all fp16


class OptimizerName(_Choice):
    """Optimizers; their state sizes and step temporaries live in `trainmem_nb.step.optimizers`."""

    ADAMW = "adamw"  #: torch.optim.AdamW: exp_avg + exp_avg_sq + step per parameter
    ADAM = "adam"  #: torch.optim.Adam: same state as AdamW
    SGD = "sgd"  #: torch.optim.SGD without momentum: no state
    SGD_MOMENTUM = "sgd-momentum"  #: torch.optim.SGD(momentum=0.9): one momentum buffer
    ADAFACTOR = "adafactor"  #: torch.optim.Adafactor: factored second moment (row + column)
    LION = "lion"  #: Lion: one momentum buffer
    ADAMW_8BIT = "adamw-8bit"  #: bitsandbytes AdamW8bit: two uint8 states + block-wise absmax
    PAGED_ADAMW = "paged-adamw"  #: bitsandbytes PagedAdamW (32-bit states, paged to host under pressure)
    NONE = "none"  #: forward and backward only (no optimizer step)


class AdafactorImpl(_Choice):
    """Which Adafactor ``optimizer='adafactor'`` is: its state is the same, its step's temporaries are not
    (`trainmem_nb.step.optimizers`)."""

    TORCH = "torch"  #: torch.optim.Adafactor (foreach or a for-loop)
    #: transformers.optimization.Adafactor(scale_parameter=False, relative_step=False): what the HF Trainer's
    #: ``optim="adafactor"`` builds; a loop over parameters in fp32, with an RMS tensor per parameter
    TRANSFORMERS = "transformers"


class OptimizerImpl(_Choice):
    """PyTorch optimizer implementations; they differ in their step temporaries."""

    FOREACH = "foreach"  #: multi-tensor kernels (PyTorch's CUDA default): whole-model temporaries
    FUSED = "fused"  #: one fused kernel: no temporaries
    FOR_LOOP = "for-loop"  #: one parameter at a time (PyTorch's CPU default)


class Checkpointing(_Choice):
    """Activation checkpointing of each transformer layer (what each keeps: `CHECKPOINTING_HELP`)."""

    NONE = "none"
    SELECTIVE = "selective"
    SELECTIVE_OP = "selective-op"
    FULL = "full"


#: What each checkpointing policy keeps for backward (for docs, the explorer's tooltips and tables).
CHECKPOINTING_HELP: dict[Checkpointing, str] = {
    Checkpointing.NONE: "keep every activation for backward",
    Checkpointing.SELECTIVE: "keep matmul and attention outputs, recompute the cheap element-wise ops",
    Checkpointing.SELECTIVE_OP: "torchtitan's op-level policy: keep attention outputs and every other matmul "
                                "output of a layer, recompute the rest",
    Checkpointing.FULL: "keep only each layer's input, recompute the layer in backward",
}


class Attention(_Choice):
    """Attention implementation (Hugging Face ``attn_implementation``)."""

    SDPA = "sdpa"  #: torch scaled_dot_product_attention (flash / memory-efficient kernels)
    FLASH = "flash"  #: flash-attention 2
    EAGER = "eager"  #: matmul + softmax in Python: keeps the (b, heads, s, s) probabilities


class Device(_Choice):
    """Where the step runs: kernels and their memory differ (see `trainmem_nb.device`)."""

    CUDA = "cuda"
    CPU = "cpu"


class Method(_Choice):
    """What is trained."""

    FULL = "full"  #: every parameter
    LORA = "lora"  #: low-rank adapters on a frozen base
    QLORA = "qlora"  #: LoRA on an NF4-quantized frozen base


class AdapterDtype(_Choice):
    """The dtype peft stores LoRA adapters in."""

    FP32 = "fp32"  #: peft's default on a 16-bit base since 0.12 (``autocast_adapter_dtype=True``)
    BASE = "base"  #: the model's dtype (bf16 under bf16-true): adapters built in it (litgpt, torchtune)
    #: the adapted weight's dtype where it is floating, else fp32: peft < 0.12 (and ``autocast_adapter_dtype=False``
    #: before 0.19, which takes a 4-bit layer's compute dtype: huggingface/peft#2893); a QLoRA adapter on
    #: bitsandbytes' default uint8 storage stays fp32
    WEIGHT = "weight"


class QuantStorage(_Choice):
    """The dtype bitsandbytes stores QLoRA's packed 4-bit weights in (``bnb_4bit_quant_storage``): the bytes are
    the same, but peft gives an adapter its base weight's dtype only when that dtype is floating."""

    UINT8 = "uint8"  #: bitsandbytes' default
    BASE = "base"  #: the model's 16-bit dtype (``bnb_4bit_quant_storage=torch_dtype``), what FSDP-QLoRA sets


class LossImpl(_Choice):
    """How the language-model head's loss is computed (`trainmem_nb.recipes.head`)."""

    STANDARD = "standard"  #: transformers' ForCausalLMLoss: all logits, upcast to fp32, then cross-entropy
    CHUNKED = "chunked"  #: torchtune's LinearCrossEntropyLoss: logits chunk by chunk (``loss_chunks``)
    LIGER = "liger"  #: Liger Kernel's fused linear cross-entropy: gradients in the forward, no full logits
    CCE = "cce"  #: Apple's Cut Cross-Entropy: no logits tensor at all
    LITGPT = "litgpt"  #: lit-gpt's finetune loop: the lm_head in 128-token chunks, cross-entropy per chunk, no upcast


class Fp8Recipe(_Choice):
    """fp8 matmuls in the transformer blocks' linears: torchao's Float8 training recipes
    (``Float8LinearConfig.from_recipe_name``; `trainmem_nb.engine.ops.fp8`), or under engine='megatron'
    Transformer Engine's (Megatron's ``--fp8-recipe``; `trainmem_nb.engine.ops.te_fp8`)."""

    NONE = "none"  #: 16/32-bit matmuls (no fp8)
    TENSORWISE = "tensorwise"  #: one scale per tensor (torchao's default recipe; TE's Float8CurrentScaling)
    ROWWISE = "rowwise"  #: one scale per row, rounded to powers of two (torchao)
    DELAYED = "delayed"  #: TE's DelayedScaling, scales from an amax history (Megatron's default fp8 recipe)


class CausalLMLoss(_Choice):
    """How the transformers version computes the standard causal-LM loss (`trainmem_nb.recipes.head.causal_lm_loss`;
    the transformers component of a stack picks it, `trainmem_nb.spec.stack`)."""

    LABELS_SHIFTED = "labels-shifted"  #: 4.49 and later: upcast in the loss, the labels shifted
    LOGITS_SHIFTED = "logits-shifted"  #: 4.46-4.48: upcast in the loss, an fp32 copy of the shifted logits
    MODEL_UPCAST = "model-upcast"  #: 4.31-4.45: the model returns fp32 logits, then the shifted copy
    NO_UPCAST = "no-upcast"  #: 4.30 and before: the shifted copy in the head's dtype
