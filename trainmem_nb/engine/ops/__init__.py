"""Ops on symbolic tensors, one module per group: each allocates its outputs, keeps what PyTorch's
autograd saves for backward and records a backward rule that allocates what the derivative formula
allocates. Recipes call them as ``ops.<name>``."""

from .attention import eager_attention, sdpa_flash, sdpa_math
from .collectives import all_to_all, index_put_new
from .core import BOOL, F16, F32, I64, ONE, Ctx, autocast_weight, cast, end_autocast, reserve
from .elementwise import (
    activation,
    add,
    add_,
    clamp,
    div_,
    dropout,
    dropout_last,
    gelu,
    gelu_new,
    layer_norm,
    mean_last,
    mul,
    mul_both_grads,
    mul_reduce_cast,
    pow2,
    relu,
    rsqrt,
    scalar_op,
    softmax,
    sub,
    sum_keepdim,
    unary_saving_input,
    unary_saving_output,
)
from .fp8 import fp8_linear
from .linear import addmm, baddbmm, baddbmm_check, bmm, embedding, grouped_mm, linear, linear_4bit
from .lora import (
    linear_strided_grad,
    lora_addmm,
    lora_expert_factors,
    lora_linear,
    lora_param_check,
    lora_param_delta,
    lora_param_merge,
    lora_update,
)
from .shape import (
    alias_view,
    cat2,
    cat_last,
    clone,
    copy_into_new,
    expand_view,
    heads_view,
    index_pairs,
    index_rows,
    repeat_kv,
    rotate_half,
    slice_view,
    split,
    topk,
)
from .te_fp8 import te_fp8_linear

__all__ = [
    "BOOL", "F16", "F32", "I64", "ONE", "Ctx", "activation", "add", "addmm", "alias_view", "autocast_weight",
    "baddbmm", "baddbmm_check", "bmm", "cast", "cat2", "cat_last", "clone", "div_", "dropout", "dropout_last",
    "eager_attention", "embedding", "end_autocast", "gelu", "gelu_new", "grouped_mm", "heads_view", "index_rows",
    "layer_norm", "linear", "linear_4bit", "linear_strided_grad", "lora_addmm", "lora_expert_factors", "lora_linear",
    "lora_param_check", "lora_param_delta", "lora_param_merge", "lora_update", "mean_last", "mul", "mul_both_grads", "pow2", "relu",
    "repeat_kv", "reserve", "rotate_half", "rsqrt", "scalar_op", "sdpa_flash", "sdpa_math", "slice_view",
    "softmax", "split", "sum_keepdim", "topk", "unary_saving_input", "unary_saving_output",
]
__all__ += ["add_", "clamp", "mul_reduce_cast", "sub"]  # gpt_oss
__all__ += ["copy_into_new", "expand_view"]  # deepseek_v3
__all__ += ["index_pairs"]  # sequence classification
__all__ += ["all_to_all", "index_put_new"]  # expert parallelism
__all__ += ["fp8_linear", "te_fp8_linear"]  # fp8 training
