"""Run one steady-state training step of a Hugging Face model and account for every byte.

The step is what a training loop does after its first iteration: optimizer state exists, gradients
were set to None, then forward (with the loss), backward, ``optimizer.step()`` and
``zero_grad(set_to_none=True)``. Devices: ``cpu`` (real tensors), ``fake`` (``FakeTensorMode``: the
same CPU kernels' shapes, no data, any size) and ``cuda`` (the CUDA allocator's own statistics, see
`trainmem_nb.measure.cuda`).

Options map to PyTorch as a training script would set them:

* precision: ``fp32``; ``bf16-mixed`` / ``fp16-mixed`` = fp32 parameters, gradients and optimizer
  states with ``torch.autocast`` (device type of the kernels) around forward and loss, and for fp16 a
  ``GradScaler`` (scale, unscale, step, update); ``bf16-true`` / ``fp16-true`` = the model built in
  that dtype (gradients and optimizer states follow).
* optimizer: ``torch.optim`` AdamW (weight decay 0.01), Adam, SGD, SGD(momentum=0.9), Adafactor, or
  none; implementation foreach / fused / for-loop (``foreach=False``).
* checkpointing: ``full`` = ``gradient_checkpointing_enable(use_reentrant=False)`` (each layer keeps
  its input and is recomputed in backward); ``selective`` = the same with PyTorch's selective
  activation checkpointing policy that saves the outputs of matmuls and attention kernels and
  recomputes the element-wise ops (`_selective_policy`); ``selective-op`` = torchtitan's op-level
  policy, which saves attention outputs and every other ``mm`` of a layer (`_op_policy`).
* attention: Hugging Face ``attn_implementation`` (``sdpa`` or ``eager``; ``flash`` needs flash-attn
  on a CUDA GPU); dropout: every dropout rate of the family's config (`_dropout_overrides`).
* LoRA: `trainmem_nb.measure.lora.apply_lora` (peft).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..engine.breakdown import DETAIL_KEYS
from ..errors import SpecError
from ..model.families import describe
from ..model.hf_config import to_hf_config
from ..model.spec import ModelSpec
from ..recipes.base import FP8_SKIPPED
from ..spec.choices import AdafactorImpl, Attention, Checkpointing, Method, OptimizerImpl, OptimizerName, Precision
from ..spec.training import TrainingSpec
from .losses import step_loss
from .models import IDLE_MODULES, hf_config_object, instantiate
from .tracker import StorageTracker, cuda_round

__all__ = ["MEASURABLE_OPTIMIZERS", "StepTrace", "build", "check_measurable", "run_step", "summarize", "traced_step"]

#: Optimizers that exist in torch.optim (the others need bitsandbytes or another package).
MEASURABLE_OPTIMIZERS = (
    OptimizerName.ADAMW, OptimizerName.ADAM, OptimizerName.SGD, OptimizerName.SGD_MOMENTUM,
    OptimizerName.ADAFACTOR, OptimizerName.NONE,
)

#: The phases a peak can fall in (``zero`` only frees; nothing is allocated before ``forward``).
PEAK_PHASES = ("forward", "backward", "optimizer")


class StepTrace:
    """The tracker's records of one step plus the model and setup it ran."""

    def __init__(self, tracker: StorageTracker, model: ModelSpec, training: TrainingSpec, device: str,
                 n_params: int, n_trainable: int, timing: dict[str, float],
                 cuda: dict[str, Any] | None = None) -> None:
        self.tracker = tracker
        self.model = model
        self.training = training
        self.device = device
        self.n_params = n_params
        self.n_trainable = n_trainable
        self.timing = timing
        self.cuda = cuda  #: the CUDA allocator's statistics around the step (device ``cuda`` only)


def check_measurable(m: ModelSpec, t: TrainingSpec, device: str) -> None:
    """Raise a one-line `RuntimeError` for options that cannot run on `device` with PyTorch alone."""
    if device not in ("fake", "cpu", "cuda"):
        raise RuntimeError(f"device={device!r} cannot be measured; use 'fake', 'cpu' or 'cuda'")
    if m.positions == "learned" and t.seq_len > m.max_positions:
        raise SpecError(
            f"seq_len={t.seq_len} exceeds the {m.max_positions} learned positions of {m.name!r}; "
            f"use seq_len <= {m.max_positions}"
        )
    defaults = TrainingSpec()
    older = [k for k in ("zero_grad_set_to_none", "bnb_saves_input", "causal_lm_loss", "loop_keeps_outputs",
                         "softmax_saves_input", "untied_head")
             if getattr(t, k) != getattr(defaults, k)]
    if older:  # a stack's mechanisms of other versions: this process runs the installed ones
        named = ", ".join(f"{k}={getattr(getattr(t, k), 'value', getattr(t, k))}" for k in older)
        raise SpecError(f"{named} (stack {t.resolved_stack.label}) cannot be measured here: the step runs the installed torch, "
                        "transformers and bitsandbytes and today's loop; measure with the default stack")
    if t.optimizer not in MEASURABLE_OPTIMIZERS:
        raise RuntimeError(
            f"optimizer={t.optimizer.value!r} cannot be measured here: it is not in torch.optim (it needs "
            f"bitsandbytes or another package); measure adamw, adam, sgd, sgd-momentum, adafactor or none"
        )
    if t.loss_impl.value == "chunked" and device == "fake":
        raise RuntimeError("loss_impl='chunked' cannot run under fake tensors: torchtune's loss keeps the rows of "
                           "valid targets (torch.where, a data-dependent shape); measure it with device='cpu'")
    if t.loss_impl.value in ("liger", "cce"):
        raise RuntimeError(
            f"loss_impl={t.loss_impl.value!r} cannot be measured here: it is a Triton kernel, not installed with "
            "the measure extra; measure loss_impl='standard' or 'chunked'"
        )
    if t.fp8.value != "none":
        import importlib.util

        if importlib.util.find_spec("torchao") is None:
            raise RuntimeError(f"fp8={t.fp8.value!r} needs torchao's Float8 training: pip install 'trainmem_nb[measure]'")
        if t.fp8_all_gather:
            raise RuntimeError("fp8_all_gather=True is FSDP2's float8 all-gather: a single device gathers nothing; "
                               "measure it with gpus > 1 and engine='fsdp', or fp8_all_gather=False")
    if t.method is Method.QLORA:
        raise RuntimeError(
            "method='qlora' cannot be measured here: it needs bitsandbytes CUDA kernels for the NF4 base; "
            "measure method='lora' (the same adapters on a 16-bit base) instead"
        )
    if describe(m.family).attention == "sinks" and t.attention is Attention.FLASH:
        raise RuntimeError(f"attention='flash' cannot be measured for {m.family.value}: its attention sinks need the "
                           "kernels-community flash kernels; measure attention='eager'")
    if t.attention is Attention.FLASH:
        if device != "cuda":
            raise RuntimeError(
                f"attention='flash' cannot be measured on device={device!r}: flash-attn runs only on a CUDA GPU; "
                "measure attention='sdpa' (on CPU its flash kernel keeps the same output and logsumexp)"
            )
        import importlib.util

        if importlib.util.find_spec("flash_attn") is None:
            raise RuntimeError("attention='flash' needs the flash-attn package: pip install flash-attn")


def _dropout_overrides(m: ModelSpec, p: float | None) -> dict[str, Any]:
    """Config keys that set every dropout site of the family to `p` (None: keep the spec's rates)."""
    if p is None:
        return {}
    return dict.fromkeys(describe(m.family).dropout_keys, p)


def _attn_impl(t: TrainingSpec, m: ModelSpec | None = None) -> str:
    if t.attention is Attention.FLASH:
        return "flash_attention_2"
    if t.attention is Attention.SDPA and m is not None and not describe(m.family).sdpa:
        return "eager"  # no SDPA for the class (Gemma 2): what Hugging Face runs when none is asked for
    return t.attention.value


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The language model's repeated transformer layers, as ``(name, ModuleList)``: the longest list of one
    module type outside the modules a text-only step never runs (a multimodal checkpoint's vision tower holds
    its own, earlier in ``named_modules()``: `IDLE_MODULES`); None where there is none."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if (isinstance(mod, nn.ModuleList) and len(mod) and (best is None or len(mod) > len(best[1]))
                and not IDLE_MODULES.intersection(name.split(".")) and all(type(x) is type(mod[0]) for x in mod)):
            best = (name, mod)
    return best


def layer_module_names(model: nn.Module) -> dict[str, int]:
    """``{module name: index}`` of the repeated transformer layers (the ModuleList HF checkpoints)."""
    best = decoder_layers(model)
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
    """Selective activation checkpointing: save the outputs of matmuls and attention kernels,
    recompute everything else (norms, activations, element-wise ops) in backward."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default}
    for name in ("_grouped_mm", "_scaled_dot_product_cudnn_attention"):
        op = getattr(aten, name, None)
        if op is not None:
            save.add(op.default)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def _op_policy() -> Any:
    """torchtitan's op-level selective checkpointing (``selective_ac_option = "op"``,
    torchtitan/models/llama3/infra/parallelize.py ``_apply_ac_to_transformer_block``): save the outputs
    of the ops in its save list except every second ``mm`` of a layer (counted separately in forward
    and in recomputation, with a fresh count for each checkpointed call), recompute the rest. Its list
    names the CUDA SDPA kernels; the CPU flash kernel that runs here stands in for them."""
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {aten.mm.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default, aten.abs.default, aten.max.default}

    def context_fn() -> Any:
        meta: dict[str, int] = defaultdict(int)

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
            if op is aten.mm.default:
                meta[key] += 1
            keep = op in save and not (op is aten.mm.default and meta[key] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def make_optimizer(t: TrainingSpec, params: list[nn.Parameter], model: nn.Module | None = None) -> torch.optim.Optimizer | None:
    """The ``torch.optim`` optimizer of `t` over `params` (None for ``optimizer='none'``); transformers' Adafactor
    as the HF Trainer builds it over `model`'s trained parameters."""
    impl = t.resolved_optimizer_impl
    flags: dict[str, Any] = {}
    if impl is OptimizerImpl.FOREACH:
        flags["foreach"] = True
    elif impl is OptimizerImpl.FUSED:
        flags["fused"] = True
    else:
        flags["foreach"] = False
    name = t.optimizer
    if name is OptimizerName.NONE or not params:
        return None
    if name is OptimizerName.ADAMW:
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **flags)
    if name is OptimizerName.ADAM:
        return torch.optim.Adam(params, lr=1e-4, **flags)
    if name is OptimizerName.SGD:
        return torch.optim.SGD(params, lr=1e-3, **flags)
    if name is OptimizerName.SGD_MOMENTUM:
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, **flags)
    if name is OptimizerName.ADAFACTOR and t.adafactor is AdafactorImpl.TRANSFORMERS:
        return _trainer_adafactor(params, model)
    if name is OptimizerName.ADAFACTOR:
        return torch.optim.Adafactor(params, lr=1e-2, foreach=flags.get("foreach"))
    raise RuntimeError(f"optimizer={name.value!r} cannot be measured here")


def _trainer_adafactor(params: list[nn.Parameter], model: nn.Module | None) -> torch.optim.Optimizer:
    """What ``Trainer(args=TrainingArguments(optim="adafactor"))`` builds: the installed transformers' own decay
    groups (``Trainer.create_optimizer``) and Adafactor's arguments (``get_optimizer_cls_and_kwargs``)."""
    from transformers import Trainer
    from transformers.optimization import Adafactor

    if model is None:
        raise RuntimeError("adafactor='transformers' is measured over a whole model: the Trainer groups its parameters")
    decay = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]  # its self is unused
    wanted = {id(p) for p in params}
    named = [(n, p) for n, p in model.named_parameters() if id(p) in wanted]
    groups = [{"params": [p for n, p in named if n in decay], "weight_decay": 0.0},
              {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    return Adafactor(groups, lr=1e-2, scale_parameter=False, relative_step=False)


def _prime(opt: torch.optim.Optimizer, trainable: list[nn.Parameter]) -> None:
    """Create optimizer state with a zero-learning-rate step on zero gradients (params unchanged)."""
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    for p in trainable:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    for g, lr in zip(opt.param_groups, lrs, strict=True):
        g["lr"] = lr


def _sanitize_token_ids(cfg: Any, vocab: int) -> None:
    """Drop special-token ids outside a small test vocabulary (phi3's pad id 32000 would break the
    embedding's padding_idx; the others only warn). Real configs keep theirs: memory is unaffected."""
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(cfg, key, None)
        ids = value if isinstance(value, list) else [value]
        if any(isinstance(v, int) and v >= vocab for v in ids):
            setattr(cfg, key, None)


def model_dtype(t: TrainingSpec) -> torch.dtype:
    """The dtype the model is built in: 16-bit for the ``*-true`` recipes, else fp32."""
    return {Precision.BF16_TRUE: torch.bfloat16, Precision.FP16_TRUE: torch.float16}.get(t.precision, torch.float32)


def fp8_module_filter(module: nn.Module, fqn: str) -> bool:
    """The linears fp8 training converts in the measured steps: not an output head
    (`trainmem_nb.recipes.base.FP8_SKIPPED`), and dimensions that are multiples of 16, which
    ``torch._scaled_mm`` needs (the rule `trainmem_nb.recipes.base.fp8_converted` models)."""
    return (fqn.rsplit(".", 1)[-1] not in FP8_SKIPPED and isinstance(module, nn.Linear)
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def build(m: ModelSpec, t: TrainingSpec, device: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The Hugging Face model for `m` in training mode, in the recipe's dtype, and its inputs.

    Inputs are random token ids of shape (micro_batch, seq_len); ``labels`` is the same tensor (the
    model shifts it for causal LM; bert's masked-LM loss covers every position), or with a
    sequence-classification head one random label per sequence.
    """
    cfg_dict = to_hf_config(m)
    cfg_dict.update(_dropout_overrides(m, t.dropout))
    cfg = hf_config_object(cfg_dict, use_cache=False)
    _sanitize_token_ids(cfg, m.vocab)
    if m.num_labels and getattr(cfg, "pad_token_id", None) is None:
        cfg.pad_token_id = 0  # a decoder's classifier finds each sequence's last token by its pad id
    torch_device = "cuda" if device == "cuda" else "cpu"
    with torch.device(torch_device):
        model = instantiate(cfg, cfg_dict["model_type"], _attn_impl(t, m), model_dtype(t))
    model.train()
    if t.checkpointing is not Checkpointing.NONE:
        kwargs: dict[str, Any] = {"use_reentrant": False}
        if t.checkpointing is Checkpointing.SELECTIVE:
            kwargs["context_fn"] = _selective_policy()
        elif t.checkpointing is Checkpointing.SELECTIVE_OP:
            kwargs["context_fn"] = _op_policy()
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if t.method is not Method.FULL:
        from .lora import apply_lora

        model = apply_lora(model, m, t)
    if t.fp8.value != "none":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(t.fp8.value)
        if t.fp8_all_gather:  # FSDP2's float8 all-gather (torchtitan's float8.enable_fsdp_float8_all_gather)
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=config, module_filter_fn=fp8_module_filter)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, m.vocab, (t.micro_batch, t.seq_len), generator=gen).to(torch_device)
    if m.num_labels:
        labels = torch.randint(0, max(2, m.num_labels), (t.micro_batch,), generator=gen).to(torch_device)
        return model, {"input_ids": ids, "labels": labels.float() if m.num_labels == 1 else labels}
    return model, {"input_ids": ids, "labels": ids}


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' logger (config notices) while a step is built and run, and the log lines of
    importing torchao (which peft imports when it is installed): the CUDA-only kernels it cannot load on a
    machine without them, and torch's notice on its pytree registrations."""
    import logging

    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    others = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in others]
    for lg in others:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        for lg, old in zip(others, levels, strict=True):
            lg.setLevel(old)


class _Setup:
    """A built model with its inputs, optimizer and (fp16-mixed) grad scaler, ready for steps."""

    def __init__(self, m: ModelSpec, t: TrainingSpec, device: str, prime: bool) -> None:
        self.t = t
        self.model, self.inputs = build(m, t, device)
        # a multimodal model's vision tower never runs on text: its parameters get no gradient, so an optimizer
        # given them keeps no state for them (what leaving them out of it gives, priming included)
        self.trainable = [p for n, p in self.model.named_parameters()
                          if p.requires_grad and IDLE_MODULES.isdisjoint(n.split("."))]
        self.opt = make_optimizer(t, self.trainable, self.model)
        self.scaler: Any = None
        kernels = "cuda" if device == "cuda" else "cpu"
        if t.precision is Precision.FP16_MIXED:
            self.scaler = torch.amp.GradScaler(kernels)
            self.scaler.scale(torch.ones((), device=kernels))  # creates its scale and growth tracker
        self.opt_context: Any = contextlib.nullcontext
        if device == "fake" and t.optimizer is OptimizerName.ADAFACTOR:
            from .fakefix import fake_scalar_reads

            self.opt_context = fake_scalar_reads
        if self.opt is not None and prime:
            with self.opt_context():
                _prime(self.opt, self.trainable)
        self.autocast: Any = contextlib.nullcontext()
        if t.mixed:
            dtype = torch.bfloat16 if t.precision is Precision.BF16_MIXED else torch.float16
            self.autocast = torch.autocast(device_type=kernels, dtype=dtype)
        # gradient accumulation: the measured micro-step is the last one; the earlier ones leave their
        # gradients, which it adds to (the estimator's later micro-step with ``.grad`` alive)
        for _ in range(t.grad_accum - 1):
            loss = step_loss(self.model, self.inputs, self.t, self.autocast)
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            del loss

    def state_tensors(self) -> list[torch.Tensor]:
        """Tensors the optimizer (and grad scaler) hold between steps."""
        out: list[torch.Tensor] = []
        if self.opt is not None:
            out += [v for s in self.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        if self.scaler is not None:
            out += [x for x in (self.scaler._scale, self.scaler._growth_tracker) if isinstance(x, torch.Tensor)]
        return out

    def step(self, tracker: StorageTracker | None = None, timing: dict[str, float] | None = None) -> None:
        """One training step; with `tracker`, its phases are marked and the grads are identified."""
        mark = tracker.mark if tracker is not None else (lambda _p: None)
        clock = time.perf_counter
        t0 = clock()
        mark("forward")
        loss = step_loss(self.model, self.inputs, self.t, self.autocast)
        t1 = clock()
        mark("backward")
        scaled = self.scaler.scale(loss) if self.scaler is not None else loss
        scaled.backward()
        t2 = clock()
        if tracker is not None:
            self.grad_records = {tracker.index_of(p.grad) for p in self.trainable if p.grad is not None}
        if self.opt is not None:
            mark("optimizer")
            with self.opt_context():
                if self.scaler is not None:
                    # What GradScaler.step does on a step without inf/NaN, without its host sync
                    # (``found_inf.item()``), which fake tensors cannot answer.
                    self.scaler.unscale_(self.opt)
                    self.opt.step()
                    self.scaler.update()
                else:
                    self.opt.step()
            mark("zero")
            self.opt.zero_grad(set_to_none=True)
        else:
            mark("zero")
            for p in self.trainable:
                p.grad = None
        del loss, scaled
        if timing is not None:
            timing.update(forward_s=t1 - t0, backward_s=t2 - t1, optimizer_s=clock() - t2)


def traced_step(setup: _Setup, device_type: str | None = None,
                timing: dict[str, float] | None = None) -> StorageTracker:
    """Run one step of `setup` under a new `StorageTracker` (still open: the caller closes it).

    The parameters, buffers, optimizer (and grad-scaler) state and the inputs that exist before the
    step are adopted under their categories; the tracker counts only `device_type` storages if given.
    """
    tracker = StorageTracker(layer_module_names(setup.model), device_type)
    tracker.adopt(list(setup.model.parameters()), "weights/params", param=True)
    tracker.adopt(list(setup.model.buffers()), "weights/buffers")
    tracker.adopt(setup.state_tensors(), "optimizer_states")
    tracker.adopt([p.grad for p in setup.trainable if p.grad is not None], "gradients")  # grad_accum > 1
    tracker.adopt(list(setup.inputs.values()), "activations/inputs")
    with tracker, _module_context(setup.model, tracker):
        setup.step(tracker, timing)
    return tracker


def run_step(m: ModelSpec, t: TrainingSpec, device: str = "fake", prime: bool | None = None) -> StepTrace:
    """Build, prime and measure one training step; ``device`` is ``fake``, ``cpu`` or ``cuda``.

    A first step (``t.first_step``, or ``prime=False``) is measured unprimed: the optimizer state is
    created inside it.
    """
    if prime is None:
        prime = not t.first_step
    check_measurable(m, t, device)
    if device == "cuda":
        from .cuda import apply_alloc_conf, require_cuda

        require_cuda()
        apply_alloc_conf(t.alloc_conf)  # before anything is allocated: the rules the replay assumes
    timing: dict[str, float] = {}
    t0 = time.perf_counter()
    fake_ctx: Any = contextlib.nullcontext()
    fixes: Any = contextlib.nullcontext()
    if device == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode

        from .fakefix import fake_mode_fixes

        fake_ctx = FakeTensorMode(allow_non_fake_inputs=False)
        fixes = fake_mode_fixes()
    cuda_stats: dict[str, Any] | None = None
    if device == "cuda":
        # the caching allocator's history decides what it reserves, so it is a training loop's: the warm-up
        # step before the measured one is the loop's first, whose optimizer.step() creates the state
        # (no priming), after the construction's freed blocks are released (from_pretrained leaves none)
        prime = False
    with quiet_transformers(), fake_ctx, fixes:
        setup = _Setup(m, t, device, prime)
        timing["build_s"] = time.perf_counter() - t0
        if device == "cuda":
            from .cuda import before_step

            before = before_step(setup, warm_up=not t.first_step)
        t1 = time.perf_counter()
        tracker = traced_step(setup, "cuda" if device == "cuda" else None, timing)
        if device == "cuda":
            from .cuda import after_step

            cuda_stats = after_step(before)
        timing["step_s"] = time.perf_counter() - t1
        tracker.close()
    t2 = time.perf_counter()
    _categorize(tracker, setup.grad_records)
    timing["analyze_s"] = time.perf_counter() - t2
    n_params = sum(p.numel() for p in setup.model.parameters())
    n_trainable = sum(p.numel() for p in setup.trainable)
    timing["wall_s"] = time.perf_counter() - t0
    return StepTrace(tracker, m, t, device, n_params, n_trainable, timing, cuda_stats)


def _categorize(tracker: StorageTracker, grad_ids: set[int | None]) -> None:
    """Give every record made during the step its breakdown category (the keys of `DETAIL_KEYS`).

    Forward storages still alive when backward starts are activations: ``weight_copies`` when
    autocast made them from a parameter, ``layers`` when born inside (or between) the transformer
    layers, ``embeddings`` when born before the first layer ran (embedding output, positions, rotary
    cos/sin, masks), ``head`` when born after the last layer (final norm, logits, loss). Storages that
    are ``.grad`` after backward are ``gradients`` from birth. Backward storages born while a
    module's forward runs again (checkpointing's recomputation) are ``activations/recomputed``;
    the rest of backward is ``transient/backward``, and optimizer-step allocations are
    ``transient/optimizer``.
    """
    events, records = tracker.events, tracker.records
    fwd_end = next((i for i, (idx, _) in enumerate(events) if records[idx].phase == "backward"), len(events))
    layer_births = [r.born for r in records if r.phase == "forward" and r.in_layer]
    first_layer = min(layer_births) if layer_births else len(events)
    last_layer = max(layer_births) if layer_births else -1
    for i, r in enumerate(records):
        if r.category:
            continue
        if i in grad_ids:
            r.category = "gradients"
        elif r.phase == "forward":
            if r.died is not None and r.died < fwd_end:
                r.category = "transient/forward"
            elif r.source_param:
                r.category = "activations/weight_copies"
            elif r.in_layer:
                r.category = "activations/layers"
            elif r.born < first_layer:
                r.category = "activations/embeddings"
            elif r.born > last_layer:
                r.category = "activations/head"
            else:
                r.category = "activations/layers"
        elif r.phase == "backward":
            r.category = "activations/recomputed" if r.module else "transient/backward"
        elif r.phase in ("optimizer", "zero"):
            r.category = "transient/optimizer"
        else:  # nothing is allocated before the step starts; kept visible rather than dropped
            r.category = "transient/forward"
        assert r.category in DETAIL_KEYS, r.category


def _peak_at(rec: Any) -> str:
    """Where a peak happened, in words: the op, the module whose forward ran, the phase."""
    op = rec.op.removesuffix(".default")
    where = rec.module or {"optimizer": "optimizer.step", "backward": "autograd"}.get(rec.phase, rec.phase)
    return f"{rec.phase}: aten.{op} in {where}"


def summarize(trace: StepTrace, rounding: bool = True, timeline_points: int = 256) -> dict[str, Any]:
    """Peak, its phase and op, the breakdown at the peak and per-phase peaks of a traced step.

    With `rounding` every storage counts as the CUDA caching allocator would (512-B blocks). Keys:
    ``peak``, ``peak_phase``, ``peak_op``, ``peak_module``, ``peak_at``, ``detail`` (every
    `DETAIL_KEYS` entry), ``phase_peaks`` (forward / backward / optimizer: the most live bytes while
    the phase ran), ``live_at_start``, ``saved_activations`` (activations, inputs included, alive
    when forward ends) and ``timeline`` (``[event, live bytes, phase]``, at most `timeline_points`
    points, each the maximum of its bucket).
    """
    tr = trace.tracker
    rnd = cuda_round if rounding else (lambda n: n)
    starts = sorted(tr.phase_starts, key=lambda x: x[1])
    boundaries = [s[1] for s in starts]
    live = 0
    peak, at = -1, 0
    phase_peaks: dict[str, int] = {}
    live_at_start = None
    curve: list[tuple[int, int, str]] = []
    pi = -1
    phase = "init"
    for i, (idx, sign) in enumerate(tr.events):
        while pi + 1 < len(boundaries) and boundaries[pi + 1] <= i:
            pi += 1
            phase = starts[pi][0]
            if live_at_start is None:
                live_at_start = live
            phase_peaks[phase] = max(phase_peaks.get(phase, 0), live)
        live += sign * rnd(tr.records[idx].nbytes)
        if phase != "init":
            phase_peaks[phase] = max(phase_peaks.get(phase, 0), live)
            curve.append((i, live, phase))
        if live > peak and phase in PEAK_PHASES:
            peak, at = live, i
    for name, _ in starts[pi + 1:]:  # phases that began after the last event (nothing allocated or freed)
        phase_peaks[name] = max(phase_peaks.get(name, 0), live)
    detail = dict.fromkeys(DETAIL_KEYS, 0)
    for idx in tr.alive_at(at):
        rec = tr.records[idx]
        detail[rec.category] += rnd(rec.nbytes)
    # Activations alive when forward ends (kept for backward, inputs included): the estimator's
    # ``saved_activations_bytes``.
    bwd_start = next((i for name, i in starts if name == "backward"), len(tr.events))
    saved = sum(rnd(tr.records[idx].nbytes) for idx in tr.alive_at(bwd_start - 1)
                if tr.records[idx].category.startswith("activations/"))
    peak_rec = tr.records[tr.events[at][0]]
    timeline = _downsample(curve, timeline_points)
    return {
        "peak": max(peak, 0), "peak_phase": peak_rec.phase, "peak_op": peak_rec.op, "peak_module": peak_rec.module,
        "peak_at": _peak_at(peak_rec), "detail": detail,
        "phase_peaks": {p: v for p, v in phase_peaks.items() if p in PEAK_PHASES},
        "live_at_start": live_at_start or 0, "saved_activations": saved, "timeline": timeline,
    }


def _downsample(curve: list[tuple[int, int, str]], points: int) -> list[list[Any]]:
    """At most `points` samples of the live-bytes curve, each the maximum of its bucket."""
    if not curve or points <= 0:
        return []
    size = max(1, -(-len(curve) // points))
    out: list[list[Any]] = []
    for start in range(0, len(curve), size):
        best = max(curve[start:start + size], key=lambda c: c[1])
        out.append([best[0], best[1], best[2]])
    return out
