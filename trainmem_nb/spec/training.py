"""`TrainingSpec`: one training step's setup (batch shape, precision recipe, optimizer, recomputation,
kernels, fine-tuning method), validated and frozen.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache, lru_cache
from typing import Annotated, Any, ClassVar

from pydantic import Field, TypeAdapter, ValidationError, model_validator

from ..errors import SpecError, did_you_mean
from .base import _FROZEN, SpecModel, _validate
from .choices import (
    AdafactorImpl,
    AdapterDtype,
    Attention,
    CausalLMLoss,
    Checkpointing,
    Device,
    Fp8Recipe,
    LossImpl,
    Method,
    OptimizerImpl,
    OptimizerName,
    Precision,
    QuantStorage,
)
from .stack import COMPONENTS, Stack, parse_versions, resolve_stack

__all__ = ['TrainingSpec']


#: The optimizers a stack's ``optimizer_impl`` applies to: the Trainer's and DeepSpeed's default AdamW (another
#: optimizer keeps PyTorch's default implementation).
STACK_IMPL_OPTIMIZERS = frozenset({OptimizerName.ADAMW, OptimizerName.ADAM})


class TrainingSpec(SpecModel):
    """One training step's setup: batch shape, precision recipe, optimizer, recomputation, kernels.

    >>> t = TrainingSpec(micro_batch=2, seq_len=2048, precision="bf16-mixed")
    >>> t.tokens, t.resolved_optimizer_impl.value
    (4096, 'foreach')
    """

    model_config = _FROZEN

    micro_batch: int = Field(default=1, ge=1, le=1 << 20)
    seq_len: int = Field(default=2048, ge=1, le=1 << 24)
    grad_accum: int = Field(default=1, ge=1, le=1 << 20)
    precision: Precision = Field(
        default=Precision.BF16_MIXED, description="default: bf16-mixed for method='full', bf16-true (a 16-bit frozen "
        "base, fp32 adapters) for lora and qlora, as peft users run them")
    fp8: Fp8Recipe = Field(
        default=Fp8Recipe.NONE, description="fp8 matmuls in the transformer blocks' linears (torchao Float8Linear, "
        "eager): 'tensorwise' or 'rowwise' scaling; under engine='megatron' Transformer Engine's: 'delayed' or "
        "'tensorwise' (current scaling); precision='fp8' means bf16-true with fp8='tensorwise'")
    fp8_all_gather: bool = Field(
        default=False, description="FSDP2 all-gathers the fp8-converted weights in fp8 (torchao's "
        "enable_fsdp_float8_all_gather, tensorwise only, as torchtitan's float8 option turns on)")
    optimizer: OptimizerName = OptimizerName.ADAMW
    optimizer_impl: OptimizerImpl | None = Field(
        default=None, description="None: the device's PyTorch default (cuda: foreach, cpu: for-loop)"
    )
    adafactor: AdafactorImpl = Field(
        default=AdafactorImpl.TORCH, description="optimizer='adafactor': 'torch' (torch.optim.Adafactor) or "
        "'transformers' (transformers.optimization.Adafactor, what the HF Trainer's optim='adafactor' builds)")
    checkpointing: Checkpointing = Checkpointing.NONE
    attention: Attention = Attention.SDPA
    dropout: float | None = Field(default=None, ge=0.0, lt=1.0, description="None: the model config's rates")
    device: Device = Device.CUDA
    method: Method = Method.FULL
    lora_rank: int = Field(default=16, ge=1, le=1 << 16)
    lora_alpha: float = Field(default=32.0, gt=0.0)
    lora_targets: str = Field(default="qv", min_length=1,
                              description="'qv', 'all-linear', comma-separated module names or a list of them")
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    lora_dtype: AdapterDtype = Field(
        default=AdapterDtype.FP32, description="adapter dtype: 'fp32' (peft's default since 0.12), 'base' (the model's "
        "dtype: litgpt, torchtune) or 'weight' (the adapted weight's if floating, else fp32: peft < 0.12 or "
        "autocast_adapter_dtype=False)")
    qlora_quant_storage: QuantStorage = Field(
        default=QuantStorage.UINT8, description="QLoRA: the dtype of the packed 4-bit weights' storage "
        "(bnb_4bit_quant_storage): 'uint8' (bitsandbytes' default) or 'base' (the model's dtype, what FSDP-QLoRA sets)")
    qlora_double_quant: bool = Field(
        default=True, description="QLoRA: quantize the NF4 block scales again (bnb_4bit_use_double_quant)")
    first_step: bool = Field(
        default=False,
        description="the very first step: optimizer state does not exist yet and is created inside step()",
    )
    loss_impl: LossImpl = Field(
        default=LossImpl.STANDARD,
        description="the head's loss: 'standard' (transformers'), 'chunked' (torchtune's), 'liger' (Liger's fused "
        "linear cross-entropy) or 'cce' (Apple's Cut Cross-Entropy)")
    loss_chunks: int = Field(default=8, ge=1, le=4096,
                             description="loss_impl='chunked': chunks of tokens (torchtune's num_output_chunks)")
    alloc_conf: str = Field(
        default="", max_length=1000,
        description="PYTORCH_CUDA_ALLOC_CONF for the caching allocator's replay, e.g. 'expandable_segments:True'")
    stack: str = Field(
        default="", max_length=1000,
        description="the training stack: NAME[@VERSION] (trainmem_nb.list_stacks(): 'hf-trainer@4.38' is transformers "
        "4.38), the path of a stack file, or '' for today's versions; it sets the options below it that are not given")
    versions: str = Field(
        default="", max_length=1000,
        description="component versions, 'torch=1.13,cuda=11.6' or a dict (torch, transformers, bitsandbytes, peft, cuda)")
    zero_grad_set_to_none: bool = Field(
        default=True, description="optimizer.zero_grad(set_to_none=...): False zeroes the gradients in place and keeps "
        "them between steps (torch < 2.0's default)")
    bnb_saves_input: bool = Field(
        default=False, description="QLoRA: bitsandbytes' MatMul4Bit saves its input for backward (bitsandbytes < 0.43.2)")
    qlora_head: bool = Field(
        default=False, description="QLoRA quantizes the output head too (Lightning Fabric's BitsandbytesPrecision "
        "replaces every nn.Linear, as litgpt runs it; transformers keeps lm_head in 16 bits); a tied head stays 16-bit")
    untied_head: bool = Field(
        default=False, description="the training code builds its own output head where the checkpoint ties it to the "
        "embedding (litgpt's GPT: lm_head an nn.Linear of its own, given a copy of the embedding): two weights")
    bnb_fp16_state: bool = Field(
        default=False, description="QLoRA: the NF4 weights were quantized from an fp16 copy (Fabric's BitsandbytesPrecision), "
        "so each dequantize_4bit makes an fp16 weight that MatMul4Bit then copies to the compute dtype")
    softmax_saves_input: bool = Field(
        default=False, description="softmax and log_softmax keep their input for backward besides their result "
        "(torch < 1.11)")
    causal_lm_loss: CausalLMLoss = Field(
        default=CausalLMLoss.LABELS_SHIFTED,
        description="the standard loss as the transformers version computes it: 'labels-shifted' (4.49+), "
        "'logits-shifted' (4.46-4.48), 'model-upcast' (4.31-4.45: the model returns fp32 logits), 'no-upcast' (<= 4.30)")
    loop_keeps_outputs: bool = Field(
        default=False, description="the training loop keeps the model's output (its logits) until its next forward "
        "returns (`outputs = model(**batch)` in accelerate's examples, litgpt's `logits = model(...)`); the HF Trainer "
        "keeps only the loss")
    cuda_lazy_loading: bool = Field(
        default=True, description="CUDA_MODULE_LOADING=LAZY (CUDA >= 11.7): kernels load when first used; False: every "
        "kernel of the libraries loads with the CUDA context")
    fsdp_version: int = Field(
        default=2, ge=1, le=2, description="engine='fsdp': 2 is fully_shard (per-parameter shards: torchtitan, "
        "torchtune), 1 is FullyShardedDataParallel (a FlatParameter per wrapped module: Lightning Fabric, lit-gpt, "
        "accelerate's default)")
    use_orig_params: bool = Field(
        default=True, description="fsdp_version=1: FullyShardedDataParallel(use_orig_params=...); True puts a unit's "
        "frozen and trained parameters in one FlatParameter, which then gets a gradient for all of them")
    sync_module_states: bool = Field(
        default=False, description="fsdp_version=1: FullyShardedDataParallel(sync_module_states=...); True broadcasts "
        "each unit's parameters from rank 0 while wrapping it (in buckets of up to 250 MiB, two in flight), which "
        "loading's peak and cache show")

    #: The options a stack may set (`trainmem_nb.spec.stack`); the others are the user's alone.
    STACK_OPTIONS: ClassVar[frozenset[str]] = frozenset({
        "loss_impl", "loss_chunks", "dropout", "lora_dropout", "zero_grad_set_to_none", "bnb_saves_input", "qlora_head",
        "bnb_fp16_state", "untied_head",
        "causal_lm_loss", "loop_keeps_outputs", "cuda_lazy_loading", "lora_dtype", "fsdp_version", "use_orig_params",
        "sync_module_states", "adafactor", "softmax_saves_input", "qlora_quant_storage", "optimizer_impl"})

    @model_validator(mode="before")
    @classmethod
    def _parse_choices(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        if "fp8" in data and data["fp8"] is None:  # None: the default, as for precision
            data.pop("fp8")
        precision = data.get("precision")
        if isinstance(precision, str) and precision.strip().lower() == "fp8":
            # precision='fp8' is torchao's README setup: a bf16 model whose block linears compute in fp8
            data["precision"] = Precision.BF16_TRUE
            if "fp8" not in data:
                data["fp8"] = Fp8Recipe.TENSORWISE
            elif Fp8Recipe.parse(data["fp8"], "fp8") is Fp8Recipe.NONE:
                raise SpecError("precision='fp8' with fp8='none' contradict each other: precision='fp8' means a bf16 "
                                "model with fp8 matmuls; drop fp8 (tensorwise), give fp8='rowwise', or use "
                                "precision='bf16-true' without fp8")
        if data.get("precision") is None:  # the default follows the method: see _default_precision
            data.pop("precision", None)
        # Hugging Face's gradient_checkpointing=True recomputes whole layers: True means full, False none
        if isinstance(data.get("checkpointing"), bool):
            data["checkpointing"] = Checkpointing.FULL if data["checkpointing"] else Checkpointing.NONE
        for key, enum in (
            ("precision", Precision), ("optimizer", OptimizerName), ("checkpointing", Checkpointing),
            ("attention", Attention), ("device", Device), ("method", Method), ("lora_dtype", AdapterDtype),
            ("qlora_quant_storage", QuantStorage),
            ("loss_impl", LossImpl), ("causal_lm_loss", CausalLMLoss), ("fp8", Fp8Recipe), ("adafactor", AdafactorImpl),
        ):
            if key in data and data[key] is not None:
                data[key] = enum.parse(data[key], key)
        if isinstance(data.get("versions"), Mapping):  # {"torch": "1.13"} -> the canonical 'torch=1.13'
            data["versions"] = ",".join(f"{k}={v}" for k, v in parse_versions(data["versions"]).items())
        if data.get("optimizer_impl") is not None:
            data["optimizer_impl"] = OptimizerImpl.parse(data["optimizer_impl"], "optimizer_impl")
        targets = data.get("lora_targets")
        if isinstance(targets, (list, tuple)):  # peft's target_modules=['q_proj', 'v_proj']
            if not targets or not all(isinstance(n, str) and n.strip() for n in targets):
                raise SpecError(f"lora_targets={list(targets)!r} must name modules: 'qv', 'all-linear', "
                                "a comma-separated string or a list of module names such as ['q_proj', 'v_proj']")
            data["lora_targets"] = ",".join(n.strip() for n in targets)
        elif targets is not None and not isinstance(targets, str):
            raise SpecError(f"lora_targets={targets!r} must be 'qv', 'all-linear', a comma-separated string or a "
                            "list of module names such as ['q_proj', 'v_proj']")
        return data

    @model_validator(mode="after")
    def _default_precision(self) -> TrainingSpec:
        # LoRA and QLoRA users load the frozen base in 16 bits (peft: from_pretrained(torch_dtype=bfloat16);
        # QLoRA: bnb_4bit_compute_dtype=bfloat16), with fp32 adapters (lora_dtype='fp32'): without an
        # explicit precision they get bf16-true, not an fp32 base under autocast. Left out of
        # model_fields_set, so a rebuilt spec follows its new method.
        if "precision" not in self.model_fields_set and self.method is not Method.FULL:
            object.__setattr__(self, "precision", Precision.BF16_TRUE)
        return self

    @model_validator(mode="after")
    def _check_alloc_conf(self) -> TrainingSpec:
        if not self.alloc_conf:  # the default configuration: nothing to parse
            return self
        from .alloc_conf import parse_alloc_conf

        try:
            parse_alloc_conf(self.alloc_conf or None)
        except ValueError as exc:
            raise SpecError(f"alloc_conf={self.alloc_conf!r}: {exc} (PYTORCH_CUDA_ALLOC_CONF syntax, e.g. "
                            "'expandable_segments:True,max_split_size_mb:128')") from None
        return self

    @model_validator(mode="after")
    def _apply_stack(self) -> TrainingSpec:
        # like the precision's default: what the stack sets stays out of model_fields_set, so a spec
        # rebuilt with another stack follows the new one
        if self.versions:
            object.__setattr__(self, "versions", ",".join(f"{k}={v}" for k, v in parse_versions(self.versions).items()))
        for key, applied in self.resolved_stack.options.items():
            if key not in self.STACK_OPTIONS:
                raise SpecError(f"stack {self.stack!r} sets {key!r}, which a stack cannot set; it may set "
                                f"{', '.join(sorted(self.STACK_OPTIONS))}")
            if key == "optimizer_impl" and self.optimizer not in STACK_IMPL_OPTIMIZERS:
                continue  # a Trainer's default implementation is its AdamW's: another optimizer keeps its own
            if key not in self.model_fields_set:
                try:
                    value = _field_adapter(key).validate_python(applied.value)
                except ValidationError as exc:
                    raise SpecError(f"stack {self.stack!r} sets {key}={applied.value!r}: "
                                    f"{exc.errors()[0]['msg']}") from None
                object.__setattr__(self, key, value)
        return self

    @property
    def resolved_stack(self) -> Stack:
        """The stack and component versions this step assumes, and the options they set (with sources)."""
        return resolve_stack(self.stack, self.versions)

    def stack_report(self) -> dict[str, Any]:
        """The stack this step assumes, for the JSON contract: its versions, the options it set (each with
        its source, and whether an option given here overrode it) and its mechanisms that are not modelled."""
        return self.resolved_stack.to_dict(frozenset(self.model_fields_set))

    @property
    def grads_persist(self) -> bool:
        """Every ``.grad`` exists when the costliest micro-step starts (a later micro-step of gradient
        accumulation, or ``zero_grad(set_to_none=False)`` keeping them): new gradients are added in place."""
        return self.grad_accum > 1 or not self.zero_grad_set_to_none

    @model_validator(mode="after")
    def _check_combinations(self) -> TrainingSpec:
        default_chunks = TrainingSpec.model_fields["loss_chunks"].default
        if self.loss_chunks != default_chunks and self.loss_impl is not LossImpl.CHUNKED:
            raise SpecError(f"loss_chunks={self.loss_chunks} applies to loss_impl='chunked' only (got "
                            f"loss_impl={self.loss_impl.value!r}); drop loss_chunks or set loss_impl='chunked'")
        if self.loss_impl in (LossImpl.LIGER, LossImpl.CCE) and self.device is Device.CPU:
            raise SpecError(f"loss_impl={self.loss_impl.value!r} is a Triton kernel: it runs on CUDA only; use "
                            "device='cuda', or loss_impl='standard' or 'chunked' on the CPU")
        if self.fp8 is not Fp8Recipe.NONE:
            self._check_fp8()
        elif self.fp8_all_gather:
            raise SpecError("fp8_all_gather=True needs fp8 training: set fp8='tensorwise' (or precision='fp8')")
        if self.optimizer_impl is OptimizerImpl.FUSED and self.optimizer not in (
            OptimizerName.ADAMW, OptimizerName.ADAM, OptimizerName.SGD, OptimizerName.SGD_MOMENTUM,
        ):
            raise SpecError(
                f"optimizer_impl='fused' exists only for adam, adamw, sgd and sgd-momentum in PyTorch "
                f"(got optimizer={self.optimizer.value!r}); use 'foreach' or 'for-loop'"
            )
        if self.adafactor is AdafactorImpl.TRANSFORMERS and self.optimizer is OptimizerName.ADAFACTOR \
                and self.optimizer_impl is not None:
            raise SpecError(f"optimizer_impl={self.optimizer_impl.value!r} with adafactor='transformers': "
                            "transformers' Adafactor has one implementation, a loop over the parameters; drop "
                            "optimizer_impl, or use adafactor='torch' (torch.optim.Adafactor)")
        if "adafactor" in self.model_fields_set and self.adafactor is not AdafactorImpl.TORCH \
                and self.optimizer is not OptimizerName.ADAFACTOR:
            raise SpecError(f"adafactor={self.adafactor.value!r} says which Adafactor optimizer='adafactor' is (got "
                            f"optimizer={self.optimizer.value!r}); drop adafactor or set optimizer='adafactor'")
        return self

    def _check_fp8(self) -> None:
        """fp8 as modelled: torchao's Float8Linear in eager mode over a bf16 model, every parameter trained."""
        how = f"fp8={self.fp8.value!r}"
        if self.precision not in (Precision.BF16_TRUE, Precision.BF16_MIXED):
            raise SpecError(f"{how} with precision={self.precision.value!r} is not modelled: fp8 training is modelled over "
                            "a bf16 model (torchao's README setup), or over fp32 weights that FSDP2 gathers in bf16 "
                            "(torchtitan's); use precision='bf16-true' (or precision='fp8'), or 'bf16-mixed' with FSDP2")
        if self.method is not Method.FULL:
            raise SpecError(f"{how} with method={self.method.value!r} is not modelled (peft's LoRA layers wrap the "
                            "linears torchao would convert); use method='full', or LoRA without fp8 (precision "
                            "'bf16-true', fp8='none')")
        if self.fp8_all_gather and self.fp8 is not Fp8Recipe.TENSORWISE:
            raise SpecError(f"fp8_all_gather=True with {how}: torchao all-gathers fp8 weights with tensorwise "
                            "scales only (Float8LinearConfig asserts it); use fp8='tensorwise'")
        if self.device is Device.CUDA and self.tokens % 16:
            # the weight gradient's matmul contracts over the tokens: on CUDA torch._scaled_mm needs every
            # dimension a multiple of 16 (torch/_meta_registrations.py, meta_scaled_mm)
            raise SpecError(f"{how} with micro_batch x seq_len = {self.tokens} tokens: torch._scaled_mm on CUDA needs "
                            "the tokens of a micro-batch to be a multiple of 16 (the weight gradient's matmul runs over "
                            "them); pad seq_len to a multiple of 16")
        if self.checkpointing in (Checkpointing.SELECTIVE, Checkpointing.SELECTIVE_OP):
            raise SpecError(f"{how} with checkpointing={self.checkpointing.value!r} is not modelled (the policies "
                            "name aten.mm, and fp8 matmuls run torch._scaled_mm); use checkpointing='none' or 'full'")

    @property
    def tokens(self) -> int:
        """Tokens in one micro-batch: micro_batch * seq_len."""
        return self.micro_batch * self.seq_len

    @property
    def resolved_optimizer_impl(self) -> OptimizerImpl:
        """The implementation PyTorch would pick: the explicit one, else the device's default."""
        if self.optimizer_impl is not None:
            return self.optimizer_impl
        return OptimizerImpl.FOREACH if self.device is Device.CUDA else OptimizerImpl.FOR_LOOP

    @property
    def mixed(self) -> bool:
        """True for autocast recipes (fp32 master weights, 16-bit compute)."""
        return self.precision in (Precision.BF16_MIXED, Precision.FP16_MIXED)

    @property
    def param_bytes(self) -> int:
        """Bytes per element of the stored weights (and their gradients)."""
        return 2 if self.precision in (Precision.BF16_TRUE, Precision.FP16_TRUE) else 4

    @property
    def adapter_bytes(self) -> int:
        """Bytes per element of LoRA adapters (and their gradients and optimizer states' dtype)."""
        # peft moves a new adapter to its base weight's dtype only when that dtype is floating (peft v0.10.0
        # src/peft/tuners/lora/layer.py:119 `if weight.dtype.is_floating_point or weight.dtype.is_complex:`; the
        # same test in v0.20.0 tuners_utils.py:1749): on uint8 4-bit storage the adapter stays nn.Linear's fp32
        if self.lora_dtype is AdapterDtype.FP32 or (self.lora_dtype is AdapterDtype.WEIGHT and self.method is Method.QLORA
                                                     and self.qlora_quant_storage is QuantStorage.UINT8):
            return 4
        return self.param_bytes

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of matmul outputs: 2 for any 16-bit recipe, 4 for fp32."""
        return 4 if self.precision is Precision.FP32 else 2


@lru_cache(maxsize=1)
def _training_fields() -> frozenset[str]:
    """`TrainingSpec`'s field names (read once: every estimate checks its options against them)."""
    return frozenset(TrainingSpec.model_fields)


def build_training(training: TrainingSpec | Mapping[str, Any] | None = None, **options: Any) -> TrainingSpec:
    """A validated `TrainingSpec` from a spec, a dict and/or keyword options (keywords win)."""
    if isinstance(training, TrainingSpec) and not options:
        return training
    data: dict[str, Any] = {}
    if isinstance(training, TrainingSpec):  # what was set: a default that follows another field stays unset
        data.update({k: getattr(training, k) for k in training.model_fields_set})
    elif isinstance(training, Mapping):
        data.update(training)
    elif training is not None:
        raise SpecError(f"training must be a TrainingSpec or a dict, got {type(training).__name__}")
    data.update({k: v for k, v in options.items() if v is not None or k in ("dropout",)})
    given = {k: data.pop(k) for k in COMPONENTS if k in data}  # torch="1.13": one component's version
    if given:
        data["versions"] = {**parse_versions(data.get("versions")), **given}
    unknown = sorted(set(data) - _training_fields())
    if unknown:
        valid = sorted(TrainingSpec.model_fields)
        raise SpecError(
            f"unknown training option {unknown[0]!r}{did_you_mean(unknown[0], valid)}; valid options: {', '.join(valid)}"
        )
    return _validate(TrainingSpec, data)


@cache
def _field_adapter(key: str) -> TypeAdapter[Any]:
    """A validator of one `TrainingSpec` field's values (a stack's options go through it); built once, as
    building one costs more than an estimate."""
    field = TrainingSpec.model_fields[key]
    kind: Any = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
    return TypeAdapter(kind)

