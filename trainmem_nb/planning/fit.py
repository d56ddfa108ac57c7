"""Will it fit? A verdict on one GPU with headroom, the largest micro-batch and the fewest GPUs.

>>> import trainmem_nb as tm
>>> est = tm.estimate("llama-3.2-1b", micro_batch=1, seq_len=2048)
>>> tm.fit(est, "H100").verdict
'fits'
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ..errors import SpecError
from ..estimator.api import estimate
from ..estimator.result import MemoryEstimate
from ..model.presets import resolve_model
from ..model.spec import ModelSpec
from ..parallel.checks import check_layout
from ..spec.parallel import ParallelSpec, build_parallel
from ..spec.training import TrainingSpec, build_training
from ..step.reserved import replayed, replaying, screening
from ..units import format_bytes
from .assumptions import check_count, check_headroom
from .gpus import GPU, _precision_for, get_gpu

if TYPE_CHECKING:
    pass

__all__ = ['DEFAULT_HEADROOM', 'Fit', 'fewest_gpus', 'fit', 'max_micro_batch']

# ----------------------------------------------------------------------------------------------------------
# Numbers from the world (each with its source). Override any of them per call.

#: Fraction of the card kept free by default: allocator fragmentation and spikes the model cannot see.
DEFAULT_HEADROOM = 0.10

#: Largest micro-batch any search tries.
MICRO_BATCH_SEARCH_LIMIT = 4096


# ----------------------------------------------------------------------------------------------------------
# Fit


@dataclass(frozen=True)
class Fit:
    """Whether one training step fits a GPU. Bytes are ``int``; ``margin_fraction`` = spare / usable
    (negative when it does not fit)."""

    verdict: Literal["fits", "tight", "oom"]  #: tight: fits the card, not with the headroom
    gpu: str
    needed_bytes: int  #: device_total_bytes of the worst rank (what nvidia-smi would show)
    usable_bytes: int  #: the GPU's memory.total
    headroom: float
    margin_fraction: float
    message: str
    notes: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        """True when it fits with the headroom."""
        return self.verdict == "fits"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready fields."""
        return {"verdict": self.verdict, "gpu": self.gpu, "needed_bytes": self.needed_bytes,
                "usable_bytes": self.usable_bytes, "headroom": self.headroom,
                "margin_fraction": self.margin_fraction, "message": self.message, "notes": list(self.notes)}


def _check_headroom(headroom: Any) -> float:
    return check_headroom(headroom)


def _check_estimate(estimate: Any, caller: str) -> MemoryEstimate:
    if not isinstance(estimate, MemoryEstimate):
        raise SpecError(f"{caller}() takes a MemoryEstimate from tm.estimate(...), got {type(estimate).__name__}")
    return estimate


def needed_bytes(est: MemoryEstimate) -> int:
    """What must fit on each GPU: the worst rank's device total (nvidia-smi view), or what loading the
    model allocates with the CUDA context, when that is more."""
    worst = est.device_total_bytes
    for rank in est.per_rank or ():
        worst = max(worst, int(getattr(rank, "device_total_bytes", 0) or 0))
    context = est.device_total_bytes - est.peak_reserved_bytes
    return int(max(worst, est.load_peak_bytes + context))


def _verdict(needed: int, usable: int, headroom: float) -> tuple[Literal["fits", "tight", "oom"], float]:
    margin = (usable - needed) / usable
    if needed <= usable * (1.0 - headroom):
        return "fits", margin
    return ("tight" if needed <= usable else "oom"), margin


def _fit_notes(est: MemoryEstimate, g: GPU, headroom: float = DEFAULT_HEADROOM) -> tuple[str, ...]:
    from ..estimator.notes import estimate_notes

    t = est.training
    notes = list(estimate_notes(est.model, t, est.parallel))
    if t.precision.value.startswith("bf16") and not g.supports_bf16:
        swap = t.precision.value.replace("bf16", "fp16")
        notes.append(f"{g.name} has no bf16: train with precision='{swap}' (same memory, loss scaling)")
    if t.fp8.value != "none" and not g.supports_fp8:
        notes.append(f"{g.name} has no fp8 tensor cores: torch._scaled_mm needs compute capability 8.9 or later "
                     "(Ada, Hopper, Blackwell); train with fp8='none' on it")
    workspaces = int(est.detail_bytes.get("weights/fp8_workspaces", 0))
    if workspaces and g.architecture.lower().startswith("blackwell"):
        # transformer_engine/pytorch/tensor/float8_tensor.py:423-427: no transpose where non-TN fp8 GEMMs exist
        notes.append(f"{g.name} is a Blackwell GPU: Transformer Engine keeps one fp8 copy of each weight, not a copy and "
                     f"its transpose as on Hopper, which the estimate counts ({format_bytes(workspaces // 2)} less)")
    if t.device.value != "cuda":
        notes.append(f"the estimate is for device='{t.device.value}': no CUDA context or allocator cache counted; "
                     "use device='cuda' to plan a GPU")
    if g.vendor.upper() != "NVIDIA":
        notes.append(f"the estimate models PyTorch's CUDA allocator; on {g.vendor} treat the fit as approximate")
    if g.memory_bytes_source.startswith("derived"):
        notes.append(f"{g.name}'s usable memory is derived from its marketed size ({g.memory_bytes_source})")
    paged = int(est.overhead_bytes.get("paged_optimizer_states", 0))
    if paged and needed_bytes(est) > g.memory_bytes * (1.0 - headroom) >= needed_bytes(est) - paged:
        notes.append(f"{format_bytes(paged)} of it are paged optimizer states (CUDA unified memory): short of "
                     f"room, the driver pages them to host RAM and the step still runs, slower")
    return tuple(notes)


def fit(estimate: MemoryEstimate, gpu: str | GPU, headroom: float = DEFAULT_HEADROOM) -> Fit:
    """Does this step fit `gpu` with `headroom` (a fraction of the card) kept free?

    ``needed_bytes`` is the worst rank's ``device_total_bytes`` (CUDA context and allocator cache
    included), compared with the GPU's ``memory_bytes`` (nvidia-smi's total).

    >>> import trainmem_nb as tm
    >>> f = tm.fit(tm.estimate("llama-2-7b", micro_batch=1, seq_len=2048), "A100 40GB")
    >>> f.verdict, f.message.split(":")[0]
    ('oom', 'OOM on A100 SXM 40GB')
    """
    estimate = _check_estimate(estimate, "fit")
    headroom = _check_headroom(headroom)
    g = get_gpu(gpu)
    need, usable = needed_bytes(estimate), g.memory_bytes
    verdict, margin = _verdict(need, usable, headroom)
    if verdict == "fits":
        message = f"fits {g.name} with {margin:.0%} to spare ({format_bytes(need)} of {format_bytes(usable)})"
    elif verdict == "tight":
        message = (f"tight on {g.name}: {format_bytes(need)} of {format_bytes(usable)}, {margin:.0%} spare, "
                   f"under the {headroom:.0%} headroom")
    else:
        over = f"{-margin:.0%} over" if -margin < 1 else f"{need / usable:.1f}x the card"
        message = f"OOM on {g.name}: needs {format_bytes(need)} of {format_bytes(usable)} ({over})"
    notes = _fit_notes(estimate, g, headroom)
    if verdict != "fits" and estimate.training.device.value == "cuda":
        verdict, margin, message, notes = _on_card(estimate, g, headroom, verdict, margin, message, notes)
    return Fit(verdict, g.name, need, usable, headroom, margin, message, notes)


def _on_card(est: MemoryEstimate, g: GPU, headroom: float, verdict: Literal["fits", "tight", "oom"], margin: float,
             message: str, notes: tuple[str, ...]) -> tuple[Literal["fits", "tight", "oom"], float, str, tuple[str, ...]]:
    """The step replayed on the card itself (`replay_on_card`, loading first): reserved beyond the card is
    cache the allocator frees and retries under pressure, so the step may run; or it fails although the
    tensors fit, for want of one free block large enough."""
    from ..step.compile import _SINGLE, compile_step, program_key
    from ..step.load import loading_events
    from ..step.reserved import replay_on_card

    if not est.parallel.single_device or len(est.per_rank) > 1 or not replaying() or est.reserved_from != "replay":
        return verdict, margin, message, notes  # ranks' programs are folded: the headline reserved decides
    t, context = est.training, est.device_total_bytes - est.peak_reserved_bytes
    floor = max(est.load_peak_bytes, est.peak_allocated_bytes) + context  # no cache can go below the tensors
    if floor > g.memory_bytes:
        return verdict, margin, message, notes  # the tensors alone do not fit: no replay can help
    unrolled = compile_step(est.model, program_key(t, est.model), _SINGLE,
                            est.calibration.workspace_bytes if est.calibration else None, unrolled=True)
    b, s, load = t.micro_batch, t.seq_len, loading_events(est.model, t)
    with_room = int(g.memory_bytes * (1.0 - headroom)) - context
    if floor <= g.memory_bytes * (1.0 - headroom) and (
            replay_on_card(unrolled, b, s, t.alloc_conf, with_room, load) is None):
        return "fits", headroom, (f"fits {g.name} with {headroom:.0%} kept free: the allocator's cache would grow to "
                                  f"{format_bytes(est.peak_reserved_bytes)} with memory to spare, but on the card it "
                                  f"frees cached blocks and retries (replayed)"), notes
    oom = replay_on_card(unrolled, b, s, t.alloc_conf, g.memory_bytes - context, load)
    if oom is None and verdict == "tight":
        return verdict, margin, message, notes
    if oom is None:
        spare = (g.memory_bytes - est.peak_allocated_bytes - context) / g.memory_bytes
        return "tight", spare, (f"tight on {g.name}: it runs (replayed on the card, the allocator frees its cache "
                                f"under pressure) but not with the {headroom:.0%} headroom"), notes
    if oom.get("fragmentation") and est.peak_allocated_bytes + context <= g.memory_bytes:
        notes = (*notes, f"the tensors fit ({format_bytes(est.peak_allocated_bytes)} allocated at the peak), but no "
                         f"free block of {format_bytes(int(oom['requested']))} exists when it is requested "
                         f"({format_bytes(int(oom['total_free']))} free in all, the largest block "
                         f"{format_bytes(int(oom['largest_free_block']))}): try alloc_conf='expandable_segments:True'")
    if verdict == "oom":
        return verdict, margin, message, notes
    return "oom", margin, (f"OOM on {g.name}: {format_bytes(needed_bytes(est))} would fit, but replayed on the card the "
                           f"allocator runs out of blocks"), notes


def _split_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    par = {k: v for k, v in options.items() if k in ParallelSpec.model_fields}
    train = {k: v for k, v in options.items() if k not in ParallelSpec.model_fields}
    return train, par


def _training_dict(training: TrainingSpec | Mapping[str, Any] | None, options: Mapping[str, Any]) -> dict[str, Any]:
    """The given training options (only those set explicitly), keywords winning."""
    data: dict[str, Any] = {}
    if isinstance(training, TrainingSpec):
        data.update({k: getattr(training, k) for k in training.model_fields_set})
    elif isinstance(training, Mapping):
        data.update(training)
    elif training is not None:
        raise SpecError(f"training must be a TrainingSpec or a dict, got {type(training).__name__}")
    data.update({k: v for k, v in options.items() if v is not None})
    build_training(None, **data)  # validate early with the usual messages
    return data


def max_micro_batch(model: Any, gpu: str | GPU, headroom: float = DEFAULT_HEADROOM, *,
                    training: TrainingSpec | Mapping[str, Any] | None = None,
                    parallel: ParallelSpec | Mapping[str, Any] | None = None,
                    limit: int = MICRO_BATCH_SEARCH_LIMIT, **options: Any) -> int:
    """The largest micro-batch whose step fits `gpu` with `headroom`; 0 if not even one sequence fits.

    Doubling then bisection: about 2·log2(answer) estimates (~0.2 ms each for one GPU). bf16 recipes are
    estimated as fp16 on GPUs without bf16.

    >>> max_micro_batch("gpt2", "T4", seq_len=1024) > 0
    True
    """
    headroom = _check_headroom(headroom)
    limit = check_count(limit, "limit", 1, 1 << 20)
    g = get_gpu(gpu)
    m = resolve_model(model)
    train_opts, par_opts = _split_options(options)
    data = _training_dict(training, train_opts)
    if "micro_batch" in options:
        raise SpecError("max_micro_batch searches micro_batch: leave it out of the options")
    data["precision"] = _precision_for(str(build_training(None, **data).precision.value), g)
    p = build_parallel(parallel, **par_opts)
    ev = _Evaluator(m, data)
    best = ev.max_micro_batch(p, {}, g.memory_bytes * (1.0 - headroom), limit)
    # one device: the answer is the largest micro-batch `fit` says fits (it replays the allocator on the card,
    # where a step whose cache would outgrow the card may still fit); the search screened without replaying
    # (at most a few steps each way: the screen is within a few micro-batches of the replay's answer)
    for _ in range(4 if replaying() else 0):
        if not (p.single_device and best > 0 and not fit(ev.estimate(p, {"micro_batch": best}), g, headroom).fits):
            break
        best -= 1  # the search screened without the replay: the answer is what `fit` says fits
    for _ in range(4 if replaying() else 0):
        if not (p.single_device and best < limit and fit(ev.estimate(p, {"micro_batch": best + 1}), g, headroom).fits):
            break
        best += 1
    return best


def fewest_gpus(model: Any, gpu: str | GPU, headroom: float = DEFAULT_HEADROOM, *,
                training: TrainingSpec | Mapping[str, Any] | None = None, max_gpus: int = 1024,
                **options: Any) -> ParallelSpec | None:
    """The smallest layout (a `ParallelSpec` with ``gpus`` and ``nodes`` filled in) that fits `gpu`, or None.

    Other parallel options (engine, zero, tp, pp, offload...) are kept as given; without any, ZeRO-3
    full sharding (``engine='fsdp', zero=3``) is used, the layout whose memory falls as GPUs are added.
    Nodes hold ``gpu.gpus_per_node`` GPUs.

    >>> fewest_gpus("gpt2", "T4", seq_len=512).gpus
    1
    """
    headroom = _check_headroom(headroom)
    max_gpus = check_count(max_gpus, "max_gpus")
    g = get_gpu(gpu)
    m = resolve_model(model)
    train_opts, par_opts = _split_options(options)
    if "gpus" in par_opts or "nodes" in par_opts:
        raise SpecError("fewest_gpus searches gpus and nodes: leave them out of the options")
    data = _training_dict(training, train_opts)
    data["precision"] = _precision_for(str(build_training(None, **data).precision.value), g)
    layout = par_opts or {"engine": "fsdp", "zero": 3}
    check_fixed_layout(m, layout)  # an impossible layout says why, instead of "nothing fits"
    ev = _Evaluator(m, data)
    limit = g.memory_bytes * (1.0 - headroom)
    reasons: list[str] = []
    tried = 0
    for n in _gpu_counts(g, max_gpus, model_parallel(layout)):
        try:
            p = _layout(m, g, n, layout)
        except SpecError as exc:
            reasons.append(f"{n} GPUs: {exc}")
            continue
        try:
            need = ev.needed(p, {})
        except SpecError as exc:
            reasons.append(f"{n} GPUs: {exc}")
            continue
        tried += 1
        if need <= limit:
            return p
    if not tried:
        first = reasons[0] if reasons else f"no GPU count up to max_gpus={max_gpus}"
        raise SpecError(f"fewest_gpus: no GPU count up to {max_gpus} can hold this layout on {g.name} ({first})")
    return None


# ----------------------------------------------------------------------------------------------------------
# Evaluating many layouts fast: estimates do not depend on the GPU type, so one cache serves them all.


class _Evaluator:
    """Worst-rank device bytes for (layout, training overrides), cached across GPU types."""

    def __init__(self, m: ModelSpec, base: Mapping[str, Any]) -> None:
        self.m = m
        self.base = dict(base)
        self.cache: dict[tuple[Any, ...], int | Exception] = {}
        self.estimates: dict[tuple[Any, ...], MemoryEstimate] = {}
        self.searches: dict[tuple[Any, ...], int] = {}  # GPUs of equal memory share an answer

    def _key(self, p: ParallelSpec, over: Mapping[str, Any]) -> tuple[Any, ...]:
        return (p, tuple(sorted(over.items())))

    def training(self, over: Mapping[str, Any]) -> TrainingSpec:
        return build_training(None, **{**self.base, **over})

    def estimate(self, p: ParallelSpec, over: Mapping[str, Any], replay: bool = False) -> MemoryEstimate:
        """The estimate of (layout, overrides); `replay`: with the allocator replayed even inside a
        `screening` search (what a search reports), else as the caller's context has it."""
        key = (*self._key(p, over), replay)
        if key not in self.estimates:
            with replayed() if replay else nullcontext():
                self.estimates[key] = estimate(self.m, self.training(over), parallel=p)
        return self.estimates[key]

    def needed(self, p: ParallelSpec, over: Mapping[str, Any]) -> int:
        """Bytes per GPU (worst rank); raises SpecError for layouts the estimator rejects."""
        key = self._key(p, over)
        hit = self.cache.get(key)
        if hit is None:
            try:
                with screening():  # the search tries many steps: the reported ones are replayed (`estimate`)
                    hit = needed_bytes(estimate(self.m, self.training(over), parallel=p))
            except (SpecError, ImportError, NotImplementedError) as exc:
                hit = exc
            except Exception as exc:  # a layout the per-rank simulation fails on: rejected with its reason,
                if p.gpus == 1:        # the search goes on; one GPU is the core path and must not fail
                    raise
                hit = exc
            self.cache[key] = hit
        if isinstance(hit, Exception):
            if isinstance(hit, SpecError):
                raise hit
            raise SpecError(f"cannot estimate this layout: {type(hit).__name__}: {hit}") from hit
        return hit

    def max_micro_batch(self, p: ParallelSpec, over: Mapping[str, Any], limit_bytes: float,
                        cap: int = MICRO_BATCH_SEARCH_LIMIT) -> int:
        """Largest micro-batch <= cap with needed <= limit_bytes (monotone in the micro-batch)."""
        key = (*self._key(p, over), int(limit_bytes), cap)
        if key not in self.searches:
            self.searches[key] = self._search(p, over, limit_bytes, cap)
        return self.searches[key]

    def _search(self, p: ParallelSpec, over: Mapping[str, Any], limit_bytes: float, cap: int) -> int:
        def ok(b: int) -> bool:
            return self.needed(p, {**over, "micro_batch": b}) <= limit_bytes

        if cap < 1:
            return 0
        # one sequence and several are different step programs: try 2 first, 1 only if 2 does not fit
        if cap == 1 or not ok(2):
            return 1 if ok(1) else 0
        lo = 2
        while lo < cap:
            hi = min(2 * lo, cap)
            if not ok(hi):
                break
            lo = hi
        else:
            return lo
        while hi - lo > 1:  # ok(lo) and not ok(hi)
            mid = (lo + hi) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
        return lo


def _gpu_counts(g: GPU, max_gpus: int, step: int = 1) -> list[int]:
    """The counts the planner tries: 1, 2, 4, ... up to a node, then whole nodes doubling; those a layout's
    model parallelism (`step` = tp * pp * cp) divides, and `step` doubling besides (tp=4 with pp=3 runs on
    12, 24, ... GPUs, which no power of two is a multiple of)."""
    counts, n = [], 1
    while n < g.gpus_per_node and n <= max_gpus:
        counts.append(n)
        n *= 2
    n = g.gpus_per_node
    while n <= max_gpus:
        counts.append(n)
        n *= 2
    n = step
    while n <= max_gpus:
        counts.append(n)
        n *= 2
    return sorted({c for c in counts if c % step == 0})


def model_parallel(layout: Mapping[str, Any]) -> int:
    """tp * pp * cp of a (partial) layout: every GPU count must be a multiple of it."""
    return int(layout.get("tp") or 1) * int(layout.get("pp") or 1) * int(layout.get("cp") or 1)


def check_fixed_layout(m: ModelSpec, layout: Mapping[str, Any]) -> None:
    """Fail at once, with the reason, for a layout no GPU count can make valid (tp not dividing the
    heads, more stages than layers, an engine that cannot offload...): built on the smallest GPU count
    it allows (tp * pp * cp GPUs, or the count it fixes)."""
    probe = {k: v for k, v in layout.items() if v is not None and k != "nodes"}
    if "gpus" in layout and layout["gpus"] is not None:
        probe["nodes"] = layout.get("nodes") or 1
    probe.setdefault("gpus", model_parallel(probe))
    p = build_parallel(None, **probe)
    check_layout(m, p)


def _layout(m: ModelSpec, g: GPU, n: int, layout: Mapping[str, Any]) -> ParallelSpec:
    """A validated layout of `n` GPUs on nodes of ``g.gpus_per_node`` (raises SpecError)."""
    data = {k: v for k, v in layout.items() if v is not None}
    data["gpus"] = n
    data.setdefault("nodes", max(1, -(-n // g.gpus_per_node)))
    p = build_parallel(None, **data)
    check_layout(m, p)
    return p
