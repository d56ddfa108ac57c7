"""PyTorch FSDP1 (``FullyShardedDataParallel``) as the step sees it: one FlatParameter per wrapped
module, gathered whole, gradients for every parameter it holds, unsharded gradients under ``no_sync()``.

What differs from FSDP2 (`trainmem_nb.parallel.fsdp`), each read in torch 2.13's
``torch/distributed/fsdp``:

- A unit's parameters are flattened into one FlatParameter (``_flat_param.py``,
  ``_init_flat_param_and_metadata``), in ``named_modules()`` order; with ``use_orig_params=True`` each
  parameter starts at a 16-byte boundary and the whole is padded to a multiple of the world size. A rank
  holds one contiguous chunk of it: rank 0 the first, so its optimizer states are those of the
  parameters (or parts) that fall in its chunk.
- The all-gather writes straight into the unsharded FlatParameter (``FlatParamHandle.unshard``), one
  buffer per unit; the root is not resharded after forward (``_post_forward_reshard``: ``not
  state._is_root``); the next unit in backward order is gathered as the current one starts
  (``BackwardPrefetch.BACKWARD_PRE``, the default).
- The FlatParameter requires grad when any of its parameters does: with ``use_orig_params=True`` a unit
  holding frozen and trained parameters (LoRA adapters inside a transformer block) computes gradients
  for all of them (its parameters are views of the FlatParameter), which ``split``'s backward gathers
  into one unsharded gradient (``torch.cat``) before ``AccumulateGrad``. ``use_orig_params=False`` needs
  uniform ``requires_grad`` per FlatParameter: frozen and trained parameters are flattened apart (the
  adapters wrapped as their own units), and only the trained get gradients.
- The post-backward hook (``_runtime_utils._post_backward_hook``) reshards, then reduce-scatters into a
  new sharded gradient (``_get_reduce_scatter_tensors``: ``torch.empty_like(chunks[0])``) and drops the
  unsharded one; the sharded gradient covers the whole chunk, frozen parameters' parts included. Under
  ``no_sync()`` (gradient accumulation in Fabric's ``no_backward_sync``) it returns before reducing: the
  unsharded gradient stays as ``flat_param.grad`` and later micro-steps add into it.

Modelled without a MixedPrecision policy, pipelining, CPU offload, expert parallelism or QLoRA
(`trainmem_nb.parallel.checks` refuses those combinations).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, NamedTuple

from ..engine.program import Segment
from ..engine.tape import Graph, Sz, T, const
from ..model.params import ParamTensor
from ..model.spec import ModelSpec
from ..spec.training import TrainingSpec
from ..step.compile import EngineHooks
from ..step.optimizers import optimizer_program, state_bytes
from .ranks import _held, _units, layer_units

__all__ = ["PARAM_BROADCAST_BUCKET_BYTES", "FSDP1Hooks", "flat_units", "wrap_events"]

#: FSDP1 aligns each parameter of a FlatParameter to 16 bytes with use_orig_params=True
#: (torch/distributed/fsdp/_flat_param.py, ``_get_aligned_numel``: ``ALIGNMENT = 16``).
FLAT_PARAM_ALIGNMENT = 16
#: ``sync_module_states`` broadcasts a unit's states in buckets that close at this size
#: (torch/distributed/fsdp/_init_utils.py:60 ``PARAM_BROADCAST_BUCKET_SIZE = 250 * 1024 * 1024``), each a flat
#: copy, at most two in flight (torch/csrc/distributed/c10d/comm.cpp ``broadcast_coalesced``: ``max_in_flight = 2``)
PARAM_BROADCAST_BUCKET_BYTES = 250 * 2**20
_BROADCASTS_IN_FLIGHT = 2


class _Flat(NamedTuple):
    """One FlatParameter: its padded unsharded elements, a rank's chunk, its dtype's bytes, whether it
    gets a gradient, and the elements of each parameter in rank 0's chunk (by name)."""

    numel: int
    shard: int
    dt: int
    grads: bool
    rank0: tuple[tuple[str, int], ...]


def _flat_order(params: list[tuple[ParamTensor, int, bool]]) -> list[tuple[ParamTensor, int, bool]]:
    """A unit's parameters in ``named_modules()`` order: peft's adapters (``X.lora_A``, ``X.lora_B``)
    follow their base layer ``X``'s weight and bias."""
    adapters: dict[str, list[tuple[ParamTensor, int, bool]]] = {}
    base = []
    for w in params:
        name = w[0].name
        if ".lora_A." in name or ".lora_B." in name:
            adapters.setdefault(name.split(".lora_")[0], []).append(w)
        else:
            base.append(w)
    out = []
    for w in base:
        out.append(w)
        module = w[0].name.rsplit(".", 1)[0]
        if w[0].name.endswith(".bias") or f"{module}.bias" not in {b[0].name for b in base}:
            out += adapters.pop(module, [])
    for rest in adapters.values():  # adapters of modules outside this unit's parameters (none expected)
        out += rest
    return out


def _flatten(params: list[tuple[ParamTensor, int, bool]], world: int, aligned: bool, grads: bool) -> _Flat:
    """Lay out one FlatParameter (``_init_flat_param_and_metadata``) and find rank 0's chunk."""
    dt = params[0][1]
    align = FLAT_PARAM_ALIGNMENT // dt if aligned else 0
    total, starts = 0, []
    for p, _dt, _train in params:
        if align and total % align:
            total += align - total % align
        starts.append(total)
        total += p.numel
    numel = -(-total // world) * world
    shard = numel // world
    if aligned:  # use_orig_params: the optimizer steps on each parameter's part of the chunk
        rank0 = tuple((p.name, max(0, min(start + p.numel, shard) - start)) for (p, _dt, train), start
                      in zip(params, starts, strict=True) if train)
    else:  # the optimizer steps on the FlatParameter itself: one (padded) chunk, named after its first parameter
        rank0 = ((params[0][0].name, shard),) if grads else ()
    return _Flat(numel, shard, dt, grads, rank0)


def flat_units(weights: list[tuple[ParamTensor, int, bool]], m: ModelSpec, world: int,
               use_orig_params: bool) -> tuple[tuple[str, tuple[_Flat, ...]], ...]:
    """Each unit's FlatParameters (the root and one per kind of transformer layer, `_units`): one with
    ``use_orig_params=True``, whose gradient covers every parameter when any trains; otherwise the
    frozen and the trained parameters apart."""
    out = []
    for unit, params in _units(weights, m).items():
        if not params:
            continue
        ordered = _flat_order(params)
        trains = any(w[2] for w in ordered)
        flats: tuple[_Flat, ...]
        if use_orig_params:
            flats = (_flatten(ordered, world, True, trains),)
        else:
            groups = [[w for w in ordered if not w[2]], [w for w in ordered if w[2]]]
            flats = tuple(_flatten(g, world, False, bool(g[0][2])) for g in groups if g)
        out.append((unit, flats))
    return tuple(out)


def wrap_events(weights: list[tuple[ParamTensor, int, bool]], m: ModelSpec, units: tuple[tuple[str, tuple[_Flat, ...]], ...],
                sync_module_states: bool, use_orig_params: bool, root_buffers: tuple[int, ...] = (),
                on_device: bool = False) -> tuple[int, ...]:
    """What rank 0's device sees while ``FullyShardedDataParallel`` wraps a model held on the host (or on the
    meta device, materialised unit by unit), as a loading trace (`trainmem_nb.step.load.loading_events`' form).

    Units are wrapped children first (``_post_order_apply``: every layer in order, then the root), each as
    ``_init_param_handle_from_module`` does (torch 2.13 ``torch/distributed/fsdp/_init_utils.py``):
    ``_move_module_to_device`` puts the unit's parameters on the device one by one; with `sync_module_states`
    ``_sync_module_params_and_buffers`` broadcasts them (and the root's not-yet-synced buffers, a bucket of
    their own dtype) in flat bucket copies (`PARAM_BROADCAST_BUCKET_BYTES`); ``FlatParamHandle`` concatenates
    them into the unsharded FlatParameter (``flatten_tensors``: ``torch.cat``), ``shard()`` clones rank 0's
    chunk and resizes the unsharded storage to 0, and the original parameters go: as ``_use_sharded_views``
    repoints each (use_orig_params=True, in order) or when the caller's list of them is dropped (False,
    last first). Measured on CPU (fake process group, tests/test_parallel.py): the same allocations in the
    same order. `on_device`: the whole model is on the device before wrapping starts (``model.cuda()`` first),
    its parameters allocated unit by unit up front. Every storage is freed at the end, as `loading_events`
    leaves them for the step to allocate."""
    from ..step.load import LoadTrace

    by_unit = _units(weights, m)
    flats = dict(units)
    trace = LoadTrace()
    malloc = trace.malloc
    order = [(unit, _flat_order(by_unit.get(unit, []))) for unit in (*layer_units(m), "root")]
    held = [[malloc(round(p.numel * dt)) for p, dt, _train in params] for _unit, params in order] if on_device else []
    for i, (unit, params) in enumerate(order):
        if not params:
            continue
        moved = held[i] if on_device else [malloc(round(p.numel * dt)) for p, dt, _train in params]
        if sync_module_states:  # compute_bucket_assignment_by_size: a bucket per dtype, ordered by first tensor
            buffers = sum(root_buffers) if unit == "root" else 0
            own = bool(buffers) and params[0][1] != 4  # fp32 buffers share the parameters' buckets in an fp32 model
            buckets, bucket = ([buffers] if own else []), (0 if own else buffers)
            for p, dt, _train in params:
                bucket += round(p.numel * dt)
                if bucket >= PARAM_BROADCAST_BUCKET_BYTES:
                    buckets.append(bucket)
                    bucket = 0
            if bucket:
                buckets.append(bucket)
            flying: list[int] = []
            for size in buckets:
                if len(flying) >= _BROADCASTS_IN_FLIGHT:
                    trace.free(flying.pop(0))
                flying.append(malloc(size))
            trace.free(*flying)
        # use_orig_params pads the concatenation itself to a multiple of the world size (``flatten_tensors``);
        # otherwise rank 0's chunk is the largest and no other rank's padding is on it
        parts = [params] if use_orig_params else [g for g in ([w for w in params if not w[2]], [w for w in params if w[2]]) if g]
        for f, group in zip(flats.get(unit, ()), parts, strict=True):
            full = malloc((f.numel if use_orig_params else sum(p.numel for p, _dt, _train in group)) * f.dt)
            malloc(f.shard * f.dt, keep=True)
            trace.free(full)
        trace.free(*(moved if use_orig_params else reversed(moved)))
    return trace.done()



#: The CUDA streams FSDP1 allocates on besides the default one (torch/distributed/fsdp/_runtime_utils.py):
#: ``_unshard`` runs ``handle.unshard()`` under ``state._device_handle.stream(unshard_stream)``, which allocates the
#: unsharded FlatParameter (``_alloc_padded_unsharded_flat_param``); ``_reduce_grad`` makes the new sharded gradient
#: (``_get_reduce_scatter_tensors``: ``torch.empty_like(chunks[0])``) under ``stream(state._post_backward_stream)``.
#: The caching allocator gives a block back only to requests of its own stream.
UNSHARD_STREAM = 1
POST_BACKWARD_STREAM = 2

@dataclass(frozen=True)
class FSDP1Hooks(EngineHooks):
    """torch FSDP1 (``FullyShardedDataParallel``) wrapping every transformer layer and the root, without
    a MixedPrecision policy (parameters, gradients and optimizer states in the parameters' dtype)."""

    world: int
    reshard_after_forward: bool  # FULL_SHARD (ZeRO-3); SHARD_GRAD_OP (ZeRO-2) keeps units gathered until backward
    units: tuple[tuple[str, tuple[_Flat, ...]], ...]
    #: gradient accumulation under ``no_sync()``: every unit's unsharded gradient exists before the last
    #: micro-step and its backward adds into it
    no_sync: bool = False
    #: use_orig_params=True: a unit that trains any parameter computes gradients for all of them
    flat_unit_grads: bool = True
    autocast: bool = False
    local_grads_accumulate: bool = False
    first_stage: bool = True
    last_stage: bool = True
    state: dict[int, dict[str, Any]] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def loading(self, m: ModelSpec, t: TrainingSpec) -> tuple[tuple[int, ...], int] | None:
        """Each unit whole on the device, then sharded (`wrap_events`)."""
        return _wrapping_load(m, t, self)

    def _flats(self, unit: str) -> tuple[_Flat, ...]:
        units = dict(self.units)
        if unit == "root" or unit.startswith("layer"):
            return units.get(unit, ())
        kind = unit.partition("/")[2]
        return units.get(f"layer/{kind}" if kind else "layer", ())

    def _st(self, g: Graph) -> dict[str, Any]:
        return self.state.setdefault(id(g), {"ups": {}})

    @property
    def _kept_gathered(self) -> bool:
        """SHARD_GRAD_OP under ``no_sync()``: the post-backward hook does not reshard
        (``_should_free_in_backward``), so every unit is still gathered when the last micro-step starts."""
        return self.no_sync and not self.reshard_after_forward

    def _gather(self, g: Graph, unit: str) -> None:
        """``FlatParamHandle.unshard``: the unsharded FlatParameter's storage, all-gathered into."""
        ups = self._st(g)["ups"]
        if unit in ups:
            return
        bufs = []
        for f in self._flats(unit):
            label = f"unsharded FlatParameter {unit}"
            t = g.external(const(f.numel * f.dt), 1, label) if self._kept_gathered else g.alloc(const(f.numel * f.dt), 1, label)
            t.region, t.stream = "gathered", UNSHARD_STREAM
            bufs.append(t)
        ups[unit] = bufs

    def _reshard(self, g: Graph, unit: str) -> None:
        g.drop(*self._st(g)["ups"].pop(unit, []))

    def unit_forward_begin(self, g: Graph, unit: str) -> None:
        self._gather(g, unit)

    def unit_forward_end(self, g: Graph, unit: str) -> None:
        # the root keeps its parameters for the backward it is about to start (_post_forward_reshard)
        if unit != "root" and self.reshard_after_forward:
            self._reshard(g, unit)

    def unit_backward_begin(self, g: Graph, unit: str, prefetch: str | None = None) -> None:
        self._gather(g, unit)
        if prefetch is not None:  # BACKWARD_PRE: the next unit in backward order, gathered now
            self._gather(g, prefetch)

    def unit_backward_end(self, g: Graph, unit: str, grads: list[T]) -> None:
        # split's backward concatenates the unit's gradients into the FlatParameter's (padded) gradient
        new = [g.alloc(const(f.numel * f.dt), 1, f"FlatParameter gradient {unit}") for f in self._flats(unit) if f.grads]
        for grad in grads:
            grad.is_grad = False
        g.drop(*grads)
        if self.no_sync:  # AccumulateGrad adds it into the unsharded gradient of the earlier micro-steps
            acc = []
            for t, f in zip(new, (f for f in self._flats(unit) if f.grads), strict=True):
                kept = g.external(const(f.numel * f.dt), 1, f"unsharded gradient {unit} (no_sync)")
                kept.phase, kept.is_grad = "backward", True
                acc.append(kept)
                g.drop(t)
            new = acc
        self._reshard(g, unit)
        for t, f in zip(new, (f for f in self._flats(unit) if f.grads), strict=True):
            sharded = g.alloc(const(f.shard * f.dt), 1, f"sharded gradient {unit}")  # empty_like(chunks[0])
            sharded.is_grad, sharded.stream = True, POST_BACKWARD_STREAM
            g.drop(t)  # the unsharded gradient goes when _reduce_grad returns

    def _grads(self, m: ModelSpec) -> list[tuple[int, int]]:
        counts = [("root", 1), *Counter(layer_units(m)).items()]
        return [(f.shard * f.dt, c) for unit, c in counts for f in self._flats(unit) if f.grads]

    def _shard_of(self, m: ModelSpec) -> Any:
        share = {name: n for _unit, flats in self.units for f in flats for name, n in f.rank0}

        def shard(p: ParamTensor) -> ParamTensor | None:
            n = share.get(p.name, 0) if _held(self, p, m) else 0
            return p._replace(shape=(n,)) if n else None  # a 1-D view of rank 0's part; none: no .grad, no state

        return shard

    def init(self, m: ModelSpec, t: TrainingSpec, weights: list[Any]) -> list[tuple[str, Sz, int]]:
        counts = [("root", 1), *Counter(layer_units(m)).items()]
        out: list[tuple[str, Sz, int]] = [("weights/params", const(f.shard * f.dt), c)
                                          for unit, c in counts for f in self._flats(unit)]
        if self.no_sync:
            out += [("gradients", const(f.numel * f.dt), c) for unit, c in counts for f in self._flats(unit)
                    if f.grads]
        if self._kept_gathered:
            out += [("weights/gathered", const(f.numel * f.dt), c) for unit, c in counts for f in self._flats(unit)]
        if not t.first_step:
            out += [("optimizer_states", sz, c) for sz, c in state_bytes(m, t, self._shard_of(m))]
        return out

    def optimizer(self, m: ModelSpec, t: TrainingSpec) -> list[Segment]:
        # use_orig_params: the optimizer steps on each parameter's part of the chunk; zero_grad(set_to_none)
        # leaves the sharded FlatParameter gradients to the next forward's _reset_flat_param_grad_info_if_needed
        return optimizer_program(m, t, self._shard_of(m), self._grads(m))


@lru_cache(maxsize=256)
def _wrapping_load(m: ModelSpec, t: TrainingSpec, hooks: FSDP1Hooks) -> tuple[tuple[int, ...], int]:
    """Rank 0's loading trace under FSDP1 (`wrap_events` for `t`'s weights, `hooks`' units) and its peak bytes;
    memoised on the model, the step's key (`program_key`) and the hooks."""
    from ..model.params import buffer_inventory, weight_tensors
    from ..step.load import trace_peak

    buffers = tuple(b for name, b, count in buffer_inventory(m) if not name.startswith("layers.") for _ in range(count))
    trace = wrap_events(weight_tensors(m, t), m, hooks.units, t.sync_module_states, t.use_orig_params, buffers)
    return trace, trace_peak(trace)
