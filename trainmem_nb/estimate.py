"""``estimate()``: one training step's per-device memory, its peak and when the peak happens.

>>> import trainmem_nb as tm
>>> est = tm.estimate("gpt2", micro_batch=4, seq_len=512, precision="fp32", device="cpu")
>>> est.peak_phase, round(est.peak_allocated_bytes / 2**30, 2)
('backward', 4.52)
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .breakdown import TOP_KEYS, roll_up
from .device import Calibration, load_calibration
from .parallelism import ParallelSpec, build_parallel, check_layout
from .presets import resolve_model
from .specs import ModelSpec, SpecError, TrainingSpec, build_training
from .units import format_bytes, format_count

__all__ = ["MemoryEstimate", "check_model_options", "estimate"]

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
    keys (``activations/layers``). ``peak_reserved_bytes`` adds the caching allocator's unused
    cache, ``device_total_bytes`` the CUDA context (what nvidia-smi shows).
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

    @property
    def breakdown_bytes(self) -> dict[str, int]:
        """The top-level categories at the peak; they sum to ``peak_allocated_bytes``."""
        return roll_up(self.detail_bytes)

    @property
    def saved_activations_bytes(self) -> int:
        """Activations alive at the end of the forward pass (kept for backward), in bytes."""
        from .simulate import activations_at_forward_end

        return activations_at_forward_end(self.program, self.training.micro_batch, self.training.seq_len)

    @property
    def host_load_bytes(self) -> int:
        """Host RAM one process needs to load the model: the full state dict in the weights' dtype
        (16-bit for QLoRA, which quantizes while moving to the GPU). Each data-parallel process pays
        it unless the model is loaded on rank 0 only or built on the meta device."""
        from .params import weight_tensors
        from .specs import Method

        t = self.training
        dt = 2 if t.method is Method.QLORA and t.param_bytes == 4 and not t.mixed else None
        total = 0
        for p, pdt, _ in weight_tensors(self.model, t):
            total += p.numel * p.count * (dt or (2 if t.method is Method.QLORA and pdt < 1 else pdt))
        return int(total)

    def timeline(self, max_points: int = 1500) -> list[Any]:
        """Live bytes after each operation of the step (`trainmem_nb.simulate.TimelinePoint`s), of the
        worst rank's program. Under pipeline parallelism that program runs one micro-batch: the other
        micro-batches' activations a stage keeps are in the peak but not drawn."""
        from .simulate import timeline

        return timeline(self.program, self.training.micro_batch, self.training.seq_len, max_points)

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
            "model_spec": self.model.model_dump(mode="json"),
        }

    def _headline(self) -> str:
        t = self.training
        impl = t.resolved_optimizer_impl.value if t.optimizer.value != "none" else ""
        opt = f"{t.optimizer.value} ({impl})" if impl else t.optimizer.value
        method = "" if t.method.value == "full" else f", {t.method.value} r={t.lora_rank} on {t.lora_targets}"
        return (
            f"{self.model.name}: {format_count(self.n_params)} parameters ({format_count(self.n_trainable_params)} "
            f"trained{method}), {t.precision.value}, {opt}, micro-batch {t.micro_batch} x {t.seq_len} tokens, "
            f"checkpointing {t.checkpointing.value}, {t.attention.value} attention, device {t.device.value}"
        )

    def summary(self) -> str:
        """A plain-text table for terminals."""
        lines = [
            self._headline(),
            f"peak allocated {format_bytes(self.peak_allocated_bytes)} during {self.peak_phase} ({self.peak_at})",
        ]
        total = self.peak_allocated_bytes or 1
        for key, value in self.breakdown_bytes.items():
            lines.append(f"  {key:<17} {format_bytes(value):>12}  {100 * value / total:5.1f} %")
        lines.append(f"peak reserved    {format_bytes(self.peak_reserved_bytes):>12}  (PyTorch's caching allocator)")
        lines.append(f"device total     {format_bytes(self.device_total_bytes):>12}  (what nvidia-smi shows)")
        paged = self.overhead_bytes.get("paged_optimizer_states", 0)
        if paged:
            lines.append(f"  of which {format_bytes(paged)} paged optimizer states (CUDA unified memory, outside "
                         f"the allocator; paged to host RAM when the GPU runs short)")
        if not self.parallel.single_device:
            p = self.parallel
            lines.append(f"layout: {p.gpus} GPUs ({p.nodes} node{'s' if p.nodes > 1 else ''}), engine {p.engine.value}, "
                         f"zero {p.zero}, dp {p.dp} x tp {p.tp} x pp {p.pp} x cp {p.cp}, offload {p.offload.value}")
            for r in self.per_rank:
                lines.append(f"  {r.ranks:<28} peak {format_bytes(r.peak_allocated_bytes):>12}  device total "
                             f"{format_bytes(r.device_total_bytes):>12}  ({r.n_layers} layers, peak in {r.peak_phase})")
        if self.host_bytes:
            lines.append(f"host RAM (offload) {format_bytes(self.host_bytes):>10}  per process")
        lines.append(f"host RAM to load   {format_bytes(self.host_load_bytes):>10}  per process (full state dict)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        """One line (notebooks compare outputs: the repr must not grow with every new field)."""
        where = "" if self.parallel.single_device else f", worst of {len(self.per_rank)} rank group(s) on {self.parallel.gpus} GPUs"
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


def estimate(
    model: str | ModelSpec | Mapping[str, Any] | int | float | None = None,
    training: TrainingSpec | Mapping[str, Any] | None = None,
    *,
    parallel: ParallelSpec | Mapping[str, Any] | None = None,
    hf_config: str | Path | Mapping[str, Any] | None = None,
    params: int | float | None = None,
    calibration: Calibration | Mapping[str, Any] | str | Path | None = None,
    **options: Any,
) -> MemoryEstimate:
    """Simulate one steady-state training step and return its per-device memory.

    `model` is a preset name or Hugging Face repo id, a `ModelSpec`, a config dict or a parameter
    count (or pass ``hf_config=`` a path/dict, or ``params=`` a count); `options` are `TrainingSpec`
    fields (micro_batch, seq_len, grad_accum, precision, optimizer, optimizer_impl, checkpointing,
    attention, dropout, device, method, lora_*) and `ParallelSpec` fields (gpus, nodes, engine, zero,
    tp, sp, pp, pp_schedule, virtual_stages, cp, ep, offload). With a parallel layout the headline
    numbers are the worst rank's and ``per_rank`` holds every distinct rank. `calibration` (from
    ``trainmem measure --device cuda``) replaces the modelled CUDA context and allocator constants.
    """
    m = _resolve(model, hf_config, params)
    par_opts = {k: options.pop(k) for k in list(options) if k in ParallelSpec.model_fields}
    t = build_training(training, **options)
    p = build_parallel(parallel, **par_opts)
    check_model_options(m, t)
    check_layout(m, p)
    cal = load_calibration(calibration)
    from .simulate import simulate

    return simulate(m, t, cal, p)  # type: ignore[return-value]


def _resolve(model: Any, hf_config: Any, params: Any) -> ModelSpec:
    given = [x is not None for x in (model, hf_config, params)]
    if sum(given) != 1:
        raise SpecError("name the model exactly once: model=NAME|spec|dict, hf_config=PATH, or params=N")
    if hf_config is not None:
        return ModelSpec.from_hf_config(hf_config)
    if params is not None:
        return ModelSpec.from_params(params)
    return resolve_model(model)


def check_model_options(m: ModelSpec, t: TrainingSpec) -> None:
    """Options that cannot run on this model: a clear error instead of a silent wrong number."""
    if t.seq_len > m.max_positions:
        raise SpecError(
            f"seq_len={t.seq_len} exceeds {m.name}'s max_positions={m.max_positions}; "
            f"use seq_len <= {m.max_positions}"
        )
    if t.attention.value == "flash" and t.device.value == "cpu":
        raise SpecError("attention='flash' (flash-attention 2) runs only on CUDA; use attention='sdpa' with device='cpu'")
    if t.method.value != "full":
        from .params import lora_modules, lora_moe_params

        lora_modules(m, t.lora_targets)  # raises when the targets match nothing
        if t.lora_dropout and lora_moe_params(m, t.lora_targets):
            raise SpecError(f"lora_dropout={t.lora_dropout:g} with lora_targets={t.lora_targets!r} on {m.family.value}: "
                            "peft's ParamWrapper (the router's and experts' adapters) does not work with "
                            "lora_dropout != 0; use lora_dropout=0 or lora_targets='qv'")
