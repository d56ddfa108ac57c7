"""What-if sweeps: every combination of options as one row of a tidy pandas DataFrame.

>>> import trainmem_nb as tm
>>> df = tm.sweep("llama-3-8b", micro_batch=[1, 2, 4], seq_len=[1024, 2048], checkpointing="full")
>>> list(df.columns[:4]), len(df)
(['model', 'micro_batch', 'seq_len', 'checkpointing'], 6)

Combinations that share a step program (same model and options, other batch shapes) are evaluated
together with numpy: the same integer arithmetic as `trainmem_nb.engine.program.evaluate`, for thousands
of batch shapes at once. pandas and numpy are imported here only.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..device import CUDA_BLOCK_BYTES
from ..engine.breakdown import DETAIL_KEYS, TOP_KEYS
from ..engine.program import Program
from ..errors import SpecError
from ..estimator.api import check_model_options
from ..model.params import as_built
from ..model.presets import resolve_model
from ..model.spec import ModelSpec
from ..spec.choices import Device
from ..spec.parallel import ParallelSpec
from ..spec.training import TrainingSpec, build_training
from ..step.compile import compile_step, program_key
from ..step.optimizers import paged_state_bytes

__all__ = ["evaluate_many", "sweep"]

#: Columns of the memory figures, after the swept options.
FIGURES = ("peak_allocated_bytes", "peak_reserved_bytes", "device_total_bytes", "peak_phase",
           *(f"{k}_bytes" for k in TOP_KEYS), "saved_activations_bytes", "n_params", "n_trainable_params")


#: Options for which None is a value of its own (the model config's dropout; the device's default kernels).
_NONE_IS_A_VALUE = frozenset({"dropout", "optimizer_impl"})


def _as_list(value: Any, key: str) -> list[Any]:
    """The values swept for option `key`: a list (or any iterable but text and specs), else one value.
    An empty list or a None in it is refused, naming the option."""
    from pydantic import BaseModel

    scalar = isinstance(value, (str, bytes, Mapping, BaseModel))  # a spec is one value, not its fields
    if isinstance(value, (list, tuple, range)) or (hasattr(value, "__iter__") and not scalar):
        values = list(value)
        if not values:
            raise SpecError(f"{key}=[]: an empty list sweeps nothing; give at least one value")
    else:
        values = [value]
    if key not in _NONE_IS_A_VALUE and any(v is None for v in values):
        raise SpecError(f"{key}={values!r}: None is not a value to sweep; leave the option out for its default")
    return values


def evaluate_many(prog: Program, batch: Sequence[int], seq: Sequence[int], churn_fraction: float = 0.0) -> dict[str, Any]:
    """Peak, phase, top-level breakdown and saved activations of `prog` for many (b, s) at once,
    equal to `evaluate` (and `activations_at_forward_end`) for each pair; and the reserved memory's
    high-water mark for `churn_fraction` (`peak_with_churn`)."""
    import numpy as np

    b = np.asarray(batch, dtype=np.int64)
    s = np.asarray(seq, dtype=np.int64)
    n = b.size
    mono = [np.ones(n, dtype=np.int64), b, s, b * s, s * s, b * s * s]
    top_of = np.array([TOP_KEYS.index(k.split("/")[0]) for k in DETAIL_KEYS])
    blk = CUDA_BLOCK_BYTES

    def rounded(x: Any) -> Any:
        # to the nearest byte first, as `trainmem_nb.engine.program._round` (Python's round, half to even, is
        # np.rint's): a fractional size such as an NF4 weight's numel x bytes-per-element lands a hair above
        # its integer value, and ceil would take it to the next 512-B block
        x = np.rint(x) if x.dtype.kind == "f" else x
        return (-(-x.astype(np.int64) // blk)) * blk

    init = np.zeros((len(TOP_KEYS), n), dtype=np.int64)
    acts = np.zeros(n, dtype=np.int64)
    for cat, sz, count in prog.init:
        v = rounded(sz.c0 + sz.b_ * b + sz.s_ * s + sz.bs * mono[3] + sz.ss * mono[4] + sz.bss * mono[5]) * count
        init[top_of[cat]] += v
        if DETAIL_KEYS[cat].startswith("activations/"):
            acts += v
    total = init.sum(axis=0)
    best = total.copy()
    # the high-water mark of allocated + churn_fraction * (activations + transient), as peak_with_churn
    weight = np.array([1 + churn_fraction if k in ("activations", "transient") else 1.0 for k in TOP_KEYS])
    total_w = (weight[:, None] * init).sum(axis=0)
    high = total_w.copy()
    best_seg = np.full(n, -1)
    best_ev = np.zeros(n, dtype=np.int64)
    best_reps = np.zeros(n, dtype=np.int64)
    sizes_all: list[Any] = []
    in_forward = True
    done: dict[int, tuple[Any, ...]] = {}  # by `Program.same_as`: a layer's repetitions share their bytes
    for si, seg in enumerate(prog.segments):
        if not seg.events or seg.repeat <= 0:
            sizes_all.append(None)
            continue
        hit = done.get(prog.same_as[si])
        if hit is None:
            hit = done[si] = _segment_bytes(seg, b, s, mono, rounded, weight[top_of[np.array([e[0] for e in seg.events])]])
        sizes, pmax, pidx, net, run_w = hit
        sizes_all.append(sizes)
        reps_before = np.where(net > 0, seg.repeat - 1, 0)
        cand = total + reps_before * net + pmax
        better = (pmax > 0) & (cand > best)
        best = np.where(better, cand, best)
        best_seg = np.where(better, si, best_seg)
        best_ev = np.where(better, pidx, best_ev)
        best_reps = np.where(better, reps_before, best_reps)
        if seg.phase != "forward":
            in_forward = False
        if in_forward:
            cats = np.array([c for c, _, _, _ in seg.events])
            acts += (sizes[np.array([DETAIL_KEYS[c].startswith("activations/") for c in cats])].sum(axis=0)
                     * seg.repeat)
        total = total + net * seg.repeat
        net_w = run_w[-1]
        high = np.maximum(high, total_w + np.where(net_w > 0, (seg.repeat - 1) * net_w, 0) + run_w.max(axis=0))
        total_w = total_w + net_w * seg.repeat
    # breakdown at each combination's peak: whole segments before it, then the winning prefix
    breakdown = init.copy()
    for si, seg in enumerate(prog.segments):
        sizes = sizes_all[si]
        if sizes is None:
            continue
        tops = top_of[np.array([c for c, _, _, _ in seg.events])]
        before = best_seg > si
        at = best_seg == si
        if before.any():
            per_top = np.zeros((len(TOP_KEYS), n), dtype=np.int64)
            np.add.at(per_top, tops, sizes)
            breakdown += per_top * (seg.repeat * before)
        if at.any():
            idx = np.nonzero(at)[0]
            per_top = np.zeros((len(TOP_KEYS), idx.size), dtype=np.int64)
            np.add.at(per_top, tops, sizes[:, idx])
            breakdown[:, idx] += per_top * best_reps[idx]
            mask = np.arange(sizes.shape[0])[:, None] <= best_ev[idx][None, :]
            part = np.zeros((len(TOP_KEYS), idx.size), dtype=np.int64)
            np.add.at(part, tops, sizes[:, idx] * mask)
            breakdown[:, idx] += part
    phases = np.array([seg.phase for seg in prog.segments] + ["forward"])
    return {"peak": best, "phase": phases[best_seg], "breakdown": breakdown, "saved_activations": acts,
            "high_water": high}


def _segment_bytes(seg: Any, b: Any, s: Any, mono: list[Any], rounded: Callable[[Any], Any], weights: Any) -> tuple[Any, ...]:
    """One segment's signed bytes per event and row, their running peak (value and event), net, and the
    running sum of the churn-weighted bytes (`evaluate_many`)."""
    import numpy as np

    idx = np.array([f[0] for f in seg.fast])
    coef = np.array([f[1] for f in seg.fast], dtype=np.float64 if any(isinstance(f[1], float) for f in seg.fast) else np.int64)
    sign = np.array([f[2] for f in seg.fast], dtype=np.int64)
    monos = np.vstack(mono)  # (6, n)
    x = coef[:, None] * monos[np.maximum(idx, 0)]  # (E, n)
    for j in seg.general:
        sz = seg.events[j][2]
        x[j] = sz.c0 + sz.b_ * b + sz.s_ * s + sz.bs * mono[3] + sz.ss * mono[4] + sz.bss * mono[5]
    sizes = sign[:, None] * rounded(x)
    run = np.cumsum(sizes, axis=0)
    return sizes, run.max(axis=0), run.argmax(axis=0), run[-1], np.cumsum(weights[:, None] * sizes, axis=0)


def sweep(model: Any, training: TrainingSpec | Mapping[str, Any] | None = None, *, replay: bool = True,
          **options: Any) -> Any:
    """Every combination of the given options as a row of a pandas DataFrame.

    `model` is anything `estimate` accepts, or a list of them; each option is a value or a list of
    values (lists are swept). Columns: ``model``, the swept options, then the memory figures
    (``peak_allocated_bytes``, ``peak_reserved_bytes``, ``device_total_bytes``, ``peak_phase``, one
    ``<category>_bytes`` per breakdown category, ``saved_activations_bytes``, parameter counts), each
    as `estimate` has it. On CUDA the reserved bytes replay the caching allocator over each row's step
    (tens of ms per batch shape of a 7B model); ``replay=False`` leaves ``peak_reserved_bytes`` and
    ``device_total_bytes`` empty (``<NA>``) for a fast sweep of the allocated bytes.
    """
    import pandas as pd

    from ..step.load import loading_events
    from ..step.reserved import replay_steps, replayed_reserved_and_total

    models = [resolve_model(m) for m in _as_list(model, "model")]
    layout = sorted(set(options) & set(ParallelSpec.model_fields))
    if layout:  # a sweep runs one device's step; a layout's ranks are estimate's and plan's
        raise SpecError(f"tm.sweep sweeps one device's training options; {layout[0]!r} is a parallel layout option: "
                        f"loop over tm.estimate(..., {layout[0]}=...) or use tm.plan to search layouts")
    axes = {k: _as_list(v, k) for k, v in options.items()}
    swept = [k for k, v in axes.items() if len(v) > 1]
    keys = list(axes)
    base = build_training(training) if training is not None else None
    rows: list[dict[str, Any]] = []
    # rows sharing a step program: (model, program key) -> (a member's spec, [(row, micro_batch, seq_len)])
    groups: dict[tuple[ModelSpec, TrainingSpec], tuple[TrainingSpec, list[tuple[int, int, int, TrainingSpec]]]] = {}
    shape_keys = [k for k in ("micro_batch", "seq_len") if k in axes]
    other_keys = [k for k in keys if k not in shape_keys]
    for shape_key in shape_keys:  # validate each batch-shape value once
        for value in axes[shape_key]:
            build_training(base, **{shape_key: value})
    for m in models:
        for other in itertools.product(*(axes[k] for k in other_keys)):
            fixed = dict(zip(other_keys, other, strict=True))
            t_base = build_training(base, **fixed)
            built = as_built(m, t_base)  # as `estimate` takes it (a stack may untie the head)
            plain = {k: _plain(v) for k, v in fixed.items()}
            keyed: dict[tuple[bool, bool], TrainingSpec] = {}  # the program key only sees b == 1 and s >= window
            for shape in itertools.product(*(axes[k] for k in shape_keys)):
                update = dict(zip(shape_keys, shape, strict=True))
                b, s = update.get("micro_batch", t_base.micro_batch), update.get("seq_len", t_base.seq_len)
                if s > m.max_positions:
                    raise SpecError(f"seq_len={s} exceeds {m.name}'s max_positions={m.max_positions}")
                rows.append({"model": m.name, **plain, **update})
                cls = (b == 1, bool(m.sliding_window) and s >= m.sliding_window)
                if cls not in keyed:
                    # model_copy skips validation: every value was validated above
                    keyed[cls] = program_key(t_base.model_copy(update=update) if update else t_base, built)
                _, members = groups.setdefault((built, keyed[cls]), (t_base, []))
                members.append((len(rows) - 1, b, s, t_base))  # its own spec: alloc_conf, CUDA context
    for (m, key), (t, members) in groups.items():
        check_model_options(m, t.model_copy(update={"seq_len": min(s for _, _, s, _ in members)}))
        prog = compile_step(m, key)
        res = evaluate_many(prog, [b for _, b, _, _ in members], [s for _, _, s, _ in members], 0.0)
        paged = paged_state_bytes(m, t) if t.device is Device.CUDA else 0  # as `simulate` adds them
        # reserved bytes as `estimate` has them: the caching allocator replayed over the unrolled step
        unrolled = compile_step(m, key, unrolled=True) if t.device is Device.CUDA and replay else None
        load = loading_events(m, t) if unrolled is not None else ()
        # every batch shape replayed at once, on the machine's cores (the same bytes as one by one)
        runs = replay_steps(unrolled, [(b, s, own.alloc_conf) for _, b, s, own in members], load) \
            if unrolled is not None else [None] * len(members)
        for j, (r, _b, _s, own) in enumerate(members):
            peak = int(res["peak"][j])
            tops = {f"{k}_bytes": int(res["breakdown"][i][j]) for i, k in enumerate(TOP_KEYS)}
            if unrolled is None and t.device is Device.CUDA:
                reserved = total = None  # replay=False: not replayed, left empty
            else:
                reserved, total = replayed_reserved_and_total(own, peak, runs[j], None, paged)
            rows[r].update(peak_allocated_bytes=peak, peak_reserved_bytes=reserved, device_total_bytes=total,
                           peak_phase=str(res["phase"][j]), **tops,
                           saved_activations_bytes=int(res["saved_activations"][j]),
                           n_params=prog.n_params, n_trainable_params=prog.n_trainable)
    columns = ["model", *keys, *FIGURES]
    df = pd.DataFrame(rows, columns=columns)
    if not replay:  # rows not replayed stay empty: nullable integers, never a float NaN in a byte count
        for col in ("peak_reserved_bytes", "device_total_bytes"):
            df[col] = df[col].astype("Int64")
    df.attrs["swept"] = ["model", *swept] if len(models) > 1 else swept
    return df


def _plain(value: Any) -> Any:
    return value.value if hasattr(value, "value") else value


def _iterable(x: Any) -> Iterable[Any]:
    return x if isinstance(x, Iterable) else [x]
