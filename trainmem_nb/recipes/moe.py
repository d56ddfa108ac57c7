"""Mixtral as Hugging Face implements it (modeling_mixtral.py and integrations/moe.py, transformers 5.x).

Mistral's attention with a top-k routed mixture-of-experts MLP (``MixtralSparseMoeBlock``): a router
(``MixtralTopKRouter``: linear → fp32 softmax → top-k → renormalized in place) and the experts, stored
as 3-D parameters ``gate_up_proj`` (E, 2f, h) and ``down_proj`` (E, h, f).

transformers picks the experts' forward by ``config._experts_implementation``; unless asked otherwise
it is ``grouped_mm`` (``PreTrainedModel.get_correct_experts_implementation``), and training on CPU
(torch >= 2.10) or CUDA (compute capability >= 8.0) runs ``grouped_mm_experts_forward``: the
(token, expert) pairs are sorted by expert and each projection is one ``torch.nn.functional.grouped_mm``
over all ``tokens * top_k`` rows. Routing is data-dependent but no shape is: every token goes to
``top_k`` experts, so every tensor of the step has a size fixed by (b, s). Only how the rows split
between experts (the offsets) depends on the data, and that changes the kernels' work, not memory.
Real CPU steps with random routing (three seeds; E 4/8, top_k 1-3, several (b, s), fp32, bf16-mixed
and bf16-true, with and without checkpointing) give the same bytes as this recipe. (The per-expert
loop of ``experts_implementation="eager"``, whose slices do have data-dependent sizes, is not what a
default model runs.) The router's auxiliary loss exists only with ``output_router_logits`` (off by
default); router jitter noise is 0 by default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..engine import ops
from ..engine.ops import F32, I64
from ..engine.tape import Graph, T, const
from .base import tok

if TYPE_CHECKING:
    from .decoder import DecoderRecipe

__all__ = ["MOES", "experts", "moe_mlp", "router"]

I32 = 4


def moe_mlp(rec: DecoderRecipe, g: Graph, x: T, p: dict[str, T]) -> T:
    """MixtralSparseMoeBlock.forward: ``hidden_states.view(-1, h)`` (a view), the router, the
    experts, ``reshape`` back (a view). ``_`` (the router logits) and ``top_k_weights`` are its
    locals until it returns; ``top_k_index`` is saved by ``topk``."""
    logits, weights, index = router(rec, g, x, p)
    out = experts(rec, g, x, index, weights, p)
    g.drop(logits, weights, index)
    return out



def router(rec: DecoderRecipe, g: Graph, x: T, p: dict[str, T]) -> tuple[T, T, T]:
    """MixtralTopKRouter.forward: ``hidden_states.reshape(-1, h)`` (already 2-D: a view node of
    its own, whose backward runs after the weight cast's), ``router_logits = F.linear(h, weight)``
    (autocast: 16-bit), ``softmax(router_logits.float())`` (the fp32 copy is a temporary),
    ``topk``, then ``router_top_value /= router_top_value.sum(-1, keepdim=True)`` in place
    (autograd keeps a clone of the unnormalized values). Returns (logits, renormalized weights,
    indices).

    With LoRA on the router (peft's ``ParamWrapper`` of ``gate.weight``) the wrapper first computes
    the delta weight and the linear uses ``W + delta`` (`ops.lora_param_delta`); when the router
    returns, the parametrization cache (the merged weight) and then the delta go."""
    m = rec.m
    k, E = m.experts_top_k, m.n_experts
    w = p["mlp.gate.weight"]
    a_w = p.get("mlp.gate.lora_A.weight")
    delta = None
    if a_w is not None:
        delta = ops.lora_param_delta(g, rec.ctx, w, a_w, p["mlp.gate.lora_B.weight"], rec.t.lora_rank, "mlp.gate")
        w = ops.lora_param_merge(g, w, delta, "mlp.gate")
    flat = ops.alias_view(g, x, "reshape(-1, h)")  # a view node of its own
    logits = ops.linear(g, rec.ctx, flat, w, m.hidden, E, None, "mlp.gate", w_leaf=delta is None)
    g.drop(flat)
    lf = ops.cast(g, logits, F32, "router_logits.float()")
    probs = ops.softmax(g, lf, None, "router softmax")
    g.drop(lf)
    vals, index = ops.topk(g, probs, tok(k), "router topk")
    total = ops.sum_keepdim(g, vals, tok(1), "router_top_value.sum")
    weights = ops.div_(g, vals, total, "router_top_value /= sum")
    g.drop(total, vals)  # the sum is a temporary; `/=` rebinds the name to the same tensor
    g.drop(probs)  # router_probs (saved by softmax) goes when the router returns
    if delta is not None:
        g.drop(w, delta)
    return logits, weights, index



def experts(rec: DecoderRecipe, g: Graph, x: T, index: T, weights: T, p: dict[str, T],
            weighted_mul: Callable[[Graph, T, T, str], T] = ops.mul_both_grads) -> T:
    """``grouped_mm_experts_forward`` (integrations/moe.py) over S = tokens * top_k rows:
    ``sort`` of the expert ids (values and permutation), ``hidden_states[perm // top_k]``,
    ``sample_weights[perm]``, ``histc`` of the sorted ids (fp32 copy on CPU, int32 on CUDA: 4 bytes
    either way) and int32 ``cumsum`` offsets; ``grouped_mm`` with ``gate_up_proj`` (its transposed
    view), ``act(gate) * up`` on the chunked result, ``grouped_mm`` with ``down_proj``, times the
    routing weights (fp32: the product is promoted), un-permuted with ``weighted_out[inv_perm]``,
    ``view(tokens, top_k, h).sum(1)`` and cast back to the input's dtype.

    LoRA on the experts (peft 0.21 ``ParamWrapper``, nested: ``down_proj``'s wrapper outside
    ``gate_up_proj``'s): each wrapper casts its factors (`ops.lora_expert_factors`) and runs the
    parametrization check on entry; each parameter access in the forward then computes the merged
    weight ``baddbmm(W, lhs, rhs, alpha=scaling)`` (a tensor the size of the expert stack, which
    ``grouped_mm`` saves, and whose gradient its backward computes)."""
    m, t = rec.m, rec.t
    k, h, f, E = m.experts_top_k, m.hidden, m.expert_width, m.n_experts
    scaling = t.lora_alpha / t.lora_rank
    wrapped = [name for name in ("down_proj", "gate_up_proj") if f"mlp.experts.{name}.lora_A.weight" in p]
    factors: dict[str, tuple[T, T]] = {}
    for name in wrapped:  # outermost wrapper first
        w = p[f"mlp.experts.{name}"]
        factors[name] = ops.lora_expert_factors(g, w, p[f"mlp.experts.{name}.lora_A.weight"],
                                                p[f"mlp.experts.{name}.lora_B.weight"], f"experts.{name}")
        ops.baddbmm_check(g, w, f"experts.{name}")
    merged: list[T] = []

    def weight(name: str) -> T:
        w = p[f"mlp.experts.{name}"]
        if name not in factors:
            return w
        lhs, rhs = factors[name]
        wm = ops.baddbmm(g, w, lhs, rhs, scaling, f"experts.{name} W + scaling * lhs @ rhs")
        merged.append(wm)
        return wm

    ids_sorted = g.alloc(tok(k), I64, "sort values (expert_ids_g)")
    perm = g.alloc(tok(k), I64, "sort indices (perm)")
    rows = g.alloc(tok(k), I64, "perm // top_k")
    sel = ops.index_rows(g, x, rows, tok(k * h), "hidden_states[perm // top_k]")
    g.drop(rows)
    sw = ops.index_rows(g, weights, perm, tok(k), "sample_weights[perm]")
    hist_in = g.alloc(tok(k), 4, "histc input")
    tpe = g.alloc(const(E), F32, "tokens_per_expert (histc)")
    offs = g.alloc(const(m.held_experts), I32, "offsets (cumsum)")
    sel, pidx = _ep_dispatch(rec, g, sel)
    gu = ops.grouped_mm(g, sel, weight("gate_up_proj"), offs, tok(k * 2 * f), "grouped_mm gate_up_proj")
    gate, up = ops.split(g, gu, (0.5, 0.5), "chunk gate, up")
    g.drop(gu)
    a = rec.act(g, gate)
    gated = ops.mul(g, a, up, "act(gate) * up")
    g.drop(a, gate, up)
    down = ops.grouped_mm(g, gated, weight("down_proj"), offs, tok(k * h), "grouped_mm down_proj")
    g.drop(gated)
    down = _ep_combine(g, down, pidx)
    weighted = weighted_mul(g, down, sw, "proj_out * sample_weights_g")
    inv = g.alloc(tok(k), I64, "inv_perm (empty_like)")
    ar = g.alloc(tok(k), I64, "arange")
    g.drop(ar)
    unperm = ops.index_rows(g, weighted, inv, tok(k * h), "weighted_out[inv_perm]")
    g.drop(weighted)
    v3 = ops.heads_view(g, unperm, "view(tokens, top_k, h)", clone_grad=True)
    summed = ops.sum_keepdim(g, v3, tok(h), "sum over top_k")
    g.drop(v3)
    out = ops.cast(g, summed, x.dt, "to(hidden_states.dtype)")
    # the function's locals go on return, in order (the unsaved ones are freed)
    g.drop(ids_sorted, perm, sel, sw, hist_in, tpe, offs, down, unperm, inv, summed, pidx)
    # the wrappers return, innermost first: each removes its parametrization (its factors go);
    # the outermost ``cached()`` exit drops the merged weights before the outer factors
    for name in reversed(wrapped):
        if name == wrapped[0]:
            g.drop(*merged)
        g.drop(*factors[name])
    return out


def _ep_dispatch(rec: DecoderRecipe, g: Graph, sel: T) -> tuple[T, T | None]:
    """Expert parallelism's dispatch (torchtitan's ``AllToAllTokenDispatcher.dispatch``, token_dispatcher.py):
    the expert-sorted rows go to the ranks holding their experts (``all_to_all_single``; with balanced
    routing a rank receives tokens * top_k rows, as many as it sends), then ``_permute`` reorders them
    rank-major to expert-major (``permuted_indices`` from ``repeat_interleave`` and ``arange``, then
    ``routed_input[permuted_indices, :]``). The sent rows and the received ones die when dispatch
    returns (nothing saves them); the permuted rows are the experts' input. Returns (the experts' input,
    the permutation), or (`sel`, None) without expert parallelism."""
    m = rec.m
    if m.held_experts == m.n_experts:
        return sel, None
    recv = ops.all_to_all(g, sel, "all-to-all dispatch")
    rows = sel.n * (1 / rec.m.hidden)  # tokens * top_k
    seg = g.alloc(rows, I64, "seg_ids (repeat_interleave)")
    ar = g.alloc(rows, I64, "arange")
    pidx = g.alloc(rows, I64, "permuted_indices")
    g.drop(seg, ar)
    permuted = ops.index_rows(g, recv, pidx, recv.n, "routed_input[permuted_indices]")
    g.drop(sel, recv)
    return permuted, pidx


def _ep_combine(g: Graph, out: T, pidx: T | None) -> T:
    """Expert parallelism's combine (``AllToAllTokenDispatcher.combine``): ``_unpermute`` (``new_empty``
    then ``index_put_`` of the expert outputs back to rank-major order), the reverse ``all_to_all_single``
    to the ranks the tokens came from; the routing weights then apply as without it."""
    if pidx is None:
        return out
    unperm = ops.index_put_new(g, out, pidx, "_unpermute (new_empty, index_put_)")
    g.drop(out)
    back = ops.all_to_all(g, unperm, "all-to-all combine")
    g.drop(unperm)
    return back


def qwen3_moe_mlp(rec: DecoderRecipe, g: Graph, x: T, p: dict[str, T]) -> T:
    """Qwen3MoeSparseMoeBlock.forward: ``view(-1, h)``, the router (`qwen3_router`), the experts (the
    same ``grouped_mm_experts_forward`` as Mixtral's), ``reshape`` back; ``_`` (the logits) and the
    routing weights are locals until it returns."""
    logits, weights, index = qwen3_router(rec, g, x, p)
    out = experts(rec, g, x, index, weights, p)
    g.drop(logits, weights, index)
    return out


def qwen3_router(rec: DecoderRecipe, g: Graph, x: T, p: dict[str, T]) -> tuple[T, T, T]:
    """Qwen3MoeTopKRouter.forward: Mixtral's router (`router`: ``softmax(router_logits, dtype=torch.float)``
    converts to fp32 before the kernel as ``.float()`` does), the in-place renormalisation only with
    ``norm_topk_prob``, then ``router_top_value.to(router_logits.dtype)`` (a copy under autocast, whose
    logits are 16-bit; the fp32 values lose their name there). ``router_probs`` is a local until the
    router returns, after the cast."""
    m = rec.m
    k, E = m.experts_top_k, m.n_experts
    w = p["mlp.gate.weight"]
    a_w = p.get("mlp.gate.lora_A.weight")
    delta = None
    if a_w is not None:
        delta = ops.lora_param_delta(g, rec.ctx, w, a_w, p["mlp.gate.lora_B.weight"], rec.t.lora_rank, "mlp.gate")
        w = ops.lora_param_merge(g, w, delta, "mlp.gate")
    flat = ops.alias_view(g, x, "reshape(-1, h)")
    logits = ops.linear(g, rec.ctx, flat, w, m.hidden, E, None, "mlp.gate", w_leaf=delta is None)
    g.drop(flat)
    lf = ops.cast(g, logits, F32, "softmax(router_logits, dtype=float) input")
    probs = ops.softmax(g, lf, None, "router softmax")
    g.drop(lf)
    vals, index = ops.topk(g, probs, tok(k), "router topk")
    if m.norm_topk_prob:
        total = ops.sum_keepdim(g, vals, tok(1), "router_top_value.sum")
        normed = ops.div_(g, vals, total, "router_top_value /= sum")
        g.drop(total, vals)
        vals = normed
    weights = ops.cast(g, vals, logits.dt, "router_top_value.to(router_logits.dtype)")
    g.drop(vals, probs)
    if delta is not None:
        g.drop(w, delta)
    return logits, weights, index


def gpt_oss_moe(rec: DecoderRecipe, g: Graph, x: T, p: dict[str, T]) -> T:
    """``GptOssMLP.forward`` (modeling_gpt_oss.py): ``reshape(-1, h)`` (a view), the router
    (``GptOssTopKRouter``: ``F.linear(h, weight, bias)``, ``topk`` of the logits, ``softmax`` of the
    top values in their dtype), the experts, ``reshape`` back; the router logits are a local until it
    returns, the routing scores go back to the layer."""
    m = rec.m
    k, E = m.experts_top_k, m.n_experts
    # at::linear runs a biased linear as ``addmm``, whose bias gradient the engine reduces after the node
    logits = ops.addmm(g, rec.ctx, x, p["mlp.router.weight"], p["mlp.router.bias"], m.hidden, E, "mlp.router",
                       linear_casts=True)
    vals, index = ops.topk(g, logits, tok(k), "router topk")
    scores = ops.softmax(g, vals, None, "router softmax")
    g.drop(vals)
    out = gpt_oss_experts(rec, g, x, index, scores, p)
    g.drop(logits, index)
    # GptOssDecoderLayer: ``hidden_states, _ = self.mlp(hidden_states)`` rebinds ``_`` from the attention
    # weights to the routing scores, which stay bound until the layer returns (`pre_norm_layer` drops
    # `DecoderRecipe.attn_weights` there)
    g.drop(*rec.attn_weights)
    rec.attn_weights = [scores]
    return out


def gpt_oss_experts(rec: DecoderRecipe, g: Graph, x: T, index: T, weights: T, p: dict[str, T]) -> T:
    """``grouped_mm_experts_forward`` (integrations/moe.py; transformers' default experts
    implementation, `experts`) for ``GptOssExperts`` (``is_transposed=True, has_bias=True``): the sort,
    gathers, ``histc`` and offsets as for mixtral; each projection is ``grouped_mm`` with the (E, in,
    out) stack as stored, then ``out.add_(bias[expert_ids_g])`` (the per-row bias gathered from the
    (E, out) stack, added in place); between them ``GptOssExperts._apply_gate``: the interleaved
    ``gate_up[..., ::2]`` / ``[..., 1::2]`` (strided views), ``gate.clamp(max=limit)``,
    ``up.clamp(-limit, limit)``, ``glu = gate * sigmoid(gate * alpha)``, ``(up + 1) * glu``. The routing
    weights (the router's dtype) multiply the fp32 or 16-bit expert output unsqueezed
    (`ops.mul_reduce_cast`), then un-permute, ``view(tokens, top_k, h).sum(1)`` and the cast back."""
    m = rec.m
    k, h, f, E = m.experts_top_k, m.hidden, m.expert_width, m.n_experts
    ids_sorted = g.alloc(tok(k), I64, "sort values (expert_ids_g)")
    perm = g.alloc(tok(k), I64, "sort indices (perm)")
    rows = g.alloc(tok(k), I64, "perm // top_k")
    sel = ops.index_rows(g, x, rows, tok(k * h), "hidden_states[perm // top_k]")
    g.drop(rows)
    sw = ops.index_rows(g, weights, perm, tok(k), "sample_weights[perm]")
    hist_in = g.alloc(tok(k), 4, "histc input")
    tpe = g.alloc(const(E), F32, "tokens_per_expert (histc)")
    offs = g.alloc(const(m.held_experts), I32, "offsets (cumsum)")
    sel, pidx = _ep_dispatch(rec, g, sel)
    w_gu = p["mlp.experts.gate_up_proj"]
    b_gu = ops.index_rows(g, p["mlp.experts.gate_up_proj_bias"], ids_sorted, tok(k * 2 * f), "gate_up_proj_bias[ids]")
    sel_c = ops.cast(g, sel, w_gu.dt, "input.to(weight.dtype)")
    gu0 = ops.grouped_mm(g, sel_c, w_gu, offs, tok(k * 2 * f), "grouped_mm gate_up_proj")
    g.drop(sel_c)
    gu = ops.add_(g, gu0, b_gu, "out.add_(bias)")
    gate_v, up_v = (ops.slice_view(g, gu, tok(k * f), f"gate_up[..., {i}::2]") for i in (0, 1))
    gate = ops.clamp(g, gate_v, False, "gate.clamp(max=limit)")
    up = ops.clamp(g, up_v, True, "up.clamp(-limit, limit)")
    g.drop(gate_v, up_v)
    ga = ops.scalar_op(g, gate, "gate * alpha")
    sig = ops.unary_saving_output(g, ga, "sigmoid")
    g.drop(ga)
    glu = ops.mul(g, gate, sig, "gate * sigmoid")
    g.drop(sig)
    up1 = ops.scalar_op(g, up, "up + 1", grad_allocs=False)
    gated = ops.mul(g, up1, glu, "(up + 1) * glu")
    g.drop(up1, gate, up, glu, gu)  # _apply_gate returns; `proj_out` rebinds
    w_d = p["mlp.experts.down_proj"]
    b_d = ops.index_rows(g, p["mlp.experts.down_proj_bias"], ids_sorted, tok(k * h), "down_proj_bias[ids]")
    g.drop(b_gu)  # `selected_biases` rebinds
    gated_c = ops.cast(g, gated, w_d.dt, "input.to(weight.dtype)")
    d0 = ops.grouped_mm(g, gated_c, w_d, offs, tok(k * h), "grouped_mm down_proj")
    g.drop(gated_c, gated)
    down = _ep_combine(g, ops.add_(g, d0, b_d, "out.add_(bias)"), pidx)
    weighted = ops.mul_reduce_cast(g, down, sw, "proj_out * sample_weights_g")
    inv = g.alloc(tok(k), I64, "inv_perm (empty_like)")
    ar = g.alloc(tok(k), I64, "arange")
    g.drop(ar)
    unperm = ops.index_rows(g, weighted, inv, tok(k * h), "weighted_out[inv_perm]")
    g.drop(weighted)
    v3 = ops.heads_view(g, unperm, "view(tokens, top_k, h)", clone_grad=True)
    summed = ops.sum_keepdim(g, v3, tok(h), "sum over top_k")
    g.drop(v3)
    out = ops.cast(g, summed, x.dt, "to(hidden_states.dtype)")
    g.drop(ids_sorted, perm, sel, sw, hist_in, tpe, offs, b_d, down, unperm, inv, summed, pidx)
    return out


def deepseek_moe(rec: DecoderRecipe, g: Graph, x: T, p: dict[str, T]) -> T:
    """``DeepseekV3MoE.forward``: the router (`deepseek_router`), the routed experts (mixtral's
    `experts`: ``grouped_mm_experts_forward`` with (E, out, in) stacks; the routing weights, in the
    router's dtype, multiply the expert output unsqueezed: `ops.mul_reduce_cast`), ``.view`` back,
    ``+ shared_experts(residuals)`` (a gated MLP on the block's input)."""
    logits, weights, index = deepseek_router(rec, g, x, p)
    routed = experts(rec, g, x, index, weights, p, ops.mul_reduce_cast)
    if rec.m.n_shared_experts:
        shared = _shared_experts(rec, g, x, p)
        out = ops.add(g, routed, shared, "routed + shared_experts")
        g.drop(routed, shared)
    else:
        out = routed
    g.drop(logits, weights, index)  # the block's locals (``_``: the router logits)
    return out


def _shared_experts(rec: DecoderRecipe, g: Graph, x: T, p: dict[str, T]) -> T:
    """``DeepseekV3MLP.forward`` of the shared experts: ``down(act(gate(x)) * up(x))``."""
    m = rec.m
    f = m.expert_width * m.n_shared_experts
    gt = rec.linear(g, x, p, "mlp.shared_experts.gate_proj", m.hidden, f)
    a = rec.act(g, gt)
    g.drop(gt)
    u = rec.linear(g, x, p, "mlp.shared_experts.up_proj", m.hidden, f)
    pr = ops.mul(g, a, u, "act * up")
    g.drop(a, u)
    out = rec.linear(g, pr, p, "mlp.shared_experts.down_proj", f, m.hidden)
    g.drop(pr)
    return out


def deepseek_router(rec: DecoderRecipe, g: Graph, x: T, p: dict[str, T]) -> tuple[T, T, T]:
    """``DeepseekV3TopkRouter.forward``: ``F.linear(h.type(float32), weight.type(float32))`` (the weight
    is fp32; autocast still runs the linear in 16 bit), ``sigmoid``, ``+ e_score_correction_bias`` (fp32:
    promotes), the group scores (``topk(2)`` per group, summed), the top groups (``topk``), their mask
    (``zeros_like``, ``scatter_``, expanded and reshaped to (tokens, E): a copy, ``bool()``, ``~``),
    ``masked_fill(-inf)``, ``topk`` of it for the indices, ``scores.gather`` of the weights, renormalised
    in place (``/= sum + 1e-20``) and times ``routed_scaling_factor``. Only the gathered scores reach the
    loss: the selection branch records no graph a backward would keep (its nodes die with their outputs).
    Returns (logits, weights, indices); the other locals die when it returns."""
    m, ctx = rec.m, rec.ctx
    k, E = m.experts_top_k, m.n_experts
    G = m.n_expert_groups or 1
    tg = m.topk_groups or G
    w = p["mlp.gate.weight"]
    a_w = p.get("mlp.gate.lora_A.weight")
    delta = None
    if a_w is not None:  # peft's ParamWrapper of gate.weight: delta and check on entry, the merged weight when read
        delta = ops.lora_param_delta(g, ctx, w, a_w, p["mlp.gate.lora_B.weight"], rec.t.lora_rank, "mlp.gate")
        ops.lora_param_check(g, w, delta, "mlp.gate")
    flat = ops.alias_view(g, x, "view(-1, h)")  # a view node of its own (its backward runs after the casts')
    xf = ops.cast(g, flat, F32, "hidden_states.type(float32)")
    g.drop(flat)
    if delta is not None:
        w = ops.lora_param_merge(g, w, delta, "mlp.gate", checked=True)
    logits = ops.linear(g, ctx, xf, w, m.hidden, E, None, "mlp.gate", w_leaf=delta is None)
    g.drop(xf)  # an argument temporary (a copy only when the input is 16-bit)
    scores = ops.unary_saving_output(g, logits, "sigmoid")
    dt_choice = max(scores.dt, F32)
    choice = g.alloc(tok(E), dt_choice, "scores + e_score_correction_bias")
    g2v = g.alloc(tok(G * 2), dt_choice, "group topk(2) values")
    g2i: T | None = g.alloc(tok(G * 2), I64, "group topk(2) indices")
    if not g.saving:  # not saved (a checkpointed forward): the indices die with the (values, indices) tuple
        g.drop(g2i)
        g2i = None
    group_scores = g.alloc(tok(G), dt_choice, "group_scores (sum)")
    g.drop(g2v)
    gv = g.alloc(tok(tg), dt_choice, "group topk values")
    group_idx = g.alloc(tok(tg), I64, "group_idx")
    g.drop(gv)
    group_mask = g.alloc(tok(G), dt_choice, "group_mask (zeros_like)")
    # the (tokens, G, E/G) expansion reshapes to (tokens, E) as a view only when one of G, E/G is 1
    score_mask = (g.alloc(tok(E), dt_choice, "score_mask (reshape copy)") if 1 < G < E
                  else g.view(group_mask, "score_mask (reshape view)", n=tok(E)))
    sb = g.alloc(tok(E), 1, "score_mask.bool()")
    inv: T | None = g.alloc(tok(E), 1, "~score_mask")
    g.drop(sb)
    masked = g.alloc(tok(E), dt_choice, "masked_fill")
    if not g.saving:  # masked_fill's mask is saved only when the forward saves
        g.drop(inv)
        inv = None
    g.drop(choice)  # `scores_for_choice` rebinds; masked_fill's node keeps the mask while its output lives
    tv = g.alloc(tok(k), dt_choice, "topk values")
    index = g.alloc(tok(k), I64, "topk_indices")
    g.drop(tv)
    gathered = ops.index_rows(g, scores, index, tok(k), "scores.gather")
    if m.norm_topk_prob:
        total = ops.sum_keepdim(g, gathered, tok(1), "topk_weights.sum")
        den = ops.scalar_op(g, total, "+ 1e-20", grad_allocs=False)
        g.drop(total)
        normed = ops.div_(g, gathered, den, "topk_weights /= denominator")
        g.drop(gathered)  # the same tensor: `/=` rebinds the name
        gathered = normed
    else:
        den = None
    weights = ops.scalar_op(g, gathered, "* routed_scaling_factor")
    g.drop(gathered)
    g.drop(scores, masked, inv, g2i, group_scores, group_idx, group_mask, score_mask, den)
    if delta is not None:  # the parametrization's merged weight, then the delta, when the router returns
        g.drop(w, delta)
    return logits, weights, index


#: The mixture-of-experts blocks a description names (`trainmem_nb.model.families.Description.moe`).
MOES: dict[str, Callable[[DecoderRecipe, Graph, T, dict[str, T]], T]] = {
    "mixtral": moe_mlp, "qwen3_moe": qwen3_moe_mlp, "gpt_oss": gpt_oss_moe, "deepseek": deepseek_moe}
