"""`ModelSpec`: a validated, frozen description of one transformer's shape and structure.

Build one from a preset (`trainmem_nb.model.presets.get_model`), a Hugging Face ``config.json``
(`ModelSpec.from_hf_config`), a parameter count (`ModelSpec.from_params`) or directly; pydantic checks
every field and an error names the field, the bad value and what would be valid.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from ..errors import SpecError, did_you_mean
from ..spec.base import _FROZEN, SpecModel, _validate
from .families import ACTIVATIONS, BIAS_FIELDS, DESCRIPTIONS, Family
from .layers import LayerKind

__all__ = ['ModelSpec', 'VisionTower']

# Upper bounds that catch typos (a hidden size of 4e9) before they become absurd numbers.
_MAX_DIM = 1 << 20
_MAX_LAYERS = 10_000
_MAX_VOCAB = 1 << 24


class VisionTower(SpecModel):
    """The SigLIP vision tower of a multimodal Gemma 3 checkpoint (its ``vision_config``) and the projector into
    the language model. A text-only step never runs them: they hold memory as weights alone (`trainmem_nb.model.params.idle_weights`)."""

    model_config = _FROZEN

    hidden: int = Field(ge=1, le=_MAX_DIM, description="hidden_size")
    intermediate: int = Field(ge=1, le=_MAX_DIM * 8, description="intermediate_size")
    n_layers: int = Field(ge=1, le=_MAX_LAYERS, description="num_hidden_layers")
    n_heads: int = Field(default=12, ge=1, le=_MAX_DIM, description="num_attention_heads (SiglipVisionConfig's default)")
    image_size: int = Field(ge=1, le=1 << 16)
    patch_size: int = Field(ge=1, le=1 << 16)
    channels: int = Field(default=3, ge=1, le=64, description="num_channels")
    head: bool = Field(default=False, description="vision_use_head: an attention-pooling head")

    @model_validator(mode="after")
    def _check_heads(self) -> VisionTower:
        if self.hidden % self.n_heads:
            raise SpecError(f"n_heads={self.n_heads} does not divide its hidden={self.hidden} (SiglipAttention "
                            f"needs it); choose n_heads from {_divisors_near(self.hidden, self.n_heads)}")
        if self.patch_size > self.image_size:
            raise SpecError(f"patch_size={self.patch_size} is larger than its image_size={self.image_size}: the "
                            "patch embedding would have no positions; give patch_size <= image_size")
        return self

    @property
    def n_patches(self) -> int:
        """Positions of the patch embedding (``(image_size // patch_size) ** 2``)."""
        return (self.image_size // self.patch_size) ** 2


class ModelSpec(SpecModel):
    """A transformer's shape and structure: what decides its parameters and saved activations.

    Build one from a preset (`trainmem_nb.model.presets.get_model`), a Hugging Face config
    (`ModelSpec.from_hf_config`), a parameter count (`ModelSpec.from_params`), or directly; family
    defaults (norm, MLP type, biases, positions...) are filled in from its description
    (`trainmem_nb.model.families`).

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
    # Layer patterns: where the layers of one model differ (none: every layer is the model's default kind).
    layer_types: tuple[Literal["full_attention", "sliding_attention"], ...] = Field(
        default=(), description="each layer's attention (Hugging Face's layer_types); empty: all the default")
    nope_layers: tuple[int, ...] = Field(default=(), description="layers without rotary embeddings (NoPE)")
    dense_layers: tuple[int, ...] = Field(
        default=(), description="layers of a mixture-of-experts model whose MLP is dense")
    expert_ffn: int = Field(default=0, ge=0, le=_MAX_DIM * 8, description="each expert's intermediate size; 0: ffn")
    # Family-specific details (used only by the family that has them).
    word_embed_proj_dim: int = Field(default=0, ge=0, le=_MAX_DIM, description="OPT: 0 means hidden")
    pre_norm: bool = Field(default=True, description="OPT do_layer_norm_before; BERT is post-norm")
    type_vocab: int = Field(default=2, ge=0, le=1024, description="BERT token-type embeddings")
    lm_head_bias: bool = Field(default=False, description="the LM head has a bias (phi)")
    num_labels: int = Field(
        default=0, ge=0, le=1 << 16, description="a sequence-classification head with this many labels instead of "
        "the language-model head (BertForSequenceClassification; 1: regression); 0: the LM head")
    qk_layernorm: bool = Field(default=False, description="a LayerNorm on each head's query and key (phi)")
    # Mixture-of-experts routing details (qwen3_moe, deepseek_v3, gpt_oss).
    norm_topk_prob: bool = Field(default=True, description="renormalise the top-k routing weights")
    n_shared_experts: int = Field(default=0, ge=0, le=64, description="experts every token goes through (deepseek)")
    n_expert_groups: int = Field(default=0, ge=0, le=4096, description="router groups (deepseek n_group); 0: none")
    topk_groups: int = Field(default=0, ge=0, le=4096, description="groups each token's experts come from")
    local_experts: int = Field(
        default=0, ge=0, le=4096, description="routed experts one rank holds under expert parallelism (n_experts / "
        "ep; set by the parallel layout, `trainmem_nb.parallel.layout`); 0: all of them")
    # Attention details.
    query_pre_attn_scalar: float = Field(default=0.0, ge=0.0, description="scaling = this ** -0.5 (gemma2); 0: head_dim")
    attn_softcap: float = Field(default=0.0, ge=0.0, description="attention logit soft-capping (gemma2); 0: none")
    final_softcap: float = Field(default=0.0, ge=0.0, description="final logit soft-capping (gemma2); 0: none")
    # Multi-head latent attention (deepseek_v3): low-rank q and kv, a shared rope key, qk dim != v dim.
    q_lora_rank: int = Field(default=0, ge=0, le=_MAX_DIM, description="rank of q's low-rank projection; 0: q_proj")
    kv_lora_rank: int = Field(default=0, ge=0, le=_MAX_DIM, description="rank of the compressed kv (MLA); 0: no MLA")
    qk_nope_head_dim: int = Field(default=0, ge=0, le=_MAX_DIM, description="per-head q/k dims without rotary (MLA)")
    qk_rope_head_dim: int = Field(default=0, ge=0, le=_MAX_DIM, description="per-head q/k dims with rotary (MLA)")
    v_head_dim: int = Field(default=0, ge=0, le=_MAX_DIM, description="per-head value dims (MLA); 0: head_dim")
    # A multimodal checkpoint's vision tower (gemma3): weights a text-only step holds but never runs.
    vision: VisionTower | None = Field(
        default=None, description="the SigLIP vision tower and projector of a multimodal Gemma 3 checkpoint (what "
        "AutoModelForCausalLM builds from it: Gemma3ForConditionalGeneration); None: the language model alone")

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
        for key, value in DESCRIPTIONS[family].structure.items():
            data.setdefault(key, value)
        act = data.get("activation")
        if isinstance(act, str) and act not in ACTIVATIONS:
            raise SpecError(
                f"activation={act!r} is not supported{did_you_mean(act, list(ACTIVATIONS))}; "
                f"valid values: {', '.join(ACTIVATIONS)}"
            )
        return data

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelSpec:
        if self.vision is not None and self.family is not Family.GEMMA3:
            raise SpecError(f"vision (a multimodal checkpoint's vision tower) is modelled for gemma3, not "
                            f"{self.family.value}; leave vision out")
        if self.num_labels and not (self.family is Family.BERT or DESCRIPTIONS[self.family].composed):
            ok = ", ".join(f.value for f, d in DESCRIPTIONS.items() if f is Family.BERT or d.composed)
            raise SpecError(f"num_labels={self.num_labels} (a sequence-classification head) is modelled for {ok}, "
                            f"not {self.family.value}; use num_labels=0 (the language-model head)")
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
        self._check_layer_pattern()
        self._check_biases()
        if "sliding" in DESCRIPTIONS[self.family].always_masks and not self.sliding_window:
            # masking_utils.create_sliding_window_causal_mask: "Could not find a `sliding_window` argument"
            raise SpecError(f"family {self.family.value!r} builds a sliding-window mask for every model: give "
                            f"sliding_window > 0 (its configuration's default is 4096)")
        caps = DESCRIPTIONS[self.family].softcaps
        for field, cap in (("attn_softcap", "attention"), ("final_softcap", "final")):
            if getattr(self, field) and cap not in caps:
                raise SpecError(f"{field}={getattr(self, field):g}: family {self.family.value!r} has no {cap} "
                                f"logit soft-capping (gemma2 caps attention and final logits, gemma3 final ones)")
        if self.family in (Family.MIXTRAL, Family.QWEN3_MOE) or self.n_experts:
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
            if self.family not in (Family.MIXTRAL, Family.QWEN3_MOE, Family.GPT_OSS, Family.DEEPSEEK_V3):
                raise SpecError(
                    f"n_experts={self.n_experts} is only supported for families 'mixtral' and 'qwen3_moe' "
                    f"(got {self.family.value!r})"
                )
        if self.family in (Family.GPT2, Family.GPT_NEOX, Family.OPT, Family.BERT) and self.n_kv_heads != self.n_heads:
            raise SpecError(
                f"family {self.family.value!r} has no grouped-query attention: n_kv_heads must equal "
                f"n_heads={self.n_heads} (got {self.n_kv_heads})"
            )
        if self.qk_layernorm and self.family is not Family.PHI:
            raise SpecError(f"qk_layernorm is phi's (PhiAttention's q/k LayerNorms); family {self.family.value!r} "
                            "has no such option")
        if self.local_experts and (not self.n_experts or self.n_experts % self.local_experts):
            raise SpecError(f"local_experts={self.local_experts} must divide n_experts={self.n_experts} (a rank holds "
                            "n_experts / ep of them)")
        if self.family is Family.DEEPSEEK_V3:
            self._check_mla()
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

    def _check_biases(self) -> None:
        """Only bias layouts the family's modeling code can build: the fields one config key sets agree, and
        a field no key sets keeps the family's value (what the measure extra would build otherwise differs)."""
        d = DESCRIPTIONS[self.family]
        switched: set[str] = set()
        for key, fields in d.biases:
            switched.update(fields)
            values = {getattr(self, f) for f in fields}
            if len(values) > 1:
                got = ", ".join(f"{f}={getattr(self, f)}" for f in fields)
                raise SpecError(f"family {self.family.value!r} switches {_and(fields)} together (config.json "
                                f"{key}): give them the same value (got {got})")
        for f in BIAS_FIELDS:
            fixed = bool(d.structure.get(f, False))
            if f not in switched and getattr(self, f) != fixed:
                raise SpecError(f"family {self.family.value!r} always builds its projections with {f}={fixed} (no "
                                f"config key changes it); leave {f} out or set it to {fixed}")

    def _check_layer_pattern(self) -> None:
        if self.layer_types and len(self.layer_types) != self.n_layers:
            raise SpecError(f"layer_types has {len(self.layer_types)} entries for n_layers={self.n_layers}; "
                            f"give one per layer or none")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise SpecError("layer_types has sliding_attention layers but sliding_window is 0; give the window")
        for name in ("nope_layers", "dense_layers"):
            bad = [i for i in getattr(self, name) if not 0 <= i < self.n_layers]
            if bad:
                raise SpecError(f"{name} has layer {bad[0]}, outside 0..{self.n_layers - 1}")
        if self.dense_layers and not self.n_experts:
            raise SpecError("dense_layers is for mixture-of-experts models; this model has no experts (n_experts=0)")

    def _check_mla(self) -> None:
        """deepseek_v3: multi-head latent attention needs its ranks and head dims; its rope key is shared
        by every head (``expand``), so the model has as many kv heads as heads."""
        if not (self.kv_lora_rank and self.qk_nope_head_dim and self.qk_rope_head_dim and self.v_head_dim):
            raise SpecError("deepseek_v3 needs kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim (MLA)")
        if self.head_dim != self.qk_rope_head_dim:
            raise SpecError(f"deepseek_v3: head_dim is the rope head dim (qk_rope_head_dim={self.qk_rope_head_dim}), "
                            f"got head_dim={self.head_dim}")
        if self.n_kv_heads != self.n_heads:
            raise SpecError(f"deepseek_v3: n_kv_heads must equal n_heads={self.n_heads} (MLA expands its keys to "
                            f"every head), got {self.n_kv_heads}")
        if self.n_expert_groups and (self.n_experts % self.n_expert_groups or self.topk_groups > self.n_expert_groups):
            raise SpecError(f"deepseek_v3: n_expert_groups={self.n_expert_groups} must divide n_experts={self.n_experts} "
                            f"and topk_groups={self.topk_groups} must not exceed it")

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """What each layer is (its attention mask, rotary or NoPE, dense or MoE MLP), first to last."""
        return _layer_kinds(self.family, self.n_layers, self.sliding_window, self.layer_types, self.nope_layers,
                            self.n_experts > 0, self.dense_layers)

    def layer_slice(self, start: int, stop: int) -> ModelSpec:
        """The model's layers ``start..stop-1`` as a model of their own (a pipeline stage): the layer
        pattern is cut to them, everything else kept."""
        if not 0 <= start < stop <= self.n_layers:
            raise SpecError(f"layers {start}..{stop - 1} are not within 0..{self.n_layers - 1}")
        if (start, stop) == (0, self.n_layers):
            return self
        data = self.model_dump()
        data.update(n_layers=stop - start, layer_types=self.layer_types[start:stop],
                    nope_layers=tuple(i - start for i in self.nope_layers if start <= i < stop),
                    dense_layers=tuple(i - start for i in self.dense_layers if start <= i < stop))
        return ModelSpec.model_validate(data)

    @property
    def expert_width(self) -> int:
        """Intermediate size of one expert's MLP."""
        return self.expert_ffn or self.ffn

    @property
    def held_experts(self) -> int:
        """Routed experts whose weights this model (one rank of an expert-parallel layout) holds."""
        return self.local_experts or self.n_experts

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
        from .hf_config import UnsupportedModelType, spec_kwargs_from_hf

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
        try:
            kwargs = spec_kwargs_from_hf(data)
        except UnsupportedModelType as e:
            raise SpecError(f"{e}; {_estimate_anyway(cls, data)}") from None
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


def _estimate_anyway(cls: type[ModelSpec], data: Mapping[str, Any]) -> str:
    """How to estimate a model whose family is not supported: a Llama of its own dimensions when the
    config names them (with that stand-in's parameter count), else a bare parameter count."""
    from .hf_config import stand_in_kwargs

    kw = stand_in_kwargs(data)
    try:
        n = _validate(cls, {**kw, "name": "stand-in"}).n_params if kw else 0
    except SpecError:
        n = 0
    if not kw or not n:
        return ("to estimate anyway, pass its parameter count (tm.estimate(params=7e9), --params 7e9: a Llama-shaped "
                "stand-in) or a ModelSpec(family='llama', ...) of its dimensions")
    from ..units import format_count

    count = f"{n / 1e9:.3g}e9" if n >= 1e8 else f"{n:.3g}"
    return (f"to estimate anyway, a Llama of its dimensions ({kw['n_layers']} layers, hidden {kw['hidden']}, "
            f"ffn {kw['ffn']}, vocab {kw['vocab']}) has {format_count(n)} parameters: copy the config with "
            "\"model_type\": \"llama\" if its layers are Llama's (RMSNorm, rotary, SwiGLU), or pass "
            f"params={count} (--params {count}) for a Llama-shaped stand-in")


def _and(names: tuple[str, ...]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _divisors_near(n: int, near: int) -> str:
    divs = [d for d in range(1, min(n, 4096) + 1) if n % d == 0]
    divs.sort(key=lambda d: (abs(d - near), d))
    return ", ".join(str(d) for d in sorted(divs[:6]))


@lru_cache(maxsize=1024)
def _layer_kinds(family: Family, n_layers: int, window: int, layer_types: tuple[str, ...], nope: tuple[int, ...],
                 moe: bool, dense: tuple[int, ...]) -> tuple[LayerKind, ...]:
    """`ModelSpec.layer_kinds`: without layer_types, every layer gets the family's default mask (sliding
    when the family builds sliding-window masks and the model has a window)."""
    default = "sliding" if window and DESCRIPTIONS[family].sliding_mask else "full"
    attention = [t.split("_")[0] for t in layer_types] if layer_types else [default] * n_layers
    period = DESCRIPTIONS[family].sliding_period
    if period and window and not layer_types:  # the config's default layer_types (gemma2, gemma3)
        attention = ["sliding" if (i + 1) % period else "full" for i in range(n_layers)]
    no_rope, dense_set = set(nope), set(dense)
    return tuple(LayerKind(attention[i], i not in no_rope, moe and i not in dense_set) for i in range(n_layers))
