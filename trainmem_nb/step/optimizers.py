"""Optimizer state and the temporaries of ``optimizer.step()``, per implementation.

State follows each optimizer's ``state`` dict after its first step (steady state); temporaries follow
the PyTorch 2.x implementations in ``torch/optim/adam.py`` / ``adamw.py`` / ``sgd.py`` /
``_adafactor.py``: ``foreach`` runs multi-tensor ops over all parameters at once (its temporaries
exist for every parameter together), ``for-loop`` one parameter at a time (the largest ones count),
``fused`` one kernel with no temporaries. ``adafactor='transformers'`` is transformers.optimization.Adafactor,
the HF Trainer's ``optim="adafactor"``: a loop over the Trainer's parameter groups in fp32.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..device import CUDA_BLOCK_BYTES
from ..engine.breakdown import DETAIL_KEYS
from ..engine.tape import Sz, const
from ..model.params import ParamTensor, trainable_tensors
from ..model.spec import ModelSpec
from ..spec.choices import AdafactorImpl, Device, OptimizerImpl, OptimizerName
from ..spec.training import TrainingSpec

if TYPE_CHECKING:
    from ..engine.program import Segment

__all__ = ["BNB_PAGED_MIN_NUMEL", "STATE_TENSORS", "flat_state_bytes", "flat_update_temporaries", "optimizer_program",
           "paged_state_bytes", "state_bytes"]

_CAT = {k: i for i, k in enumerate(DETAIL_KEYS)}

#: Param-sized state tensors per parameter (element size = the parameter's, except 8-bit ones).
STATE_TENSORS = {
    OptimizerName.ADAMW: 2,  # exp_avg, exp_avg_sq
    OptimizerName.ADAM: 2,
    OptimizerName.SGD: 0,
    OptimizerName.SGD_MOMENTUM: 1,  # momentum_buffer
    OptimizerName.LION: 1,  # exp_avg (lucidrains/lion-pytorch)
    OptimizerName.PAGED_ADAMW: 2,  # bitsandbytes PagedAdamW (32-bit states in paged memory)
    OptimizerName.ADAMW_8BIT: 0,  # see _bnb8_state_bytes
    OptimizerName.ADAFACTOR: 0,  # see _adafactor_state_bytes
    OptimizerName.NONE: 0,
}

#: bitsandbytes 8-bit optimizers keep 32-bit state for tensors under 4096 elements (min_8bit_size)
#: and quantize block-wise with one fp32 absmax per 256 values (bitsandbytes/optim/optimizer.py).
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCK = 256


#: bitsandbytes' paged optimizers put a state tensor in CUDA unified memory (``F.get_paged``:
#: cudaMallocManaged, invisible to PyTorch's caching allocator and so to ``max_memory_allocated``)
#: when its parameter has at least 1e5 elements; smaller ones are ordinary ``zeros_like`` tensors
#: (``Optimizer8bit.get_state_buffer``, bitsandbytes/optim/optimizer.py). On CPU there is no paging.
BNB_PAGED_MIN_NUMEL = 100_000


def _paged(t: TrainingSpec, p: ParamTensor) -> bool:
    return t.optimizer is OptimizerName.PAGED_ADAMW and t.device is Device.CUDA and p.numel >= BNB_PAGED_MIN_NUMEL


def flat_state_bytes(t: TrainingSpec) -> float:
    """Bytes of optimizer state per element of a flat fp32 partition: DeepSpeed's ZeRO optimizers hand the
    optimizer one flat 1-D tensor per parameter group (``single_partition_of_fp32_groups``, stage_1_and_2.py;
    stage3.py's ``fp32_partitioned_groups_flat``), so Adafactor cannot factor it (a 1-D tensor keeps a full
    ``exp_avg_sq``) and an 8-bit optimizer quantizes it in 256-element blocks."""
    opt = t.optimizer
    if opt is OptimizerName.ADAFACTOR:
        return 4.0  # exp_avg_sq of a 1-D tensor (torch's and transformers' alike)
    if opt is OptimizerName.ADAMW_8BIT:
        return 2 + 2 * 4 / BNB_BLOCK  # two uint8 states and an fp32 absmax per block for each
    return 4.0 * STATE_TENSORS[opt]


def flat_update_temporaries(t: TrainingSpec, numel: int) -> int:
    """Peak bytes the optimizer's update allocates and frees on one flat fp32 partition of `numel` elements
    (DeepSpeed's ZeRO optimizers step a torch or bitsandbytes optimizer on such a 1-D tensor). AdamW:
    ``_foreach_sqrt`` makes one copy (``_multi_tensor_adamw``); the for-loop's ``exp_avg_sq.sqrt() /
    bias_correction2_sqrt`` holds the root and the quotient at once (``_single_tensor_adamw``; measured on CPU:
    ``sqrt`` then ``div`` of the partition, tests/test_parallel.py); fused kernels, bitsandbytes' and SGD's
    in-place updates none. Lion's ``sign`` of the interpolation and Adafactor's variance estimate of a 1-D
    tensor are one copy."""
    opt, impl = t.optimizer, t.resolved_optimizer_impl
    size = _round(numel * 4)
    if opt in (OptimizerName.ADAMW, OptimizerName.ADAM):
        return {OptimizerImpl.FOREACH: size, OptimizerImpl.FOR_LOOP: 2 * size}.get(impl, 0)
    if opt in (OptimizerName.LION, OptimizerName.ADAFACTOR):
        return size
    return 0


def paged_state_bytes(m: ModelSpec, t: TrainingSpec, shard: Shard | None = None) -> int:
    """Bytes of optimizer state in CUDA unified memory (bitsandbytes' paged optimizers): resident on
    the device, so nvidia-smi counts them, until memory runs short and the driver pages them to the host."""
    if t.optimizer is not OptimizerName.PAGED_ADAMW or t.device is not Device.CUDA:
        return 0  # only a paged optimizer on CUDA has any (`_paged`)
    k = STATE_TENSORS[t.optimizer]
    return sum(p.numel * 4 * k * p.count for p, _ in _params(m, t, shard) if _paged(t, p))


def _round(n: int) -> int:
    return -(-n // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES if n > 0 else 0


#: Maps a parameter to the part of it one rank's optimizer holds (data parallel sharding), or to None
#: when the rank holds none of it (another pipeline stage's).
Shard = Callable[[ParamTensor], "ParamTensor | None"]


def _params(m: ModelSpec, t: TrainingSpec, shard: Shard | None) -> list[tuple[ParamTensor, int]]:
    params = trainable_tensors(m, t)
    if shard is None:
        return params
    out = []
    for p, pdt in params:
        q = shard(p)
        if q is not None:
            out.append((q, pdt))
    return out


def state_bytes(m: ModelSpec, t: TrainingSpec, shard: Shard | None = None) -> list[tuple[Sz, int]]:
    """Bytes of every optimizer-state tensor alive before the step, as ``(bytes of one, count)``;
    with `shard`, of the rank's shards only (ZeRO-1 and up, FSDP)."""
    out: list[tuple[Sz, int]] = []
    opt = t.optimizer
    for p, pdt in _params(m, t, shard):
        k = STATE_TENSORS[opt]
        if _paged(t, p):
            continue  # unified memory, outside the allocator: `paged_state_bytes`
        if opt is OptimizerName.ADAMW_8BIT:
            if p.numel < BNB_MIN_8BIT_SIZE:
                out.append((const(_round(p.numel * 4)), 2 * p.count))
            else:
                out.append((const(_round(p.numel)), 2 * p.count))
                out.append((const(_round(-(-p.numel // BNB_BLOCK) * 4)), 2 * p.count))
            continue
        if opt is OptimizerName.ADAFACTOR and t.adafactor is AdafactorImpl.TRANSFORMERS:
            # its state in the fp32 gradient's dtype (``torch.zeros(...).to(grad)`` after ``grad.float()``), and
            # ``state["RMS"] = self._rms(p_data_fp32)``: a 0-dim fp32 tensor kept per parameter
            for nbytes in (*_adafactor_state(p, 4), 4):
                out.append((const(_round(nbytes)), p.count))
            continue
        if opt is OptimizerName.ADAFACTOR:
            for nbytes in _adafactor_state(p, pdt):
                out.append((const(_round(nbytes)), p.count))
        elif k:
            dt = 4 if opt is OptimizerName.PAGED_ADAMW else pdt
            out.append((const(_round(p.numel * dt)), k * p.count))
        # `step` is a 0-dim fp32 tensor per parameter: on the parameter's device for fused (and on
        # CPU), a host tensor otherwise (torch/optim/adam.py _init_group)
        if opt in (OptimizerName.ADAMW, OptimizerName.ADAM, OptimizerName.ADAFACTOR) and (
                t.device is Device.CPU or t.resolved_optimizer_impl is OptimizerImpl.FUSED):
            out.append((const(_round(4)), p.count))
    return out


def _adafactor_temporaries(params: list[tuple[ParamTensor, int]], foreach: bool) -> int:
    """Peak temporaries of torch.optim.Adafactor's step (torch/optim/_adafactor.py). Every parameter
    gets a full-size ``var_estimate`` (``row_var @ col_var`` for matrices, ``variance.clone()`` after a
    ``grad * grad`` for vectors) that becomes its update. ``foreach`` builds them for a whole group
    (same dtype, matrix or vector; groups in order of first appearance) at once, and a group's list
    stays bound while the next group's is built; the for-loop does one parameter at a time, the
    previous one's estimate still bound. Row and column means are tiny and left out."""
    if foreach:
        groups: dict[tuple[int, bool], int] = {}
        for p, pdt in params:
            key = (pdt, len(p.shape) >= 2)
            groups[key] = groups.get(key, 0) + _round(p.numel * pdt) * p.count
        worst, prev = 0, 0
        for size in groups.values():
            worst = max(worst, prev + size)
            prev = size
        return worst
    worst, prev = 0, 0
    for size in _model_order(params):
        worst = max(worst, prev + size)
        prev = size
    return worst


def _model_order(params: list[tuple[ParamTensor, int]]) -> list[int]:
    """Rounded bytes of every parameter tensor in ``model.parameters()`` order."""
    return [_round(p.numel * pdt) for p, pdt in _in_model_order(params)]


def _in_model_order(params: list[tuple[ParamTensor, int]]) -> list[tuple[ParamTensor, int]]:
    """Every parameter tensor in ``model.parameters()`` order: the inventory lists a layer's tensors once
    (with a count); the model repeats the whole layer block layer by layer."""
    before: list[tuple[ParamTensor, int]] = []
    block: list[tuple[ParamTensor, int]] = []
    after: list[tuple[ParamTensor, int]] = []
    for p, pdt in params:
        if p.in_layer:
            block.append((p, pdt))
        else:
            (after if block else before).extend([(p, pdt)] * p.count)
    layers = max((p.count for p, _ in block), default=0)
    middle = [(p, pdt) for i in range(layers) for p, pdt in block if i < p.count]
    return before + middle + after


#: The names the HF Trainer leaves out of weight decay, searched in the lower-cased parameter name
#: (transformers 5.24 trainer.py ``Trainer.get_decay_parameter_names``: ``forbidden_name_patterns``), besides
#: every parameter of an ``nn.LayerNorm`` module (``get_parameter_names(model, [nn.LayerNorm], ...)``).
_NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def _trainer_order(m: ModelSpec, params: list[tuple[ParamTensor, int]]) -> list[tuple[ParamTensor, int]]:
    """The order the HF Trainer's optimizer visits the parameters: its two groups (``Trainer.create_optimizer``),
    the weight-decayed ones in model order, then the others."""
    def decayed(p: ParamTensor) -> bool:
        return not (_NO_DECAY.search(p.name.lower()) or (p.norm and m.norm == "layernorm"))

    order = _in_model_order(params)
    return [x for x in order if decayed(x[0])] + [x for x in order if not decayed(x[0])]


def _hf_adafactor_window(m: ModelSpec, params: list[tuple[ParamTensor, int]],
                         first_step: bool = False) -> list[tuple[int, int, bool]]:
    """The temporaries of transformers.optimization.Adafactor's ``step()`` (transformers 5.24 optimization.py) around
    the parameter where they peak, as ``(+1 or -1, bytes)`` in order. Per parameter, in the Trainer's order: a
    16-bit gradient and parameter copied to fp32 (``grad.float()``, ``p.float()``: bound until the next
    parameter's); ``update = (grad**2) + eps`` (two full-size tensors while the previous parameter's ``update``
    is still bound); for a matrix ``_approx_sq_grad``'s row and column factors and their product, the new
    ``update``; for a vector ``exp_avg_sq.rsqrt()``; then ``p_data_fp32.add_(-update)`` (one more).
    With `first_step`, each parameter's state (and its RMS tensor) is created inside the loop as it comes, so the
    state of the parameters before it and its own is there at its peak, the rest comes after: events flagged
    True are that state."""
    best: tuple[int, list[tuple[int, int, bool]]] = (-1, [])
    prev = 0
    order = _trainer_order(m, params)
    state = [sum(_round(n) for n in (*_adafactor_state(p, 4), 4)) if first_step else 0 for p, _ in order]
    total_state, so_far = sum(state), 0
    for (p, pdt), own in zip(order, state, strict=True):
        so_far += own
        f = _round(p.numel * 4)
        copies = [f, f] if pdt != 4 else []  # grad.float(), p.float()
        # a matrix's row and column factors (``_approx_sq_grad``); a vector has none
        factors = [_round(p.numel // p.shape[-1] * 4), _round(p.numel // p.shape[-2] * 4)] if len(p.shape) >= 2 else []
        peak = so_far + sum(copies) + max(prev + 2 * f, 2 * f + sum(factors))
        if peak > best[0]:
            ev = [(1, so_far, True)] if so_far else []
            ev += [(1, prev, False)] if prev else []
            ev += [(1, n, False) for n in copies] + [(1, f, False), (1, f, False), (-1, f, False)]
            ev += [(-1, prev, False)] if prev else []
            ev += [(1, n, False) for n in factors] + [(1, f, False)] + [(-1, n, False) for n in factors] + [(-1, f, False)]
            ev += [(1, f, False), (-1, f, False), (-1, f, False)] + [(-1, n, False) for n in copies]
            ev += [(1, total_state - so_far, True)] if total_state > so_far else []
            best = (peak, ev)
        prev = f
    return best[1]


def _adafactor_state(p: ParamTensor, pdt: int) -> list[int]:
    """torch.optim.Adafactor: a row and a column variance for matrices, a full one for vectors."""
    if len(p.shape) >= 2:
        rows = p.numel // p.shape[-1]
        cols = p.numel // p.shape[-2]
        return [rows * pdt, cols * pdt]
    return [p.numel * pdt]


def optimizer_program(m: ModelSpec, t: TrainingSpec, shard: Shard | None = None,
                      grads: list[tuple[int, int]] | None = None) -> list[Segment]:
    """The optimizer step's and ``zero_grad``'s segments; with `shard`, on the rank's parameter shards,
    and `grads` (``(bytes, count)`` of the gradient storages ``zero_grad`` frees) when they are not one
    per parameter."""
    from ..engine.program import _segment

    params = _params(m, t, shard)
    temp = _CAT["transient/optimizer"]
    states = _CAT["optimizer_states"]
    grad = _CAT["gradients"]
    opt, impl = t.optimizer, t.resolved_optimizer_impl
    events: list[tuple[int, int, Sz, str]] = []
    hf_adafactor = opt is OptimizerName.ADAFACTOR and t.adafactor is AdafactorImpl.TRANSFORMERS
    if t.first_step and not hf_adafactor:  # transformers' Adafactor creates each parameter's as it comes
        # the first step() creates the state (zeros_like per parameter in _init_group) before updating
        created = sum(_round(int(sz.c0)) * count for sz, count in state_bytes(m, t, shard))
        if created:
            events.append((states, 1, const(created), "state created on the first step"))
    if opt in (OptimizerName.ADAMW, OptimizerName.ADAM) and params:
        if impl is OptimizerImpl.FOREACH:
            # exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs): one temporary per parameter, freed with
            # the list (each its own block for the caching allocator's replay)
            sqrt = [(const(_round(p.numel * pdt)), p.count) for p, pdt in params]
            events += [(temp, count, sz, "foreach sqrt(exp_avg_sq)") for sz, count in sqrt]
            events += [(temp, -count, sz, "foreach temps freed") for sz, count in sqrt]
        elif impl is OptimizerImpl.FOR_LOOP:
            # denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps): while the new denom is computed the
            # previous parameter's denom is still bound; peak = prev + sqrt + div of the worst pair
            worst, prev_size = 0, 0
            for size in _model_order(params):
                worst = max(worst, prev_size + 2 * size)
                prev_size = size
            events += [(temp, 1, const(worst), "for-loop sqrt and denom"), (temp, -1, const(worst), "for-loop temps freed")]
    elif opt is OptimizerName.LION and params:
        largest = max(_round(p.numel * pdt) for p, pdt in params)
        events += [(temp, 1, const(largest), "lion update"), (temp, -1, const(largest), "lion update freed")]
    elif hf_adafactor and params:
        events += [(states, sign, const(n), "state created on the first step") if is_state else
                   (temp, sign, const(n), "transformers Adafactor update" if sign > 0 else "freed")
                   for sign, n, is_state in _hf_adafactor_window(m, params, t.first_step)]
    elif opt is OptimizerName.ADAFACTOR and params:
        worst = _adafactor_temporaries(params, impl is OptimizerImpl.FOREACH)
        events += [(temp, 1, const(worst), "adafactor variance estimates"), (temp, -1, const(worst), "adafactor freed")]
    segs = [_segment("optimizer", "optimizer step", 1, tuple(events))] if events else []
    if grads is None:
        grads = [(p.numel * pdt, p.count) for p, pdt in params]
    frees = tuple((grad, -count, const(_round(n)), "zero_grad(set_to_none)") for n, count in grads if n and count)
    if frees and t.zero_grad_set_to_none:  # one free per gradient storage (set_to_none=False: zeroed in place)
        segs.append(_segment("zero", "zero_grad", 1, frees))
    return segs
