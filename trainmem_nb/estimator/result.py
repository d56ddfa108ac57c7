"""`MemoryEstimate`: per-device memory of one training step, the JSON contract and how it prints.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

from ..engine.breakdown import TOP_KEYS, roll_up
from ..model.spec import ModelSpec
from ..recipes import head as _head
from ..recipes.registry import runs_loss
from ..spec.calibration import Calibration
from ..spec.parallel import ParallelSpec
from ..spec.training import STACK_IMPL_OPTIMIZERS, TrainingSpec
from ..units import format_bytes, format_count

__all__ = ['MemoryEstimate']

#: What each top-level category means, for tables and charts.
CATEGORY_HELP = {
    "weights": "parameters and buffers",
    "gradients": ".grad of the trained parameters",
    "optimizer_states": "moments and step counters kept by the optimizer",
    "activations": "tensors kept for backward (and autocast weight copies)",
    "transient": "temporaries: activation gradients, logits, optimizer scratch",
    "overhead": "cuBLAS workspaces counted by the allocator",
}


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-device memory of one training step: the peak, when it happens and what it is made of.

    All memory fields are ``int`` bytes. ``breakdown_bytes`` (weights, gradients, optimizer_states,
    activations, transient, overhead) sums exactly to ``peak_allocated_bytes`` (what
    ``torch.cuda.max_memory_allocated()`` reports); ``detail_bytes`` splits it further with slash
    keys (``activations/layers``). ``peak_reserved_bytes`` is what PyTorch's caching allocator reserves
    (two steps replayed through a model of it, `trainmem_nb.step.reserved`), ``device_total_bytes`` the CUDA
    context (what nvidia-smi shows). With a parallel layout each of these figures is the maximum over
    the ranks, and the breakdown, phase and `timeline` are those of the rank with the largest allocated
    peak, evaluated at the sequence length a rank holds (`rank_shape`).
    """

    model: ModelSpec
    training: TrainingSpec
    n_params: int
    n_trainable_params: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_total_bytes: int
    peak_phase: str
    peak_at: str
    detail_bytes: dict[str, int]
    phase_peaks_bytes: dict[str, int]
    overhead_bytes: dict[str, int] = field(default_factory=dict)
    calibration: Calibration | None = None
    program: Any = field(default=None, repr=False, compare=False)
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    per_rank: tuple[Any, ...] = ()
    host_bytes: int = 0
    #: every rank row's program (`per_rank` order; empty: `program` is the only one)
    rank_programs: tuple[Any, ...] = field(default=(), repr=False, compare=False)
    #: per rank, the program whose forward end holds the most activations, where it is not the rank's own (an
    #: FSDP pipeline stage's program is its costliest micro-batch, which need not be the one with the most in
    #: flight; empty: `rank_programs`)
    saved_programs: tuple[Any, ...] = field(default=(), repr=False, compare=False)
    #: (micro_batch, seq_len) each rank's program is evaluated at: context parallelism gives every rank
    #: ``seq_len / cp`` tokens of each sequence (None: the training's own shape, one device)
    rank_shape: tuple[int, int] | None = None
    #: the caching allocator's replay of two steps (`trainmem_nb.step.reserved.replay_step`) at the reserved
    #: peak of the second: reserved minus allocated (cached blocks no tensor uses) and the largest cached
    #: free block; 0 on CPU
    fragmentation_bytes: int = 0
    largest_free_block_bytes: int = 0
    #: where ``peak_reserved_bytes`` comes from: "replay" (the allocator replayed), "calibration" (a GPU
    #: run's measured cache fraction), "churn model" (`trainmem_nb.device.RESERVED_CHURN_FRACTION`: a
    #: search screening steps, or a step beyond the replay's limits, `trainmem_nb.step.reserved.replayable`),
    #: "allocated" (CPU: nothing is cached)
    reserved_from: str = "allocated"
    #: the most bytes allocated on a device while the model loads (`trainmem_nb.step.load`: QLoRA's
    #: quantize-on-load holds a 16-bit weight beside the 4-bit ones); its cache stays for the step
    load_peak_bytes: int = 0
    #: the loading trace of the rank whose loading peaks highest (`trainmem_nb.step.load.loading_events`)
    load_trace: tuple[int, ...] = field(default=(), repr=False, compare=False)

    @property
    def _shape(self) -> tuple[int, int]:
        return self.rank_shape or (self.training.micro_batch, self.training.seq_len)

    @property
    def breakdown_bytes(self) -> dict[str, int]:
        """The top-level categories at the peak; they sum to ``peak_allocated_bytes``."""
        return roll_up(self.detail_bytes)

    @property
    def saved_activations_bytes(self) -> int:
        """Activations alive at the end of the forward pass (kept for backward), in bytes: on the rank
        that keeps the most (a pipeline stage counts every micro-batch it holds in flight), at the
        sequence length a rank holds (`rank_shape`)."""
        from ..engine.program import activations_at_forward_end

        programs = self.saved_programs or self.rank_programs or (self.program,)
        return max(activations_at_forward_end(prog, *self._shape) for prog in programs)

    @property
    def host_load_bytes(self) -> int:
        """Host RAM one process needs to load the model: the full state dict in the weights' dtype
        (16-bit for QLoRA, which quantizes while moving to the GPU). Each data-parallel process pays
        it unless the model is loaded on rank 0 only or built on the meta device."""
        from ..model.params import idle_weights, weight_tensors
        from ..spec.choices import Method

        t = self.training
        dt = 2 if t.method is Method.QLORA and t.param_bytes == 4 and not t.mixed else None
        total: float = 0
        weights = [(p, pdt) for p, pdt, _ in weight_tensors(self.model, t)] + idle_weights(self.model, t)
        for p, pdt in weights:
            total += p.numel * p.count * (dt or (2 if t.method is Method.QLORA and pdt < 1 else pdt))
        return int(total)

    def timeline(self, max_points: int = 1500, load: bool = False) -> list[Any]:
        """Live bytes after each operation of the step (`trainmem_nb.engine.program.TimelinePoint`s) of
        the rank with the largest allocated peak, at the sequence length a rank holds: its highest point
        is ``peak_allocated_bytes``. A pipeline stage's program runs its costliest micro-batch, with the
        other micro-batches it keeps in flight alive until that micro-batch's backward is done.
        `load`: first the model loading (phase "load", `trainmem_nb.step.load.load_timeline`, highest
        point ``load_peak_bytes``), then the step; the optimizer states appear at the step's start."""
        from ..engine.program import timeline

        step = timeline(self.program, *self._shape, max_points)
        if not load:
            return step
        from ..step.load import load_timeline

        before = load_timeline(self.load_trace, max(2, max_points // 5))
        shift = before[-1].step + 1
        return [*before, *(p._replace(step=p.step + shift) for p in step)]

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract (``trainmem estimate --json``)."""
        return {
            "model": self.model.name,
            "family": self.model.family.value,
            "device": self.training.device.value,
            "n_params": self.n_params,
            "n_trainable_params": self.n_trainable_params,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "reserved_from": self.reserved_from,
            "fragmentation_bytes": self.fragmentation_bytes,
            "largest_free_block_bytes": self.largest_free_block_bytes,
            "load_peak_bytes": self.load_peak_bytes,
            "device_total_bytes": self.device_total_bytes,
            "peak_phase": self.peak_phase,
            "peak_at": self.peak_at,
            "breakdown_bytes": self.breakdown_bytes,
            "detail_bytes": dict(self.detail_bytes),
            "phase_peaks_bytes": dict(self.phase_peaks_bytes),
            "saved_activations_bytes": self.saved_activations_bytes,
            "overhead_bytes": dict(self.overhead_bytes),
            "calibration": self.calibration.model_dump() if self.calibration else None,
            "host_bytes": self.host_bytes,
            "host_load_bytes": self.host_load_bytes,
            "parallel": self.parallel.model_dump(mode="json"),
            "per_rank": [r.to_dict() for r in self.per_rank],
            "training": self.training.model_dump(mode="json"),
            "stack": self.training.stack_report(),
            "model_spec": self.model.model_dump(mode="json"),
        }

    def _headline(self) -> str:
        t = self.training
        impl = t.resolved_optimizer_impl.value if t.optimizer.value != "none" else ""
        if impl and self.parallel.engine.value == "megatron":  # its distributed optimizer's own (fused) kernels
            impl = "Megatron's"
        opt = f"{t.optimizer.value} ({impl})" if impl else t.optimizer.value
        method = "" if t.method.value == "full" else f", {t.method.value} r={t.lora_rank} on {t.lora_targets}"
        return (
            f"{self.model.name}: {format_count(self.n_params)} parameters ({format_count(self.n_trainable_params)} "
            f"trained{method}), {t.precision.value}{_fp8_words(t.fp8.value, self.parallel.engine.value)}, {opt}, "
            f"micro-batch {t.micro_batch} x {t.seq_len} tokens, "
            f"checkpointing {t.checkpointing.value}, {t.attention.value} attention, device {t.device.value}"
            f"{_LOSS_NOTES[runs_loss(self.model, t).value].format(chunks=t.loss_chunks)}"
        )

    def summary(self) -> str:
        """A plain-text table for terminals."""
        lines = [
            self._headline(),
            *_stack_lines(self.training, self.parallel),
            f"peak allocated {format_bytes(self.peak_allocated_bytes)} during {self.peak_phase} ({self.peak_at})",
        ]
        total = self.peak_allocated_bytes or 1
        for key, value in self.breakdown_bytes.items():
            lines.append(f"  {key:<17} {format_bytes(value):>12}  {100 * value / total:5.1f} %")
        lines.append(f"peak reserved    {format_bytes(self.peak_reserved_bytes):>12}  (PyTorch's caching allocator)")
        if self.reserved_from == "replay":
            conf = self.training.alloc_conf or "default PYTORCH_CUDA_ALLOC_CONF"
            lines.append(f"  replayed ({conf}): {format_bytes(self.fragmentation_bytes)} cached but unused at the "
                         f"reserved peak, largest free block {format_bytes(self.largest_free_block_bytes)}")
        elif self.reserved_from == "churn model":
            from ..device import REPLAY_MAX_EVENTS

            lines.append(f"  not replayed: the step is beyond the allocator replay's limits (about "
                         f"{REPLAY_MAX_EVENTS:,} allocator events, 1 PiB); reserved = allocated + a fraction of "
                         f"the activations and temporaries")
        elif self.reserved_from == "calibration":
            lines.append("  from the calibration: allocated + its measured fraction of the activations and "
                         "temporaries")
        lines.append(f"device total     {format_bytes(self.device_total_bytes):>12}  (what nvidia-smi shows)")
        lines.append(f"loading peak     {format_bytes(self.load_peak_bytes):>12}  (allocated while the model loads)")
        paged = self.overhead_bytes.get("paged_optimizer_states", 0)
        if paged:
            lines.append(f"  of which {format_bytes(paged)} paged optimizer states (CUDA unified memory, outside "
                         f"the allocator; paged to host RAM when the GPU runs short)")
        if not self.parallel.single_device:
            p = self.parallel
            lines.append(f"layout: {p.gpus} GPU{'s' if p.gpus > 1 else ''} ({p.nodes} node{'s' if p.nodes > 1 else ''}), engine {p.engine.value}, "
                         f"zero {p.zero}, dp {p.dp} x tp {p.tp} x pp {p.pp} x cp {p.cp}, offload {p.offload.value}")
            for r in self.per_rank:
                lines.append(f"  {r.ranks:<28} peak {format_bytes(r.peak_allocated_bytes):>12}  device total "
                             f"{format_bytes(r.device_total_bytes):>12}  ({r.n_layers} layers, peak in {r.peak_phase})")
        if self.host_bytes:
            lines.append(f"host RAM (offload) {format_bytes(self.host_bytes):>10}  per process")
        lines.append(f"host RAM to load   {format_bytes(self.host_load_bytes):>10}  per process (full state dict)")
        from .notes import estimate_notes

        lines.extend(f"note: {n}" for n in estimate_notes(self.model, self.training, self.parallel))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        """One line (notebooks compare outputs: the repr must not grow with every new field)."""
        n = self.parallel.gpus
        where = "" if self.parallel.single_device else (
            f", worst of {len(self.per_rank)} rank group(s) on {n} GPUs" if n > 1
            else f", {self.parallel.engine.value} on 1 GPU")
        return (f"<MemoryEstimate {self.model.name}: peak {format_bytes(self.peak_allocated_bytes)} allocated during "
                f"{self.peak_phase}, {format_bytes(self.device_total_bytes)} device total{where}>")

    def _repr_html_(self) -> str:
        """A compact table for notebooks: the breakdown with bars, the peak and when it happens."""
        total = self.peak_allocated_bytes or 1
        rows = []
        for key in TOP_KEYS:
            value = self.breakdown_bytes[key]
            share = 100 * value / total
            rows.append(
                f"<tr><td>{key}</td><td style='text-align:right'>{format_bytes(value)}</td>"
                f"<td style='text-align:right'>{share:.1f} %</td>"
                f"<td><div style='background:#4c72b0;height:0.8em;width:{share * 1.5:.0f}px'></div></td>"
                f"<td style='color:#666'>{CATEGORY_HELP[key]}</td></tr>"
            )
        return (
            "<div class='trainmem-estimate'>"
            f"<p>{html.escape(self._headline())}</p>"
            "<table><thead><tr><th>category</th><th>bytes</th><th>share</th><th></th><th></th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>"
            f"<p><b>peak allocated {format_bytes(self.peak_allocated_bytes)}</b> during <b>{self.peak_phase}</b> "
            f"({html.escape(self.peak_at)}) &middot; reserved {format_bytes(self.peak_reserved_bytes)} "
            f"&middot; device total {format_bytes(self.device_total_bytes)}</p></div>"
        )


def _stack_lines(t: TrainingSpec, p: ParallelSpec) -> list[str]:
    """The stack and versions the estimate assumed, what it set that this step runs, and what of it is not
    modelled. An option the step never reaches (the stack's Adafactor under AdamW, FSDP's options on one
    device) is left out of "it sets": it would read as if it had changed the numbers."""
    s = t.resolved_stack
    lines = [s.describe()]
    set_here = [_plain(t, k) for k in s.options if k not in t.model_fields_set and _reaches(k, t, p)]
    if set_here:
        lines.append(f"  it sets {', '.join(set_here)}")
    lines += [f"  not modelled: {m}" for m in s.not_modelled]
    return lines


def _reaches(key: str, t: TrainingSpec, p: ParallelSpec) -> bool:
    """Does the stack option `key` take part in this step?"""
    if key == "adafactor":
        return t.optimizer.value == "adafactor"
    if key in ("fsdp_version", "use_orig_params", "sync_module_states"):
        return p.engine.value == "fsdp"
    if key in ("bnb_saves_input", "qlora_quant_storage"):
        return t.method.value == "qlora"
    if key in ("lora_dtype", "lora_dropout"):
        return t.method.value != "full"
    if key == "optimizer_impl":
        return t.optimizer in STACK_IMPL_OPTIMIZERS
    if key == "cuda_lazy_loading":
        return t.device.value == "cuda"
    return True


def _plain(t: TrainingSpec, key: str) -> str:
    value = getattr(t, key)
    return f"{key}={'default' if value is None else getattr(value, 'value', value)}"  # None: PyTorch's default


#: How the headline names a memory-efficient loss, with the version it is modelled from (`recipes.head`).
_LOSS_NOTES: dict[str, str] = {
    "standard": "",
    "chunked": f", loss chunked in {{chunks}} (torchtune {_head.TORCHTUNE_VERSION} LinearCrossEntropyLoss)",
    "liger": f", loss: Liger Kernel {_head.LIGER_VERSION} fused linear cross-entropy",
    "cce": f", loss: Cut Cross-Entropy {_head.CCE_VERSION}",
    "litgpt": f", head and loss in {_head.LITGPT_CHUNK}-token chunks (litgpt {_head.LITGPT_VERSION})",
}


def _fp8_words(recipe: str, engine: str) -> str:
    """The headline's words for fp8 training (`TrainingSpec.fp8`): nothing without it; whose linears run it (Megatron
    runs Transformer Engine's, the other engines torchao's)."""
    if recipe == "none":
        return ""
    kernels = "Transformer Engine" if engine == "megatron" else "torchao Float8Linear, eager"
    return f" with {recipe} fp8 matmuls ({kernels})"

