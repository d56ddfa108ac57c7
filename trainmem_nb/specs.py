"""Validated, frozen descriptions of a model and a training setup.

Everything the estimator reads comes through these specs: a model architecture (`ModelSpec`, from a
preset, a Hugging Face ``config.json`` or a bare parameter count) and one training step's setup
(`TrainingSpec`). pydantic checks every field; an error names the field, the bad value and what would
be valid. Only the standard library and pydantic are imported here.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "CHECKPOINTING_HELP",
    "AdapterDtype",
    "Attention",
    "Checkpointing",
    "Device",
    "Family",
    "Method",
    "ModelSpec",
    "OptimizerImpl",
    "OptimizerName",
    "Precision",
    "SpecError",
    "TrainingSpec",
    "did_you_mean",
]


class SpecError(ValueError):
    """A spec or option is invalid; the message says which field, the value and what is valid."""


def did_you_mean(value: str, choices: list[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(str(value).lower(), [c.lower() for c in choices], n=1, cutoff=0.5)
    if not close:
        return ""
    original = next(c for c in choices if c.lower() == close[0])
    return f" (did you mean {original!r}?)"


class _Choice(str, Enum):
    """A string enum whose parse error lists the valid values and the closest match."""

    @classmethod
    def parse(cls, value: Any, field: str) -> Any:
        if isinstance(value, cls):
            return value
        text = str(value).strip().lower().replace("_", "-")
        for member in cls:
            if text in (member.value, member.name.lower().replace("_", "-")):
                return member
        valid = [m.value for m in cls]
        raise SpecError(
            f"{field}={value!r} is not supported{did_you_mean(str(value), valid)}; "
            f"valid values: {', '.join(valid)}"
        )


class Family(_Choice):
    """Model families, each as Hugging Face transformers implements it (the *ForCausalLM class, or
    BertForMaskedLM for bert)."""

    LLAMA = "llama"  #: RMSNorm, SwiGLU, RoPE, GQA; also Llama 2/3, TinyLlama
    MISTRAL = "mistral"  #: llama layout with a sliding attention window
    QWEN2 = "qwen2"  #: llama layout with q/k/v biases
    GEMMA = "gemma"  #: GeGLU, (1+w) RMSNorm computed in fp32, scaled embeddings, head_dim 256
    PHI3 = "phi3"  #: fused qkv_proj and gate_up_proj, residual dropout
    MIXTRAL = "mixtral"  #: llama attention, top-k routed mixture-of-experts MLP
    GPT2 = "gpt2"  #: LayerNorm, Conv1D fused c_attn, gelu_new, learned positions, tied head
    GPT_NEOX = "gpt_neox"  #: Pythia; fused qkv, partial rotary, parallel residual
    OPT = "opt"  #: LayerNorm, ReLU MLP, learned positions (offset 2), tied head
    BERT = "bert"  #: encoder, post-LayerNorm, masked-LM head tied to the word embeddings


class Precision(_Choice):
    """How weights, gradients, optimizer states and activations are stored for one step."""

    FP32 = "fp32"  #: everything fp32
    BF16_MIXED = "bf16-mixed"  #: fp32 weights/grads/states, autocast bf16 compute (HF Trainer bf16=True)
    FP16_MIXED = "fp16-mixed"  #: as bf16-mixed with fp16 autocast (and a loss scaler)
    BF16_TRUE = "bf16-true"  #: weights, grads, states and activations all bf16
    FP16_TRUE = "fp16-true"  #: weights, grads, states and activations all fp16


class OptimizerName(_Choice):
    """Optimizers; their state sizes and step temporaries live in `trainmem_nb.optimizers`."""

    ADAMW = "adamw"  #: torch.optim.AdamW: exp_avg + exp_avg_sq + step per parameter
    ADAM = "adam"  #: torch.optim.Adam: same state as AdamW
    SGD = "sgd"  #: torch.optim.SGD without momentum: no state
    SGD_MOMENTUM = "sgd-momentum"  #: torch.optim.SGD(momentum=0.9): one momentum buffer
    ADAFACTOR = "adafactor"  #: torch.optim.Adafactor: factored second moment (row + column)
    LION = "lion"  #: Lion: one momentum buffer
    ADAMW_8BIT = "adamw-8bit"  #: bitsandbytes AdamW8bit: two uint8 states + block-wise absmax
    PAGED_ADAMW = "paged-adamw"  #: bitsandbytes PagedAdamW (32-bit states, paged to host under pressure)
    NONE = "none"  #: forward and backward only (no optimizer step)


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

    FP32 = "fp32"  #: peft's default on a 16-bit base (``autocast_adapter_dtype=True``)
    BASE = "base"  #: the base weights' dtype (``autocast_adapter_dtype=False``): bf16 under bf16-true


_FROZEN = ConfigDict(frozen=True, extra="forbid", validate_default=True)

#: Structural defaults of each family, as its Hugging Face modeling file builds the model.
FAMILY_DEFAULTS: dict[Family, dict[str, Any]] = {
    Family.LLAMA: {"norm": "rmsnorm", "mlp": "gated", "activation": "silu", "positions": "rotary"},
    Family.MISTRAL: {"norm": "rmsnorm", "mlp": "gated", "activation": "silu", "positions": "rotary"},
    Family.QWEN2: {"norm": "rmsnorm", "mlp": "gated", "activation": "silu", "positions": "rotary", "qkv_bias": True},
    Family.GEMMA: {
        "norm": "rmsnorm", "mlp": "gated", "activation": "gelu_pytorch_tanh", "positions": "rotary",
        "tie_embeddings": True,
    },
    Family.PHI3: {
        "norm": "rmsnorm", "mlp": "gated", "activation": "silu", "positions": "rotary",
        "fused_qkv": True,
    },
    Family.MIXTRAL: {
        "norm": "rmsnorm", "mlp": "gated", "activation": "silu", "positions": "rotary",
        "n_experts": 8, "experts_top_k": 2,
    },
    Family.GPT2: {
        "norm": "layernorm", "mlp": "dense", "activation": "gelu_new", "positions": "learned",
        "fused_qkv": True, "qkv_bias": True, "out_bias": True, "mlp_bias": True, "norm_bias": True,
        "tie_embeddings": True,
    },
    Family.GPT_NEOX: {
        "norm": "layernorm", "mlp": "dense", "activation": "gelu", "positions": "rotary",
        "rotary_pct": 0.25, "fused_qkv": True, "qkv_bias": True, "out_bias": True, "mlp_bias": True,
        "norm_bias": True, "parallel_residual": True,
    },
    Family.OPT: {
        "norm": "layernorm", "mlp": "dense", "activation": "relu", "positions": "learned",
        "qkv_bias": True, "out_bias": True, "mlp_bias": True, "norm_bias": True, "tie_embeddings": True,
    },
    Family.BERT: {
        "norm": "layernorm", "mlp": "dense", "activation": "gelu", "positions": "learned",
        "qkv_bias": True, "out_bias": True, "mlp_bias": True, "norm_bias": True, "tie_embeddings": True,
        "max_positions": 512,
    },
}

_ACTIVATIONS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")

# Upper bounds that catch typos (a hidden size of 4e9) before they become absurd numbers.
_MAX_DIM = 1 << 20
_MAX_LAYERS = 10_000
_MAX_VOCAB = 1 << 24


class SpecModel(BaseModel):
    """Base of every spec: pydantic validation whose errors surface as one clear `SpecError`, whether
    the spec is built with ``Spec(...)`` or ``Spec.model_validate(...)``."""

    def __init__(self, **data: Any) -> None:
        from pydantic import ValidationError

        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise SpecError(format_validation_error(exc)) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Any:
        """`BaseModel.model_validate`, raising `SpecError`."""
        from pydantic import ValidationError

        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise SpecError(format_validation_error(exc)) from None


class ModelSpec(SpecModel):
    """A transformer's shape and structure: what decides its parameters and saved activations.

    Build one from a preset (`trainmem_nb.presets.get_model`), a Hugging Face config
    (`ModelSpec.from_hf_config`), a parameter count (`ModelSpec.from_params`), or directly; family
    defaults (norm, MLP type, biases, positions...) are filled in from `FAMILY_DEFAULTS`.

    >>> m = ModelSpec(family="llama", n_layers=2, hidden=256, n_heads=4, ffn=512, vocab=1000)
    >>> m.n_kv_heads, m.head_dim, m.norm
    (4, 64, 'rmsnorm')
    """

    model_config = _FROZEN

    name: str = "custom"
    family: Family
    n_layers: int = Field(ge=1, le=_MAX_LAYERS)
    hidden: int = Field(ge=1, le=_MAX_DIM)
    n_heads: int = Field(ge=1, le=_MAX_DIM)
    n_kv_heads: int = Field(default=0, ge=0, le=_MAX_DIM, description="0 means n_heads (no GQA)")
    head_dim: int = Field(default=0, ge=0, le=_MAX_DIM, description="0 means hidden // n_heads")
    ffn: int = Field(ge=1, le=_MAX_DIM * 8, description="MLP intermediate size (per expert for MoE)")
    vocab: int = Field(ge=1, le=_MAX_VOCAB)
    max_positions: int = Field(default=1 << 20, ge=1, le=1 << 26)
    tie_embeddings: bool = False
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_bias: bool = False
    mlp: Literal["gated", "dense"] = "gated"
    activation: Literal["silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu"] = "silu"
    positions: Literal["rotary", "learned"] = "rotary"
    rotary_pct: float = Field(default=1.0, gt=0.0, le=1.0)
    fused_qkv: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    parallel_residual: bool = False
    n_experts: int = Field(default=0, ge=0, le=4096)
    experts_top_k: int = Field(default=0, ge=0, le=4096)
    attn_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    hidden_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    embd_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    sliding_window: int = Field(default=0, ge=0, description="0 means none")
    # Family-specific details (used only by the family that has them).
    word_embed_proj_dim: int = Field(default=0, ge=0, le=_MAX_DIM, description="OPT: 0 means hidden")
    pre_norm: bool = Field(default=True, description="OPT do_layer_norm_before; BERT is post-norm")
    type_vocab: int = Field(default=2, ge=0, le=1024, description="BERT token-type embeddings")

    @model_validator(mode="before")
    @classmethod
    def _fill_family_defaults(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        if "family" not in data:
            raise SpecError(f"family is required; valid values: {', '.join(f.value for f in Family)}")
        family = Family.parse(data["family"], "family")
        data["family"] = family
        for key, value in FAMILY_DEFAULTS[family].items():
            data.setdefault(key, value)
        if family is Family.BERT:
            data.setdefault("pre_norm", False)
        act = data.get("activation")
        if isinstance(act, str) and act not in _ACTIVATIONS:
            raise SpecError(
                f"activation={act!r} is not supported{did_you_mean(act, list(_ACTIVATIONS))}; "
                f"valid values: {', '.join(_ACTIVATIONS)}"
            )
        return data

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelSpec:
        if not self.n_kv_heads:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if not self.head_dim:
            if self.hidden % self.n_heads:
                raise SpecError(
                    f"n_heads={self.n_heads} does not divide hidden={self.hidden}; choose n_heads from "
                    f"{_divisors_near(self.hidden, self.n_heads)} or give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise SpecError(
                f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}; choose n_kv_heads "
                f"from {_divisors_near(self.n_heads, self.n_kv_heads)}"
            )
        if self.family is Family.MIXTRAL or self.n_experts:
            if self.n_experts < 1 or self.experts_top_k < 1:
                raise SpecError(
                    f"a mixture-of-experts model needs n_experts >= 1 and experts_top_k >= 1 "
                    f"(got n_experts={self.n_experts}, experts_top_k={self.experts_top_k})"
                )
            if self.experts_top_k > self.n_experts:
                raise SpecError(
                    f"experts_top_k={self.experts_top_k} exceeds n_experts={self.n_experts}; "
                    f"choose experts_top_k between 1 and {self.n_experts}"
                )
            if self.family is not Family.MIXTRAL:
                raise SpecError(
                    f"n_experts={self.n_experts} is only supported for family 'mixtral' (got {self.family.value!r})"
                )
        if self.family in (Family.GPT2, Family.GPT_NEOX, Family.OPT, Family.BERT) and self.n_kv_heads != self.n_heads:
            raise SpecError(
                f"family {self.family.value!r} has no grouped-query attention: n_kv_heads must equal "
                f"n_heads={self.n_heads} (got {self.n_kv_heads})"
            )
        if self.positions == "rotary" and self.rotary_dims < 2:
            raise SpecError(
                f"rotary_pct={self.rotary_pct} leaves fewer than 2 rotary dimensions of head_dim={self.head_dim}"
            )
        return self

    # -- derived shapes -------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        """Width of the query projection: n_heads * head_dim."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of each of the key and value projections: n_kv_heads * head_dim."""
        return self.n_kv_heads * self.head_dim

    @property
    def rotary_dims(self) -> int:
        """Dimensions of each head that get rotary embeddings."""
        return int(self.head_dim * self.rotary_pct)

    @property
    def is_moe(self) -> bool:
        """True for mixture-of-experts models."""
        return self.n_experts > 0

    @property
    def is_encoder(self) -> bool:
        """True for bidirectional encoders trained with masked-LM (bert)."""
        return self.family is Family.BERT

    @property
    def n_params(self) -> int:
        """Total parameters, tied weights counted once (as ``sum(p.numel())`` in Hugging Face)."""
        from .params import count_params

        return count_params(self)

    # -- constructors ---------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, config: str | Path | Mapping[str, Any], name: str | None = None) -> ModelSpec:
        """Read a Hugging Face ``config.json`` (a path or a dict) of a supported family.

        Nothing is downloaded. Unknown ``model_type`` values get an error naming the supported ones.
        """
        from .hf_config import spec_kwargs_from_hf

        if isinstance(config, (str, Path)):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            try:
                text = path.read_text()
            except OSError as exc:
                raise SpecError(f"hf_config={str(config)!r} cannot be read: {exc.strerror or exc}") from None
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise SpecError(f"hf_config={str(config)!r} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
            default_name = path.parent.name or path.stem
        elif isinstance(config, Mapping):
            data = dict(config)
            default_name = str(data.get("_name_or_path") or "custom")
        else:
            raise SpecError(f"hf_config must be a path or a dict, got {type(config).__name__}")
        if not isinstance(data, dict):
            raise SpecError(f"hf_config must hold a JSON object, got {type(data).__name__}")
        kwargs = spec_kwargs_from_hf(data)
        kwargs["name"] = name or default_name or "custom"
        return _validate(cls, kwargs)

    @classmethod
    def from_params(cls, n_params: int | float, family: str | Family = "llama", name: str | None = None) -> ModelSpec:
        """A plausible shape for a bare parameter count, scaled like published models of the family.

        The shape follows Llama's aspect ratios (hidden ~ 128 per layer-ish, ffn ~ 8/3 hidden,
        vocab 32000); its parameter count is within a few percent of the one asked for.
        """
        from .hf_config import shape_for_params

        return _validate(cls, shape_for_params(n_params, family, name))


def _divisors_near(n: int, near: int) -> str:
    divs = [d for d in range(1, min(n, 4096) + 1) if n % d == 0]
    divs.sort(key=lambda d: (abs(d - near), d))
    return ", ".join(str(d) for d in sorted(divs[:6]))


def _validate(cls: type[BaseModel], data: Mapping[str, Any]) -> Any:
    """`model_validate` that turns pydantic's multi-line report into one clear `SpecError`."""
    from pydantic import ValidationError

    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc)) from None


def format_validation_error(exc: Any) -> str:
    """One line per problem: ``field=value: what is wrong`` (pydantic's own text, without its URL)."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err.get("loc", ())) or "spec"
        msg = str(err.get("msg", "invalid"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if "input" in err and loc != "spec" and not isinstance(err["input"], (dict, list)):
            parts.append(f"{loc}={err['input']!r}: {msg}")
        else:
            parts.append(msg if loc == "spec" else f"{loc}: {msg}")
    return "; ".join(parts)


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
    precision: Precision = Precision.BF16_MIXED
    optimizer: OptimizerName = OptimizerName.ADAMW
    optimizer_impl: OptimizerImpl | None = Field(
        default=None, description="None: the device's PyTorch default (cuda: foreach, cpu: for-loop)"
    )
    checkpointing: Checkpointing = Checkpointing.NONE
    attention: Attention = Attention.SDPA
    dropout: float | None = Field(default=None, ge=0.0, lt=1.0, description="None: the model config's rates")
    device: Device = Device.CUDA
    method: Method = Method.FULL
    lora_rank: int = Field(default=16, ge=1, le=1 << 16)
    lora_alpha: float = Field(default=32.0, gt=0.0)
    lora_targets: str = Field(default="qv", description="'qv', 'all-linear' or comma-separated module names")
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    lora_dtype: AdapterDtype = Field(
        default=AdapterDtype.FP32, description="adapter dtype: 'fp32' (peft's default) or 'base' (the base weights')")
    qlora_double_quant: bool = Field(
        default=True, description="QLoRA: quantize the NF4 block scales again (bnb_4bit_use_double_quant)")
    first_step: bool = Field(
        default=False,
        description="the very first step: optimizer state does not exist yet and is created inside step()",
    )

    @model_validator(mode="before")
    @classmethod
    def _parse_choices(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        data = dict(data)
        for key, enum in (
            ("precision", Precision), ("optimizer", OptimizerName), ("checkpointing", Checkpointing),
            ("attention", Attention), ("device", Device), ("method", Method), ("lora_dtype", AdapterDtype),
        ):
            if key in data and data[key] is not None:
                data[key] = enum.parse(data[key], key)
        if data.get("optimizer_impl") is not None:
            data["optimizer_impl"] = OptimizerImpl.parse(data["optimizer_impl"], "optimizer_impl")
        if data.get("checkpointing") is True:
            data["checkpointing"] = Checkpointing.FULL
        if data.get("checkpointing") is False:
            data["checkpointing"] = Checkpointing.NONE
        return data

    @model_validator(mode="after")
    def _check_combinations(self) -> TrainingSpec:
        if self.optimizer_impl is OptimizerImpl.FUSED and self.optimizer not in (
            OptimizerName.ADAMW, OptimizerName.ADAM, OptimizerName.SGD, OptimizerName.SGD_MOMENTUM,
        ):
            raise SpecError(
                f"optimizer_impl='fused' exists only for adam, adamw, sgd and sgd-momentum in PyTorch "
                f"(got optimizer={self.optimizer.value!r}); use 'foreach' or 'for-loop'"
            )
        return self

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
        return 4 if self.lora_dtype is AdapterDtype.FP32 else self.param_bytes

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of matmul outputs: 2 for any 16-bit recipe, 4 for fp32."""
        return 4 if self.precision is Precision.FP32 else 2


def build_training(training: TrainingSpec | Mapping[str, Any] | None = None, **options: Any) -> TrainingSpec:
    """A validated `TrainingSpec` from a spec, a dict and/or keyword options (keywords win)."""
    if isinstance(training, TrainingSpec) and not options:
        return training
    data: dict[str, Any] = {}
    if isinstance(training, TrainingSpec):
        data.update(training.model_dump(exclude_defaults=True))
    elif isinstance(training, Mapping):
        data.update(training)
    elif training is not None:
        raise SpecError(f"training must be a TrainingSpec or a dict, got {type(training).__name__}")
    data.update({k: v for k, v in options.items() if v is not None or k in ("dropout",)})
    unknown = sorted(set(data) - set(TrainingSpec.model_fields))
    if unknown:
        valid = sorted(TrainingSpec.model_fields)
        raise SpecError(
            f"unknown training option {unknown[0]!r}{did_you_mean(unknown[0], valid)}; valid options: {', '.join(valid)}"
        )
    return _validate(TrainingSpec, data)


def finite_number(value: Any, field: str) -> float:
    """Parse a number, rejecting NaN and infinities with a message naming the field."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise SpecError(f"{field}={value!r} is not a number") from None
    if not math.isfinite(number):
        raise SpecError(f"{field}={value!r} must be a finite number")
    return number
