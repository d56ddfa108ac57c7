"""The model families and what each is, structurally, as Hugging Face builds it.
"""

from __future__ import annotations

from typing import Any

from ..spec.base import _Choice

__all__ = ['Family']


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
