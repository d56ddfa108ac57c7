"""Run one steady-state training step of a Hugging Face model and account for every byte.

The step is what a training loop does after its first iteration: optimizer state exists, gradients
were set to None, then forward (with the loss), backward, ``optimizer.step()`` and
``zero_grad(set_to_none=True)``. Devices: ``cpu`` (real tensors), ``fake`` (``FakeTensorMode``: the
same CPU kernels' shapes, no data, any size) and ``cuda`` (the CUDA allocator's own statistics).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..hf_config import to_hf_config
from ..specs import Attention, Checkpointing, Family, Method, ModelSpec, OptimizerImpl, OptimizerName, Precision, TrainingSpec
from .models import hf_config_object, hf_model_class
from .tracker import StorageTracker, cuda_round

__all__ = ["StepTrace", "run_step"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class StepTrace:
    """The tracker's records of one step plus the model and setup it ran."""

    def __init__(self, tracker: StorageTracker, model: ModelSpec, training: TrainingSpec, device: str,
                 n_params: int, n_trainable: int, timing: dict[str, float]) -> None:
        self.tracker = tracker
        self.model = model
        self.training = training
        self.device = device
        self.n_params = n_params
        self.n_trainable = n_trainable
        self.timing = timing


def _dropout_overrides(m: ModelSpec, p: float | None) -> dict[str, Any]:
    """Config keys that set every dropout site of the family to `p` (None: keep the spec's rates)."""
    if p is None:
        return {}
    keys = {
        Family.GPT2: ("attn_pdrop", "resid_pdrop", "embd_pdrop"),
        Family.OPT: ("dropout", "attention_dropout"),
        Family.BERT: ("hidden_dropout_prob", "attention_probs_dropout_prob"),
        Family.GPT_NEOX: ("attention_dropout", "hidden_dropout"),
        Family.PHI3: ("attention_dropout", "resid_pdrop", "embd_pdrop"),
    }.get(m.family, ("attention_dropout",))
    return dict.fromkeys(keys, p)


def _attn_impl(t: TrainingSpec) -> str:
    if t.attention is Attention.FLASH:
        return "flash_attention_2"
    return t.attention.value


def layer_module_names(model: nn.Module) -> dict[str, int]:
    """``{module name: index}`` of the repeated transformer layers (the ModuleList HF checkpoints)."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and (best is None or len(mod) > len(best[1])):
            if all(type(x) is type(mod[0]) for x in mod):
                best = (name, mod)
    if best is None:
        return {}
    return {f"{best[0]}.{i}": i for i in range(len(best[1]))}


@contextlib.contextmanager
def _module_context(model: nn.Module, tracker: StorageTracker) -> Iterator[None]:
    """Keep ``tracker.module_stack`` equal to the modules whose forward is running."""
    names = {mod: name for name, mod in model.named_modules()}

    def pre(mod: nn.Module, *_: Any) -> None:
        tracker.module_stack.append(names.get(mod, type(mod).__name__))

    def post(mod: nn.Module, *_: Any) -> None:
        if tracker.module_stack:
            tracker.module_stack.pop()

    handles = [
        nn.modules.module.register_module_forward_pre_hook(pre),
        nn.modules.module.register_module_forward_hook(post, always_call=True),
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _selective_policy() -> Any:
    """torchtitan-style selective activation checkpointing: save matmul and attention outputs."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def _make_optimizer(t: TrainingSpec, params: list[nn.Parameter]) -> torch.optim.Optimizer | None:
    impl = t.resolved_optimizer_impl
    flags: dict[str, Any] = {}
    if impl is OptimizerImpl.FOREACH:
        flags["foreach"] = True
    elif impl is OptimizerImpl.FUSED:
        flags["fused"] = True
    else:
        flags["foreach"] = False
    name = t.optimizer
    if name is OptimizerName.NONE:
        return None
    if name is OptimizerName.ADAMW:
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **flags)
    if name is OptimizerName.ADAM:
        return torch.optim.Adam(params, lr=1e-4, **flags)
    if name is OptimizerName.SGD:
        return torch.optim.SGD(params, lr=1e-3, **flags)
    if name is OptimizerName.SGD_MOMENTUM:
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, **flags)
    if name is OptimizerName.ADAFACTOR:
        return torch.optim.Adafactor(params, lr=1e-2, foreach=flags.get("foreach"))
    raise RuntimeError(
        f"optimizer={name.value!r} cannot be measured here: it needs bitsandbytes or a non-PyTorch "
        f"implementation; measure adamw, adam, sgd, sgd-momentum, adafactor or none"
    )


def _prime(opt: torch.optim.Optimizer, trainable: list[nn.Parameter]) -> None:
    """Create optimizer state with a zero-learning-rate step on zero gradients (params unchanged)."""
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    for p in trainable:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr


@contextlib.contextmanager
def _fake_mode_fixes() -> Iterator[None]:
    """Make transformers treat fake inputs as it treats real ones.

    transformers' mask builder calls ``find_packed_sequence_indices`` when it cannot look at the data
    (it considers fake tensors as "tracing"); that makes it build an explicit (b, 1, s, s) mask where a
    real run passes ``is_causal`` to SDPA. Our inputs are never packed, so the answer is None.
    """
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda *a, **k: None  # type: ignore[assignment]
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original  # type: ignore[assignment]


def build(m: ModelSpec, t: TrainingSpec, device: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The Hugging Face model for `m` in training mode, in the recipe's dtype, and its inputs."""
    cfg_dict = to_hf_config(m)
    cfg_dict.update(_dropout_overrides(m, t.dropout))
    cfg = hf_config_object(cfg_dict, use_cache=False)
    cls = hf_model_class(cfg_dict["model_type"])
    dtype = {Precision.BF16_TRUE: torch.bfloat16, Precision.FP16_TRUE: torch.float16}.get(t.precision, torch.float32)
    torch_device = "cuda" if device == "cuda" else "cpu"
    with torch.device(torch_device):
        model = cls.from_config(cfg, attn_implementation=_attn_impl(t), dtype=dtype)
    model.train()
    if t.checkpointing is Checkpointing.FULL:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif t.checkpointing is Checkpointing.SELECTIVE:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": _selective_policy()}
        )
    if t.method is not Method.FULL:
        from .lora import apply_lora

        model = apply_lora(model, m, t)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, m.vocab, (t.micro_batch, t.seq_len), generator=gen).to(torch_device)
    return model, {"input_ids": ids, "labels": ids}


def run_step(m: ModelSpec, t: TrainingSpec, device: str = "fake") -> StepTrace:
    """Build, prime and measure one training step; ``device`` is ``fake``, ``cpu`` or ``cuda``."""
    timing: dict[str, float] = {}
    t0 = time.perf_counter()
    fake_ctx: Any = contextlib.nullcontext()
    if device == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_ctx = FakeTensorMode(allow_non_fake_inputs=False)
    with fake_ctx, (_fake_mode_fixes() if device == "fake" else contextlib.nullcontext()):
        model, inputs = build(m, t, device)
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = _make_optimizer(t, trainable)
        if opt is not None:
            _prime(opt, trainable)
        timing["build_s"] = time.perf_counter() - t0
        tracker = StorageTracker(layer_module_names(model))
        tracker.adopt([p for p in model.parameters()], "weights/params", param=True)
        tracker.adopt([b for b in model.buffers()], "weights/buffers")
        if opt is not None:
            state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            tracker.adopt(state, "optimizer_states")
        tracker.adopt(list(inputs.values()), "activations/inputs")
        autocast: Any = contextlib.nullcontext()
        if t.mixed:
            dtype = torch.bfloat16 if t.precision is Precision.BF16_MIXED else torch.float16
            autocast = torch.autocast(device_type="cuda" if device == "cuda" else "cpu", dtype=dtype)
        t1 = time.perf_counter()
        with tracker, _module_context(model, tracker):
            tracker.phase = "forward"
            with autocast:
                loss = model(**inputs).loss
            tracker.phase = "backward"
            loss.backward()
            grads = [p.grad for p in trainable if p.grad is not None]
            grad_ids = {tracker.index_of(g) for g in grads}
            tracker.phase = "optimizer"
            if opt is not None:
                opt.step()
                tracker.phase = "zero"
                opt.zero_grad(set_to_none=True)
            else:
                tracker.phase = "zero"
                for p in trainable:
                    p.grad = None
            del loss, grads
        timing["step_s"] = time.perf_counter() - t1
        tracker.close()
    _categorize(tracker, grad_ids)
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in trainable)
    return StepTrace(tracker, m, t, device, n_params, n_trainable, timing)


def _categorize(tracker: StorageTracker, grad_ids: set[int | None]) -> None:
    """Give every record made during the step its breakdown category (same keys as the estimator)."""
    fwd_end = next((i for i, (idx, s) in enumerate(tracker.events) if tracker.records[idx].phase == "backward"), None)
    for i, r in enumerate(tracker.records):
        if r.category:
            continue
        if i in grad_ids:
            r.category = "gradients"
        elif r.phase == "forward":
            alive_at_fwd_end = r.died is None or (fwd_end is not None and r.died >= fwd_end)
            if not alive_at_fwd_end:
                r.category = "transient/forward"
            elif r.source_param:
                r.category = "activations/weight_copies"
            elif r.in_layer:
                r.category = "activations/layers"
            else:
                r.category = "activations/other"
        elif r.phase == "backward":
            r.category = "activations/recomputed" if r.in_layer and r.module else "transient/backward"
        elif r.phase == "optimizer":
            r.category = "transient/optimizer"
        else:
            r.category = "transient/other"


def summarize(trace: StepTrace, rounding: bool = True) -> dict[str, Any]:
    """Peak, its phase and op, the breakdown at the peak and per-phase peaks of a traced step."""
    tr = trace.tracker
    rnd = cuda_round if rounding else (lambda n: n)
    live = 0
    peak, at = -1, 0
    phase_peaks: dict[str, int] = {}
    for i, (idx, sign) in enumerate(tr.events):
        rec = tr.records[idx]
        live += sign * rnd(rec.nbytes)
        if sign > 0:
            phase_peaks[rec.phase] = max(phase_peaks.get(rec.phase, 0), live)
        if live > peak:
            peak, at = live, i
    detail: dict[str, int] = {}
    for idx in tr.alive_at(at):
        rec = tr.records[idx]
        detail[rec.category] = detail.get(rec.category, 0) + rnd(rec.nbytes)
    peak_rec = tr.records[tr.events[at][0]]
    return {"peak": peak, "peak_phase": peak_rec.phase, "peak_op": peak_rec.op, "peak_module": peak_rec.module,
            "detail": dict(sorted(detail.items())), "phase_peaks": phase_peaks}
