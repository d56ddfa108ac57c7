"""The language-model head's loss: as transformers computes it, and the memory-efficient losses people
switch on instead (torchtune's chunked loss, Liger's fused linear cross-entropy, Cut Cross-Entropy,
lit-gpt's chunked head and cross-entropy).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..engine import ops
from ..engine.ops import F32, I64
from ..engine.tape import Graph, Sz, T, const
from ..spec.choices import LossImpl
from ..spec.training import TrainingSpec
from .base import tok

LITGPT_VERSION = "0.5.13"  # Lightning-AI/litgpt@26857050, litgpt/model.py, litgpt/utils.py, litgpt/finetune/lora.py
#: lit-gpt's finetune scripts run the head and the loss in chunks of 128 tokens: ``model(input_ids,
#: lm_head_chunk_size=128)`` (litgpt 0.5.13 litgpt/finetune/lora.py line 355, also full.py, adapter.py) and
#: ``chunked_cross_entropy(..., chunk_size=128)`` (litgpt/utils.py line 305)
LITGPT_CHUNK = 128


def causal_lm_loss(g: Graph, ctx: ops.Ctx, logits: T, vocab: int, v4_upcast: bool = True) -> tuple[T, T]:
    """The causal-LM loss on the head's `logits` as the transformers version computes it
    (`ops.Ctx.causal_lm_loss`, `CausalLMLoss`); returns (loss, the logits the model outputs).

    * ``labels-shifted`` (4.49 and later, ForCausalLMLoss): logits upcast to fp32, labels padded and
      shifted, then ``cross_entropy`` = log_softmax (saves its fp32 result) + nll_loss (mean);
    * ``logits-shifted`` (4.46-4.48): the same upcast, then ``shift_logits = logits[..., :-1, :].contiguous()``,
      an fp32 copy (a view with one sequence), whose ``slice_backward`` makes a full-size fp32 gradient;
    * ``model-upcast`` (4.31-4.45): the model itself runs ``logits = logits.float()`` (its 16-bit logits go)
      and returns the fp32 logits, then shifts them as above;
    * ``no-upcast`` (4.30 and before): the shifted copy in the head's dtype; under autocast log_softmax
      casts it to fp32 (an autocast fp32 op), without it the loss runs in the head's dtype.

    A family whose 4.x head never upcast (`Description.v4_upcast`: GPT-2, OPT, GPT-NeoX) runs ``no-upcast``
    for every version before 4.49. Under Megatron-LM the model computes its own loss (``megatron``,
    `megatron_cross_entropy`)."""
    variant = ctx.causal_lm_loss
    if variant in ("megatron", "megatron-fused"):
        return megatron_cross_entropy(g, logits, fused=variant == "megatron-fused"), logits
    if not v4_upcast and variant in ("logits-shifted", "model-upcast"):
        variant = "no-upcast"
    if variant == "labels-shifted":
        lf = ops.cast(g, logits, F32, "logits.float()")
        pad, shift = _shifted_labels(g, ctx.batch1)
        loss, ls, total_weight = _cross_entropy(g, lf, shift)
        g.drop(ls, shift, total_weight, lf, pad)
        return loss, logits
    out = logits
    src = g.hold(logits)
    if variant in ("logits-shifted", "model-upcast"):
        g.drop(src)
        src = ops.cast(g, logits, F32, "logits.float()")
        if variant == "model-upcast":  # `logits = logits.float()` in the model: the output is the fp32 copy
            g.drop(logits)
            out = g.hold(src)
    shifted = ops.slice_view(g, src, src.n + Sz(b_=-vocab), "logits[..., :-1, :]")
    if not ctx.batch1:  # one sequence: the slice is already contiguous
        copy = ops.clone(g, shifted, "shift_logits .contiguous()")
        g.drop(shifted)
        shifted = copy
    labels = g.alloc(Sz(bs=1, b_=-1), I64, "shift_labels") if not ctx.batch1 else None
    target = labels if labels is not None else g.alloc(const(0), I64, "shift_labels (a view)")
    x = shifted
    if variant == "no-upcast" and ctx.autocast is not None and shifted.dt != F32:
        x = ops.cast(g, shifted, F32, "autocast log_softmax input")  # log_softmax is an autocast fp32 op
    loss, ls, total_weight = _cross_entropy(g, x, target)
    # the function's locals go when it returns: the (upcast) logits, the shifted ones and the labels
    g.drop(ls, target, total_weight, shifted, *((x,) if x is not shifted else ()), src)
    return loss, out


def megatron_cross_entropy(g: Graph, logits: T, fused: bool = False) -> T:
    """Megatron-LM's loss (``GPTModel.compute_language_model_loss`` without ``cross_entropy_loss_fusion``:
    ``tensor_parallel.vocab_parallel_cross_entropy``, megatron/core/tensor_parallel/cross_entropy.py), one autograd
    Function on the rank's vocabulary slice of the 16-bit `logits`: ``vocab_parallel_logits.float()`` is made
    once and turned into the softmax in place (``-= logits_max``, ``torch.exp(..., out=)``, ``div_``), which
    it saves with the target mask and the masked target; backward writes the gradient into that saved softmax
    in place and returns it in fp32, which autograd casts to the logits' dtype (``validate_outputs``) before
    the softmax goes. The fused variant (`fused`: ``cross_entropy_loss_fusion``, fused_cross_entropy.py) saves the
    same and casts its gradient to bf16 itself, but its ``@jit_fuser`` functions hand back new tensors where the
    plain code works in place: the fp32 copy stays in the forward's local ``vocab_parallel_logits`` beside the
    softmax until forward returns (Megatron-LM's CI: the fused tp2 x pp2 case peaks 391 MiB above the same case
    unfused, one fp32 copy of the rank's logits being 394 MiB). The labels and the loss are transposed to (s, b)
    and back."""
    per_token = Sz(bs=1)
    labels = g.alloc(per_token, I64, "labels.transpose(0, 1).contiguous()")
    upcast = g.alloc(logits.n, F32, "vocab_parallel_logits.float() (jit-fused: kept beside its exp)") if fused else None
    softmax = g.alloc(logits.n, F32, "exp_logits (the softmax)" if fused else
                      "vocab_parallel_logits.float() (the softmax, in place)")
    logits_max = g.alloc(per_token, F32, "logits_max")
    target_mask = g.alloc(per_token, ops.BOOL, "target_mask")
    masked_target = g.alloc(per_token, I64, "masked_target")
    arange = g.alloc(per_token, I64, "arange_1d")
    picked = g.alloc(per_token, F32, "logits_2d[arange_1d, masked_target_1d]")
    predicted = g.alloc(per_token, F32, "predicted_logits .clone()")
    g.drop(picked)
    sum_exp = g.alloc(per_token, F32, "sum_exp_logits")
    log_sum = g.alloc(per_token, F32, "torch.log(sum_exp_logits)")
    loss_sb = g.alloc(per_token, F32, "loss (s, b)")
    g.drop(log_sum, logits_max, arange, predicted, sum_exp, upcast)
    n = logits.n

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        update = g.alloc(per_token, F32, "softmax_update")
        rows = g.alloc(per_token, I64, "arange_1d (backward)")
        g.drop(update, rows)
        # the gradient is the saved softmax itself, returned in fp32: autograd's cast to the logits' dtype
        return [g.alloc(n, logits.dt, "vocab_parallel_cross_entropy backward (cast to the logits' dtype)")]

    g.record("vocab_parallel_cross_entropy", [logits], [loss_sb], [softmax, target_mask, masked_target], bwd)
    g.drop(softmax, target_mask, masked_target)
    loss = ops.clone(g, loss_sb, "loss.transpose(0, 1).contiguous()")
    g.drop(loss_sb, labels)
    return loss


# -- the losses of the other heads: masked LM, sequence classification ---------------------------
def masked_lm_loss(g: Graph, ctx: ops.Ctx, scores: T, labels: T) -> T:
    """``CrossEntropyLoss()(prediction_scores.view(-1, V), labels.view(-1))``: ``log_softmax`` (saves
    its result) + ``nll_loss`` (mean; saves the target and ``total_weight``), on the scores' dtype
    (no upcast by HF).

    Under autocast the scores are 16-bit: CPU autocast runs ``cross_entropy_loss`` in fp32 (its fp32
    list), so an fp32 copy lives for the whole loss; CUDA autocast has no rule for the composite op
    but runs ``log_softmax`` in fp32 (fp32_set_opt_dtype: ``log_softmax(x, dtype=fp32)`` casts x),
    so the copy dies as soon as ``log_softmax`` returns."""
    upcast = ctx.autocast is not None and scores.dt != F32
    src = ops.cast(g, scores, F32, "cross_entropy autocast fp32") if upcast else g.hold(scores)
    ls = g.alloc(src.n, src.dt, "log_softmax")

    def ls_bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(src.n, src.dt, "log_softmax backward")]

    g.record("log_softmax", [src], [ls], [ls, src] if g.softmax_saves_input else [ls], ls_bwd)
    if ctx.cuda:
        g.drop(src)
    loss = g.alloc(const(1), src.dt, "loss")
    total_weight = g.alloc(const(1), src.dt, "nll total_weight")

    def nll_bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(src.n, src.dt, "nll_loss backward"), None]

    g.record("nll_loss", [ls, labels], [loss, total_weight], [labels, total_weight], nll_bwd)
    g.drop(ls, total_weight)
    if not ctx.cuda:
        g.drop(src)
    return loss



def mse_loss(g: Graph, ctx: ops.Ctx, pred: T, target: T) -> T:
    """``MSELoss()(logits.squeeze(), labels.squeeze())`` (views): saves both; backward makes the
    prediction's gradient (under autocast ``mse_loss`` runs in fp32: a cast copy of the prediction)."""
    src = ops.cast(g, pred, F32, "mse_loss autocast fp32") if ctx.autocast is not None and pred.dt != F32 else g.hold(pred)
    loss = g.alloc(const(1), F32, "mse_loss")
    n = src.n

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(n, F32, "mse_loss backward"), None]

    g.record("mse_loss", [src, target], [loss], [src, target], bwd)
    g.drop(src)
    return loss



def classifier_labels(g: Graph, num_labels: int) -> T:
    """A classifier's labels, an input of one value per sequence (int64; fp32 to regress): counted before the
    step (`trainmem_nb.step.compile`), never freed."""
    return g.external(Sz(b_=1), 8 if num_labels > 1 else F32, "labels")


def sequence_classification_loss(g: Graph, ctx: ops.Ctx, pooled: T, labels: T, num_labels: int) -> T:
    """transformers' loss of a ``*ForSequenceClassification`` head on its pooled logits: cross-entropy in their
    dtype (``fixed_cross_entropy``, BertForSequenceClassification's ``CrossEntropyLoss``), or for one label
    ``MSELoss`` (regression; loss_utils.py ForSequenceClassificationLoss)."""
    if num_labels > 1:
        return masked_lm_loss(g, ctx, pooled, labels)
    return mse_loss(g, ctx, pooled, labels)


# -- memory-efficient losses people switch on (TrainingSpec.loss_impl) ------------------------------
#: Versions the fused losses are modelled from (their sources, read line by line; neither can run on the
#: CPU this project is measured on: both are Triton kernels).
LIGER_VERSION = "0.8.2"  # linkedin/Liger-Kernel@ead96b61, src/liger_kernel/ops/fused_linear_cross_entropy.py
CCE_VERSION = "25.6.4"  # apple/ml-cross-entropy@d42911f9, cut_cross_entropy/cce.py, cce_backward.py


def liger_chunk_rows(tokens: int, hidden: int, vocab: int) -> int:
    """Rows of one Liger logits chunk: ``inc_factor = cdiv(V, H)``, ``chunk_size =
    next_power_of_2(cdiv(BT, inc_factor))`` (fused_linear_cross_entropy.py:64-70)."""
    inc = -(-vocab // hidden)
    rows = -(-tokens // inc)
    return 1 << max(0, (rows - 1).bit_length())


def _shifted_labels(g: Graph, batch1: bool) -> tuple[T, T]:
    """transformers' label shift (``ForCausalLMLoss``, also Liger's ``LigerForCausalLMLoss``):
    ``F.pad(labels, (0, 1))`` then ``labels[..., 1:].contiguous()`` (a view with one sequence)."""
    pad = g.alloc(Sz(bs=1, b_=1), I64, "labels pad")
    shift = g.view(pad, "shift_labels", n=tok(1)) if batch1 else g.alloc(tok(1), I64, "shift_labels")
    return pad, shift


def _cross_entropy(g: Graph, lf: T, target: T, prefix: str = "", loss_n: Sz | None = None) -> tuple[T, T, T]:
    """``F.cross_entropy`` on logits `lf` (fp32, or the head's dtype without an upcast): ``log_softmax``
    (saves its output), then ``nll_loss`` (saves the target and its total weight), in `lf`'s dtype; its
    loss has `loss_n` elements (``reduction="none"``: one per row), else one. Returns (loss,
    log-probabilities, total weight); the caller lets the last two go."""
    dt = lf.dt
    ls = g.alloc(lf.n, dt, f"{prefix}log_softmax")
    n = lf.n

    def ls_bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(n, dt, f"{prefix}log_softmax backward")]

    g.record(f"{prefix}log_softmax", [lf], [ls], [ls, lf] if g.softmax_saves_input else [ls], ls_bwd)
    loss = g.alloc(const(1) if loss_n is None else loss_n, dt, f"{prefix}loss")
    total_weight = g.alloc(const(1), dt, f"{prefix}nll total_weight")

    def nll_bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(n, dt, f"{prefix}nll_loss backward"), None]

    g.record(f"{prefix}nll_loss", [ls, target], [loss, total_weight], [target, total_weight], nll_bwd)
    return loss, ls, total_weight


def liger_fused_linear_cross_entropy(g: Graph, ctx: ops.Ctx, h: T, w: T, hidden: int, vocab: int, tokens: int) -> T:
    """Liger's fused linear cross-entropy (``apply_liger_kernel_to_*``, or ``use_liger_kernel=True`` in
    the HF Trainer): no logits over the whole batch. The forward walks the tokens in chunks, computes
    each chunk's logits, writes their gradient in place (the CE kernel), and accumulates the input's
    and the weight's gradients then and there (``grad_input`` (BT, H) in the hidden dtype, always;
    ``grad_weight`` (V, H) in the weight's dtype when it is trained); backward only scales them in place.
    Two logits chunks are alive while the next is computed (``logits_chunk`` is rebound before
    ``grad_logits_chunk`` lets the old one go). Under autocast (no ``cast_inputs``) the matmuls run in
    16 bits: a trained fp32 weight's cast is autocast's cached copy, a frozen one is cast per matmul, and
    with an fp32 ``grad_weight`` and 16-bit logits the update is ``addmm(out_dtype=fp32)`` into it (torch
    >= 2.8, compute capability >= 8: fused_linear_cross_entropy.py:235-255); otherwise each chunk makes a
    (V, H) product and its ``.float()`` copy before adding (:257). Modelled from Liger 0.8.2."""
    rows = liger_chunk_rows(tokens, hidden, vocab)
    n_chunks = -(-tokens // rows)
    pad, shift = _shifted_labels(g, ctx.batch1)
    trains_w = w.rg
    grad_input = g.alloc(h.n, h.dt, "liger grad_input")
    grad_weight = g.alloc(w.n, w.dt, "liger grad_weight") if trains_w else None
    loss_1d = g.alloc(tok(1), F32, "liger loss_1d")
    mask = g.alloc(tok(1), ops.BOOL, "liger target_mask")
    g.drop(mask)  # target_mask.sum().item()
    cdt = ctx.autocast if ctx.autocast is not None else max(h.dt, w.dt)
    wc = ops.autocast_weight(g, ctx, w) if ctx.autocast is not None and trains_w else None
    fast = grad_weight is not None and grad_weight.dt == F32 and cdt == ops.F16
    prev: T | None = None
    def matmul_weight() -> T | None:  # the weight as a 16-bit matmul operand under autocast
        if ctx.autocast is None or w.dt == ctx.autocast:
            return None
        return g.hold(wc) if wc is not None else ops.cast(g, w, ctx.autocast, f"autocast {w.label}")

    for i in range(min(n_chunks, 2)):  # every later chunk repeats the second's allocations (the last may be shorter)
        r = min(rows, tokens - i * rows)
        chunk_n, chunk_h = const(r * vocab), const(r * hidden)
        xin = g.alloc(chunk_h, cdt, f"liger chunk {i} input cast") if ctx.autocast is not None and h.dt != cdt else None
        wm = matmul_weight()
        logits = g.alloc(chunk_n, cdt, f"liger logits chunk {i}")
        g.drop(xin, wm)
        g.drop(prev)  # grad_logits_chunk = logits_chunk: the last chunk's buffer goes
        prev = logits
        wm = matmul_weight()
        gi = g.alloc(chunk_h, cdt, f"liger chunk {i} grad_logits @ weight")
        g.drop(gi, wm)  # copied into grad_input's rows
        if grad_weight is not None:
            if fast:
                xc = g.alloc(chunk_h, cdt, f"liger chunk {i} input.to(16-bit)") if h.dt != cdt else None
                g.drop(xc)
            else:
                prod = g.alloc(w.n, cdt, f"liger chunk {i} grad_logits.t() @ input")
                up = g.alloc(w.n, F32, f"liger chunk {i} .float()") if cdt != F32 else None
                g.drop(prod, up)
    g.drop(prev, loss_1d)
    loss = g.alloc(const(1), F32, "loss")
    g.drop(pad, shift)
    saved = [grad_input, grad_weight]

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:  # element_mul_kernel in place
        return [g.hold(grad_input), g.hold(grad_weight) if grad_weight is not None else None]

    g.record("liger fused linear cross-entropy", [h, w], [loss], saved, bwd)
    g.drop(grad_input, grad_weight, wc)
    return loss


def cut_cross_entropy(g: Graph, ctx: ops.Ctx, h: T, w: T, hidden: int, vocab: int) -> T:
    """Apple's Cut Cross-Entropy (``cce_patch``, impl ``"cce"``): nothing of (tokens, vocab) is ever
    allocated. Under autocast the forward casts the hidden state and the classifier to 16 bits itself
    (new copies, not autocast's cache; cce.py:71-76) and saves them with the per-token log-sum-exp, the
    targets, the valid-row indices and the vocabulary's average logit; labels are shifted by indexing,
    not copied. Backward allocates the hidden state's and the classifier's gradients in the saved
    dtype and casts them back to the originals' dtype (cce_backward.py:390-394, 511-519), both
    copies alive at the cast. Modelled from CCE 25.6.4 (default settings: no fp32 accumulation)."""
    cdt = ctx.autocast if ctx.autocast is not None else None
    # inside the autograd Function: plain copies, no autograd nodes of their own
    e = g.alloc(h.n, cdt, "cce e.to(autocast dtype)") if cdt is not None and h.dt != cdt else g.hold(h)
    c = g.alloc(w.n, cdt, "cce c.to(autocast dtype)") if cdt is not None and w.dt != cdt else g.hold(w)
    nz = g.alloc(tok(2), I64, "cce (targets != ignore).nonzero()")
    valids = g.alloc(tok(1), 4, "cce valids")
    g.drop(nz)
    lse = g.alloc(tok(1), F32, "cce lse")
    logit_avg = g.alloc(const(vocab), F32, "cce logit_avg")
    nll = g.alloc(tok(1), F32, "cce neg_dot + lse")
    loss = g.alloc(const(1), F32, "loss")
    g.drop(nll)
    saved = [e, c, lse, valids, logit_avg]
    e_dt, c_dt, trains_w = e.dt, c.dt, w.rg

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        order = g.alloc(const(vocab), I64, "cce argsort(logit_avg)")
        order32 = g.alloc(const(vocab), 4, "cce vocab_ordering")
        g.drop(order)
        de = g.alloc(h.n, e_dt, "cce de")
        dc = g.alloc(w.n, c_dt, "cce dc") if trains_w else None
        g.drop(order32)
        gh = de
        if h.dt != e_dt:
            gh = g.alloc(h.n, h.dt, "cce de.to(e dtype)")
            g.drop(de)
        gw = dc
        if dc is not None and w.dt != c_dt:
            gw = g.alloc(w.n, w.dt, "cce dc.to(c dtype)")
            g.drop(dc)
        return [gh, gw]

    g.record("cut cross-entropy", [h, w], [loss], saved, bwd)
    g.drop(e, c, lse, valids, logit_avg)
    return loss


#: torchtune's version the chunked loss is modelled from (torchtune/modules/loss/cross_entropy_loss.py).
TORCHTUNE_VERSION = "0.7.0"  # pytorch/torchtune@bd2a0fc7


def torchtune_rows_symbolic(hidden: int, chunks: int, vocab: int | None = None) -> bool:
    """Are the chunked loss's row counts kept symbolic (whole-number coefficients for the hidden and the
    vocabulary widths)?"""
    return hidden % chunks == 0 and (vocab is None or vocab % chunks == 0)


def torchtune_chunk_rows(tokens: int, chunks: int, hidden: int, vocab: int) -> list[Sz]:
    """Rows of each chunk of ``tensor_split(chunks)`` over `tokens` rows: the first ``tokens % chunks`` one row
    longer. Symbolic in the batch shape (``(b s - r) / chunks`` rows, r = tokens % chunks) where `hidden` and
    `vocab` are multiples of `chunks` (whole-number sizes), so one program serves every batch shape with the same residue
    (`trainmem_nb.step.compile.program_key`); otherwise the rows of this token count."""
    r = tokens % chunks
    if not torchtune_rows_symbolic(hidden, chunks, vocab):
        return [const(tokens // chunks + (i < r)) for i in range(chunks)]
    return [Sz(bs=1 / chunks, c0=(i < r) - r / chunks) for i in range(chunks)]


def chunked_linear_cross_entropy(g: Graph, ctx: ops.Ctx, h: T, w: T, hidden: int, vocab: int, chunks: int,
                                 tokens: int) -> T:
    """torchtune's ``LinearCrossEntropyLoss`` (its recipes' default; eager, ``compile: False``): the model
    skips its output layer; the loss keeps the rows of valid targets (``index_select``: a copy of the
    hidden state), splits them into `chunks` (views) and, chunk by chunk, projects to the vocabulary,
    upcasts to fp32 and takes ``cross_entropy(reduction="sum")``, whose ``log_softmax`` keeps its fp32
    output for backward: chunking lowers the transient peak, not what is saved (all chunks' fp32
    log-probabilities, as many as one full fp32 copy of the logits). Labels come shifted from the
    dataset (on the host); every token is taken as valid. Modelled from torchtune 0.7.0 (eager) and
    measured (`trainmem_nb.measure.losses` runs the same statements; tests/test_loss_impl.py)."""
    mask = g.alloc(tok(1), ops.BOOL, "targets != ignore_index")
    count = g.alloc(tok(1), I64, "torch.where(mask)[0]")
    g.drop(count)
    idx = g.alloc(tok(1), I64, "valid indices")
    g.drop(mask)
    kept = g.alloc(h.n, h.dt, "hidden.index_select(valid)")
    n_h = h.n

    def sel_bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:  # zeros(...).index_add_(0, idx, grad)
        return [g.alloc(n_h, h.dt, "index_select backward"), None]

    g.record("index_select", [h, idx], [kept], [idx], sel_bwd)
    tgt = g.alloc(tok(1), I64, "target.index_select(valid)")
    g.drop(idx)
    # tensor_split: the first tokens % chunks chunks one row longer (the program keeps the batch shape)
    parts = ops.split(g, kept, (), "tensor_split", sizes=[n * hidden for n in torchtune_chunk_rows(tokens, chunks, hidden, vocab)])
    g.drop(kept)
    total = g.alloc(const(1), F32, "total_loss = torch.tensor(0.0)")
    for i, part in enumerate(parts):
        logits = ops.linear(g, ctx, part, w, hidden, vocab, None, f"chunk {i} output")
        lf = ops.cast(g, logits, F32, f"chunk {i} logits.float()")
        loss_i, ls, tw = _cross_entropy(g, lf, tgt, f"chunk {i} ")
        g.drop(ls, tw, lf, logits)  # cross_entropy and compute_cross_entropy return: the fp32 copy, the logits go
        total = ops.add_(g, total, loss_i, f"total_loss += chunk {i} loss")
        g.drop(loss_i)
    g.drop(*parts)  # the tuple of chunks (views of the kept rows) lives until the loop ends
    loss = ops.scalar_op(g, total, "total_loss / total_valid_tokens")
    g.drop(total, tgt)
    return loss


def litgpt_chunks(seq: int) -> int:
    """How many chunks ``x.split(128, dim=1)`` makes of `seq` tokens."""
    return -(-seq // LITGPT_CHUNK)


def _litgpt_tokens(seq: int, cut: bool = False) -> list[Sz]:
    """Tokens (b x length) of each chunk of ``x.split(128, dim=1)``, symbolic in the batch shape: b x 128 each,
    the last ``b x (s - 128 (n - 1))``, one token fewer when the loop has `cut` it. A program then serves every
    sequence length with the same number of chunks (`trainmem_nb.step.compile.program_key`)."""
    n = litgpt_chunks(seq)
    full = LITGPT_CHUNK * (n - 1)
    return [Sz(b_=LITGPT_CHUNK)] * (n - 1) + [Sz(bs=1, b_=-(full + cut))]


def litgpt_head_chunks(g: Graph, ctx: ops.Ctx, h: T, w: T, hidden: int, vocab: int, batch: int, seq: int,
                       softcap: bool = False) -> list[T]:
    # `batch` only tells one sequence from several (the program key's micro-batch), `seq` the chunk count
    """lit-gpt's ``GPT.forward(..., lm_head_chunk_size=128)``: ``[lm_head(x_i) for x_i in x.split(128,
    dim=1)]``, one logits tensor per 128 tokens (under autocast a frozen head is cast again for every chunk,
    and each copy is kept for backward), soft-capped chunk by chunk where the model caps its final logits
    (`softcap`). With several sequences a chunk is not viewable as rows: ``matmul`` folds it with a copy, unless autocast's
    cast already made one. Returns the list the model returns (the loop's ``logits``)."""
    tokens = _litgpt_tokens(seq)
    parts = ops.split(g, h, (), "x.split(lm_head_chunk_size, dim=1)", sizes=[n * hidden for n in tokens])
    strided = batch > 1 and len(tokens) > 1
    out = []
    for i, xi in enumerate(parts):
        src = xi
        if strided and (ctx.autocast is None or xi.dt == ctx.autocast):
            src = ops.clone(g, xi, f"lm_head chunk {i} input reshape (a copy)")
        logits = ops.linear(g, ctx, src, w, hidden, vocab, None, f"lm_head chunk {i}")
        g.drop(*((src,) if src is not xi else ()), xi)
        if softcap:  # clamp_head = do_softcapping: ``torch.tanh(x / thresh) * thresh`` (litgpt/model.py)
            ld = ops.scalar_op(g, logits, f"chunk {i} logits / thresh")
            g.drop(logits)
            lt = ops.unary_saving_output(g, ld, f"chunk {i} logits tanh")
            g.drop(ld)
            logits = ops.scalar_op(g, lt, f"chunk {i} logits * thresh")
            g.drop(lt)
        out.append(logits)
    return out


def litgpt_cut_last(g: Graph, logits: list[T], seq: int, vocab: int) -> None:
    """The loop's ``logits[-1] = logits[-1][..., :-1, :]`` (a view; its backward a full-size chunk gradient)."""
    last = logits[-1]
    logits[-1] = ops.slice_view(g, last, _litgpt_tokens(seq, cut=True)[-1] * vocab, "logits[-1][..., :-1, :]")
    g.drop(last)


def fabric_convert_output(g: Graph, output: Sequence[T]) -> list[T]:
    """Fabric's ``_FabricModule.forward`` after the forward context (lightning 2.4 fabric/wrappers.py:138,
    ``precision.convert_output``: every precision plugin but 32-true casts floating outputs to the default
    dtype, fp32): a new list of fp32 chunks, then the model's 16-bit ones go."""
    out = [ops.cast(g, x, F32, "Fabric convert_output .to(float32)") for x in output]
    g.drop(*output)
    return out


def litgpt_chunked_cross_entropy(g: Graph, ctx: ops.Ctx, logits: Sequence[T], batch: int, seq: int) -> T:
    """lit-gpt's ``chunked_cross_entropy(logits, targets[..., 1:])`` on the chunked head's list: each chunk
    ``reshape(-1, vocab)`` (the cut last one copied with several sequences), the targets split alike (copied
    with several sequences), ``cross_entropy(reduction="none")`` per chunk in the logits' dtype (fp32 after
    Fabric's conversion; the loop runs it outside the forward's autocast), then ``torch.cat(loss_chunks).sum() /
    non_masked_elems.maximum(torch.ones_like(non_masked_elems))``. Modelled from litgpt 0.5.13
    (litgpt/utils.py lines 302-331) and measured (`trainmem_nb.measure.losses` runs the same statements)."""
    tokens = _litgpt_tokens(seq, cut=True)
    several = batch > 1
    logit_chunks = list(logits)
    if several:  # the last chunk, cut by the loop, is not viewable as rows
        logit_chunks[-1] = ops.clone(g, logits[-1], "logit_chunk.reshape(-1, vocab) (a copy)")
    else:
        g.hold(logit_chunks[-1])
    targets = [g.alloc(n, I64, "target_chunk.reshape(-1) (a copy)") if several
               else g.alloc(const(0), I64, "target_chunk (a view)") for n in tokens]
    loss_chunks = []
    for i, (lc, tc) in enumerate(zip(logit_chunks, targets, strict=True)):
        loss_i, ls, tw = _cross_entropy(g, lc, tc, f"chunk {i} ", loss_n=tokens[i])  # no autocast here
        g.drop(ls, tw)
        loss_chunks.append(loss_i)
    mask = g.alloc(Sz(bs=1, b_=-1), ops.BOOL, "targets != ignore_index")
    count = g.alloc(const(1), I64, "non_masked_elems")
    g.drop(mask)
    cat = ops.cat_last(g, ctx, loss_chunks, "torch.cat(loss_chunks)")
    total = ops.sum_keepdim(g, cat, const(1), ".sum()")
    g.drop(cat)
    ones = g.alloc(const(1), I64, "torch.ones_like(non_masked_elems)")
    denominator = g.alloc(const(1), I64, "non_masked_elems.maximum(...)")
    g.drop(ones)
    loss = g.alloc(const(1), total.dt, "/ non_masked_elems")

    def div_bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:  # grad / other
        return [g.alloc(const(1), total.dt, "/ non_masked_elems backward"), None]

    g.record("/ non_masked_elems", [total, denominator], [loss], [denominator], div_bwd)  # DivBackward0 saves other
    g.drop(denominator, total)
    # the function returns: its lists go (CPython frees a list's items last to first)
    g.drop(logit_chunks[-1], *reversed(targets), *reversed(loss_chunks), count)
    return loss


def fused_head_loss(g: Graph, ctx: ops.Ctx, t: TrainingSpec, h: T, w: T, hidden: int, vocab: int) -> T:
    """The head's projection and loss by `t.loss_impl` (not ``standard``): the loss, no logits."""
    if t.loss_impl is LossImpl.LIGER:
        return liger_fused_linear_cross_entropy(g, ctx, h, w, hidden, vocab, t.tokens)
    if t.loss_impl is LossImpl.CCE:
        return cut_cross_entropy(g, ctx, h, w, hidden, vocab)
    return chunked_linear_cross_entropy(g, ctx, h, w, hidden, vocab, t.loss_chunks, t.tokens)
