"""fp8 linears as Transformer Engine runs them under Megatron-LM (``transformer_engine/pytorch/module/linear.py``
and ``layernorm_linear.py``, main of 2026-08; Megatron's ``TELinear`` / ``TELayerNormColumnParallelLinear``), on a
Hopper GPU with the delayed (``DelayedScaling``) or current (``Float8CurrentScaling``) tensorwise recipe.

Unlike torchao's eager ``Float8Linear`` (`trainmem_nb.engine.ops.fp8`), TE keeps fp8 tensors for backward:

- forward: the input is cast to fp8 with both usages (``input_quantizer.set_usage(rowwise=True,
  columnwise=backward_needs_input)``, linear.py:428-437). On Hopper a ``Float8Tensor``'s column-wise data is a
  transposed copy (``_transpose``; float8_tensor.py:423-427: only where ``is_non_tn_fp8_gemm_supported()`` is
  false, so Blackwell keeps one copy), so the cast makes two bytes per element. After the GEMM the row-wise data
  is discarded (``inputmat.update_usage(rowwise_usage=False, columnwise_usage=True)``, linear.py:616) and the
  transpose, one byte per element, is what the linear saves: not the 16-bit input.
- the weight's fp8 copy and its transpose are a workspace cached on the module across micro-batches and steps
  (``self._fp8_workspaces["weight"]`` when Megatron passes ``is_first_microbatch``, linear.py:1958-2071): a
  persistent 2 bytes per parameter, which `trainmem_nb.parallel.megatron` holds; the linear saves that workspace.
- the bias is added in the GEMM's epilogue (no separate add).
- backward: the output gradient is cast to fp8 with both usages (``grad_output_quantizer.set_usage(rowwise=True,
  columnwise=True)``, linear.py:905, its bias gradient fused in the cast), the input gradient comes out in 16 bits
  (``out_dtype=activation_dtype``), and the weight gradient's GEMM adds into Megatron's ``main_grad``
  (``fuse_wgrad_accumulation=config.gradient_accumulation_fusion``) or makes a 16-bit gradient.

With a recipe other than delayed scaling Megatron has the attention's output projection save its original
16-bit input, which attention saves anyway (``set_save_original_input(self.linear_proj)``, megatron/core/
transformer/attention.py:428-444, TE >= 2.6): its input is cast row-wise only for the GEMM, and again, with its
transpose, in backward (linear.py:960-970).

Megatron fuses q, k and v into one ``linear_qkv`` and the gate and up projections into one ``linear_fc1``, each a
``LayerNormLinear`` whose norm writes the fp8 input directly (``with_quantized_norm``, layernorm_linear.py:244;
under current scaling the kernel makes a 16-bit output first and frees it before the GEMM). The recipes run them
as separate projections on one input, so the first projection of a fused group (`Ctx.te_fused`, from the family's
``fused_projections``) makes the input's fp8 cast, the others reuse it, and its row-wise data lives until the
group's last projection has made its output (TE frees it after the one fused GEMM); the norm's 16-bit output stays
a transient until those projections have run. Projections outside a group cast their input each on their own.
Not modelled: the scales (a 4-byte ``scale_inv`` per fp8 tensor and the amax history), Blackwell's single copy,
and the all-gathered row-wise copy under sequence parallelism (forward) and its re-gather and transpose
(backward).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..tape import Graph, T
from .core import Ctx
from .linear import weight_grad

__all__ = ["te_fp8_linear"]

FP8 = 1


def te_fp8_linear(g: Graph, ctx: Ctx, x: T, w: T, in_features: int, out_features: int, b: T | None,
                  label: str) -> T:
    """Transformer Engine's fp8 ``Linear(x)``: `x` (tokens, in) in the 16-bit activation dtype, `w` the (out, in)
    16-bit weight (its fp8 workspace is the engine's, outside the step); the output (tokens, out) in x's dtype,
    the bias added in the GEMM. Saves the input's fp8 transpose, shared by the projections of a fused group, or,
    for the projection Megatron has save its original input (`Ctx.te_original_input`), the 16-bit input: cast
    row-wise only for the forward GEMM, and again, with its transpose, in backward for the weight gradient."""
    dt = x.dt
    out_n = x.n * (out_features / in_features)
    original = label == ctx.te_original_input
    xc, wc = g.hold(x), g.hold(w)
    bc = g.hold(b) if b is not None else None
    last = ctx.te_fused.get(label)  # the last projection of label's fused group (None: label is alone)
    shared = ctx.fp8_inputs.get(last) if last is not None else None
    xt: T | None
    if shared is not None and shared[0] is x:  # a later projection of the group: the group's cast
        _x, xt, rowwise = shared
        g.hold(xt)
    else:
        if shared is not None and last is not None:  # a group whose last projection never ran
            g.drop(*ctx.fp8_inputs.pop(last)[1:])
        # cast_transpose: the row-wise fp8 data and its transpose; row-wise only where the 16-bit input is saved
        rowwise = g.alloc(x.n, FP8, f"{label} input fp8")
        xt = None if original else g.alloc(x.n, FP8, f"{label} input fp8 transpose")
        if last is not None and last != label and xt is not None:  # the group's cast, alive until its last projection
            ctx.fp8_inputs[last] = (x, g.hold(xt), rowwise)  # x kept: the check above compares identities
    ins = [xc, wc] + ([bc] if bc is not None else [])
    (out,) = g.sac_outputs(lambda: (g.alloc(out_n, dt, label),), "other")
    if last in (None, label):  # update_usage(rowwise_usage=False) after the (fused) GEMM: the transpose is kept
        entry = ctx.fp8_inputs.pop(label, None)
        g.drop(rowwise, entry[1] if entry is not None else None)
    has_bias = bc is not None

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        # grad_output_preprocess: the output gradient cast with both usages (its bias gradient fused in)
        go8 = g.alloc(out_n, FP8, f"{label} grad output fp8")
        got = g.alloc(out_n, FP8, f"{label} grad output fp8 transpose") if wc.rg else None
        gb = g.alloc(bc.n, bc.dt, f"{label} grad b") if has_bias and bc is not None and bc.rg else None
        gx = g.alloc(x.n, dt, f"{label} grad x") if xc.rg else None  # dgrad first (linear.py:1086-1098)
        gw = None
        if wc.rg and original:  # the saved input cast again for the weight gradient's GEMM (linear.py:960-970)
            x8 = g.alloc(x.n, FP8, f"{label} input fp8 (backward)")
            x8t = g.alloc(x.n, FP8, f"{label} input fp8 transpose (backward)")
            gw = weight_grad(g, wc, label)
            g.drop(x8, x8t)
        elif wc.rg:  # wgrad, into main_grad under Megatron's fusion
            gw = weight_grad(g, wc, label)
        g.drop(go8, got)
        return [gx, gw] + ([gb] if has_bias else [])

    saved = xc if original else xt
    g.record(label, ins, [out], [saved if wc.rg else None], bwd)
    g.drop(xc, wc, bc, xt)
    return out
