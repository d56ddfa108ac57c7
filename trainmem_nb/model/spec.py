"""`ModelSpec`: a validated, frozen description of one transformer's shape and structure.

Build one from a preset (`trainmem_nb.model.presets.get_model`), a Hugging Face ``config.json``
(`ModelSpec.from_hf_config`), a parameter count (`ModelSpec.from_params`) or directly; pydantic checks
every field and an error names the field, the bad value and what would be valid.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from ..errors import SpecError, did_you_mean
from ..spec.base import _FROZEN, SpecModel, _validate
from .families import _ACTIVATIONS, FAMILY_DEFAULTS, Family

__all__ = ['ModelSpec']

# Upper bounds that catch typos (a hidden size of 4e9) before they become absurd numbers.
_MAX_DIM = 1 << 20
_MAX_LAYERS = 10_000
_MAX_VOCAB = 1 << 24


class ModelSpec(SpecModel):
    """A transformer's shape and structure: what decides its parameters and saved activations.

    Build one from a preset (`trainmem_nb.model.presets.get_model`), a Hugging Face config
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
        from ..errors import read_json
        from .hf_config import spec_kwargs_from_hf

        if isinstance(config, (str, Path)):
            if not str(config).strip():
                raise SpecError("hf_config='' names no file: give the path of a config.json (or its folder)")
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            data = read_json(path, "hf_config")
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
