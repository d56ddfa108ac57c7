"""DeepSpeed ZeRO stages 0-3: its 16-bit model, fp32 master weights and moments, buckets and
ZeRO-3's live parameters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, NamedTuple

from ..engine.program import Segment, _round, _segment
from ..engine.tape import Graph, Sz, T, const
from ..model.params import ParamTensor, idle_tensors, idle_trainable, weight_tensors
from ..model.spec import ModelSpec
from ..spec.choices import Method
from ..spec.training import TrainingSpec
from ..step.compile import EngineHooks
from ..step.layers import in_layer_of
from ..step.optimizers import flat_state_bytes, flat_update_temporaries
from .ranks import (
    _CAT,
    DS_ALLGATHER_BUCKET,
    DS_REDUCE_BUCKET,
    DS_STAGE3_MAX_LIVE,
    DS_STAGE3_PERSISTENCE,
    DS_STAGE3_PREFETCH,
    _held,
    _partition,
    _trainable,
    nf4_parts,
    shard_world,
)


def _named_order(weights: list[tuple[ParamTensor, int, bool]], m: ModelSpec) -> list[tuple[ParamTensor, int, int]]:
    """The base model's parameters one tensor per layer, in ``named_parameters()`` order, each with its bytes per
    element and its layer's index (-1 for the root's): the root's before the layers (embeddings), each
    layer's, the root's after them (final norm, head)."""
    base = [w for w in weights if ".lora_" not in w[0].name]
    first = next((i for i, w in enumerate(base) if w[0].in_layer), len(base))
    order = [(p, dt, -1) for p, dt, _train in base[:first]]
    for i, kind in enumerate(m.layer_kinds):
        order += [(p, dt, i) for p, dt, _train in base if p.in_layer and in_layer_of(p, kind)]
    return order + [(p, dt, -1) for p, dt, _train in base[first:] if not p.in_layer]


def zero3_loading_events(weights: list[tuple[ParamTensor, int, bool]], m: ModelSpec, world: int,
                         ep: int = 1, shards_on_host: bool = False) -> tuple[int, ...]:
    """Rank 0's device while ``from_pretrained`` loads a model for ZeRO-3 (transformers 5.24 with DeepSpeed
    0.19), as a loading trace (`trainmem_nb.step.load.loading_events`' form).

    ``get_init_context`` builds the model inside ``deepspeed.zero.Init``: each parameter is made whole in the
    model's dtype on the device, then partitioned (``partition_parameters.py``: a shard of
    ``ceil(numel / world)`` elements, the whole freed). ``_load_state_dict_into_zero3_model`` then walks the
    modules and gathers each one's own parameters (``GatheredParameters(..., modifier_rank=0)``: an
    all-gather buffer of ``world`` shards each, freed as it re-partitions them) while rank 0 copies the
    checkpoint in from host memory. LoRA adapters, made whole after loading, are partitioned the same way
    when ``deepspeed.initialize`` converts them (not measured). `shards_on_host`: ZeRO-Offload of the parameters
    (``offload_param``) keeps each shard on the host (``remote_device``), so the device holds only the whole
    parameters in passing (not measured). Measured on CPU for the base model
    (`trainmem_nb.measure.deepspeed.measure_zero3_load`): the same allocations in the same order. Every storage
    is freed at the end, as `loading_events` leaves them for the step to allocate."""
    from ..step.load import LoadTrace

    trace = LoadTrace()
    malloc = trace.malloc

    def shard(p: ParamTensor) -> tuple[int, int]:
        ranks = shard_world(p, world, ep)
        return -(-p.numel // ranks), ranks

    def modules(params: list[tuple[ParamTensor, int, int]]) -> list[list[tuple[ParamTensor, int, int]]]:
        """`params` in runs of one module's own parameters (a linear layer's weight and bias)."""
        runs: list[list[tuple[ParamTensor, int, int]]] = []
        for w in params:
            if runs and (runs[-1][-1][2], runs[-1][-1][0].name.rsplit(".", 1)[0]) == (w[2], w[0].name.rsplit(".", 1)[0]):
                runs[-1].append(w)
            else:
                runs.append([w])
        return runs

    def partition(params: list[tuple[ParamTensor, int, int]]) -> None:
        # zero.Init's post-init hook partitions a module's parameters once its __init__ has made them all
        for run in modules(params):
            whole = [malloc(round(p.numel * dt)) for p, dt, _layer in run]
            for (p, dt, _layer), w in zip(run, whole, strict=True):
                if not shards_on_host:
                    malloc(round(shard(p)[0] * dt), keep=True)
                trace.free(w)

    order = _named_order(weights, m)
    head = [(ParamTensor("lm_head.weight", (m.vocab, m.hidden), 1, True, False), order[0][1], -1)] if m.tie_embeddings else []
    # a tied head is built as its own linear layer and partitioned before transformers ties it to the
    # embedding; DeepSpeed keeps that shard (measured)
    partition(order + head)
    for run in modules(order):  # a module's parameters gathered together, released together
        trace.free(*[malloc(round(shard(p)[0] * shard(p)[1] * dt)) for p, dt, _layer in run])
    partition([(p, dt, -1) for p, dt, _train in weights if ".lora_" in p.name])
    return trace.done()


#: The CUDA stream ZeRO-3 gathers parameters on (runtime/zero/partitioned_param_coordinator.py, ``fetch_sub_module``:
#: ``all_gather_coalesced`` under ``get_accelerator().stream(self.__allgather_stream)``, which allocates the gathered
#: buffer, partition_parameters.py ``_allgather_params_coalesced``): the caching allocator pools its blocks apart
#: from the default stream's.
ZERO3_ALLGATHER_STREAM = 1


class Reduction(NamedTuple):
    """One reduction of the reduce bucket: its gradients' elements, the same padded to a multiple of the ranks each
    (ZeRO-3's reduce-scatter), how many gradients, and how many elements backward had made before the first."""

    elements: int
    padded: int
    tensors: int
    start: int


@dataclass
class _BucketCount:
    """The gradients in ZeRO's reduce bucket as backward makes them: one that would overflow its `size` elements
    reduces the bucket first, unless the bucket is empty (it then holds the one gradient alone): stage_1_and_2.py
    reduce_independent_p_g_buckets_and_remove_grads, stage3.py __add_grad_to_ipg_bucket."""

    size: int
    counted: int = 0
    elements: int = 0
    padded: int = 0
    tensors: int = 0

    def add(self, numel: int, world: int) -> Reduction | None:
        """Count one gradient of `numel` elements; the reduction it sets off first, if any."""
        out = self.flush() if self.elements and self.elements + numel > self.size else None
        self.counted += numel
        self.elements += numel
        self.padded += -(-numel // world) * world
        self.tensors += 1
        return out

    def flush(self) -> Reduction | None:
        """Reduce what the bucket holds (None when empty)."""
        if not self.elements:
            return None
        out = Reduction(self.elements, self.padded, self.tensors, self.counted - self.elements)
        self.elements = self.padded = self.tensors = 0
        return out


@dataclass(frozen=True)
class DeepSpeedHooks(EngineHooks):
    """DeepSpeed ZeRO stages 0-3 with its 16-bit optimizer (fp32 master + moments: 12 B/param)."""

    world: int
    zero: int
    model_dt: int  # 2 with a bf16/fp16 recipe, 4 for fp32
    offload: str
    #: ZeRO-3: what its parameter coordinator holds gathered through a step (`zero3_gathering`)
    gathering: Zero3Gathering | None = None
    autocast: bool = False
    first_stage: bool = True
    last_stage: bool = True
    grad_scaler: bool = False  # fp16: DeepSpeed's own loss scaler (runtime/fp16/loss_scaler.py)
    ep: int = 1  #: expert parallelism: routed experts are partitioned over ``world / ep`` ranks (`shard_world`)
    partition_numel: int = 0  #: ZeRO-2: elements of the rank's gradient partition (`zero2_grad_partition_numel`)
    #: ZeRO-2: elements of the flat group of trainable parameters the ranks' parts split (`zero2_flat_numel`)
    flat_numel: int = 0
    #: elements of ZeRO-1/2's reduce bucket (``reduce_bucket_size``)
    reduce_bucket: int = DS_REDUCE_BUCKET
    accumulating: bool = False  #: a later micro-step of gradient accumulation (the earlier ones' partition exists)
    #: the idle weights (a multimodal checkpoint's vision tower) are cast and partitioned as the module's others
    shards_idle: bool = True
    state: dict[int, dict[str, Any]] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def weight_dtype(self, t: TrainingSpec, dt: int) -> int:
        return self.model_dt

    def loading(self, m: ModelSpec, t: TrainingSpec) -> tuple[tuple[int, ...], int] | None:
        """ZeRO-3: ``zero.Init`` makes each parameter whole, then partitions it, and each module is gathered to
        load it (`zero3_loading_events`); below ZeRO-3 the host model, cast to the engine's dtype, moves to the
        device. QLoRA (no ``zero.Init``: the quantized model is built on the meta device) quantizes on load."""
        if t.method is Method.QLORA:
            return None
        return _zero3_load(m, t, self) if self.zero >= 3 else _replicated_load(m, t, self)

    def unit_forward_begin(self, g: Graph, unit: str) -> None:
        if unit == "root" and (self.zero >= 3 or self._bucket_at_first_gradient()):
            g.param_released = lambda q: self._released(g, q)
        if unit == "root" and self._bucket_kept():
            # ZeRO-1 accumulating: the bucket the first micro-step made stays until the boundary's reduction (`init`)
            bucket = g.external(const(self.reduce_bucket), self.model_dt, "reduce bucket (ipg_buffer)")
            bucket.region = "communication"
            self.state.setdefault(id(g), {})["bucket"] = bucket
        if unit == "root" and self._partitioned_in_backward() and self.accumulating:
            # the partition the earlier micro-steps reduced into (`init`), alive until this one makes its own
            earlier = g.external(const(self.partition_numel), self.model_dt, "earlier micro-steps' gradient partition")
            earlier.is_grad = True
            self.state.setdefault(id(g), {})["earlier"] = earlier
        zg = self.gathering
        if zg is None:
            return
        # ZeRO-3's parameter coordinator (partitioned_param_coordinator.py, fetch_sub_module) gathers each module's
        # parameters as it runs and, with the step's trace recorded (every step after the first), prefetches the
        # next ones in trace order, up to ``stage3_prefetch_bucket_size`` elements a module, while fewer than
        # ``stage3_max_live_parameters`` are gathered; release_sub_module keeps those used again within
        # ``stage3_max_reuse_distance`` elements. Measured (CPU, tests/test_parallel.py): the gathered elements
        # climb to the live limit within the first modules and stay there through the turn into backward, until
        # backward's end empties the trace; a model within one prefetch is gathered whole by its first module
        # and each weight released once its module's backward is done. The parameters of one prefetch go through
        # one flat buffer (partition_parameters.py, _all_gather_dtype: ``torch.empty(partition_sz * world_size)``),
        # each copied out whole (``torch.cat`` of the partitions) as the first of them is waited for
        # (AllGatherCoalescedHandle.wait); the buffer goes when the last of them is. On the all-gather stream.
        st = self.state.setdefault(id(g), {})
        if unit == "root":
            if zg.buffer:
                st["flat"] = self._gathered(g, zg.buffer, "ZeRO-3 all-gather flat buffer", "communication")
            if not zg.at_once:
                st["window"] = self._gathered(g, zg.window, "ZeRO-3 gathered params (live-parameter window)")
        if zg.at_once:
            # a model within one prefetch: every weight was gathered by the first module; each layer's are counted
            # from its forward here (the same bytes from the last layer on), to go as its backward releases them
            copies = st.setdefault("copies", {})
            for q in g.unit_params.get(unit, []):
                n = self._gathered_numel(q)
                if n >= DS_STAGE3_PERSISTENCE:
                    nbytes = n if getattr(q, "nf4", None) else n * self.model_dt
                    copies[id(q)] = self._gathered(g, nbytes, f"ZeRO-3 gathered {q.label}")

    @staticmethod
    def _gathered_numel(q: T) -> int:
        """Elements DeepSpeed counts for parameter `q` (a QLoRA weight's packed uint8 storage)."""
        n = round(q.n.at(1, 1))
        return -(-n // 2) if getattr(q, "nf4", None) else n

    def _released(self, g: Graph, q: T) -> None:
        """A module's backward is done (ZeRO-3's release_sub_module): its gathered weight goes, after the gradient
        AccumulateGrad made, which ZeRO-3's gradient hook has copied into the reduce bucket (stage3.py
        reduce_ready_partitions_and_remove_grads; measured in that order). ZeRO-1/2: its gradient has arrived in
        the reduce bucket, which is made by the first and reduced when the next would overflow it."""
        st = self.state.setdefault(id(g), {})
        if q.rg and self._bucket_at_first_gradient() and "bucket" not in st:
            # stage_1_and_2.py makes its reduce bucket (`ipg_buffer`) as the first gradient arrives (measured:
            # after the head's weight gradient is made, before it is copied in)
            bucket = g.alloc(const(self.reduce_bucket), self.model_dt, "reduce bucket (ipg_buffer)")
            bucket.region = "communication"
            st["bucket"] = bucket
        count = st.get("count")
        if q.rg and count is not None and id(q) in st["repeated"]:
            st.setdefault("period", []).append(self._gathered_numel(q))  # counted as the repeated layers end
        elif q.rg and count is not None:
            reduction = count.add(self._gathered_numel(q), self.world)
            if reduction is not None:
                self._reduce(g, st, reduction)
        if q.final_grad is not None and self.zero >= 2:  # ZeRO-1 keeps .grad to the step
            q.final_grad.is_grad = False
            g.drop(q.final_grad)
            q.final_grad = None
        copy = st.get("copies", {}).pop(id(q), None)
        if copy is not None:
            g.drop(copy)

    @staticmethod
    def _gathered(g: Graph, n: int, label: str, region: str = "gathered") -> T:
        out = g.alloc(const(n), 1, label)
        out.region, out.stream = region, ZERO3_ALLGATHER_STREAM
        return out

    def head_begin(self, g: Graph) -> None:
        st = self.state.setdefault(id(g), {})
        if self.gathering is not None and self.gathering.at_once and "flat" in st:
            g.drop(st.pop("flat"))  # the model in one prefetch: the head's weight is the last waited for

    def unit_backward_begin(self, g: Graph, unit: str, prefetch: str | None = None) -> None:
        if unit == "root" and self.zero in (1, 2):
            # stage_1_and_2.py makes its reduce bucket (`ipg_buffer`) when the first gradients arrive (`_released`;
            # with an offloaded optimizer, as backward starts); it goes when backward ends (measured on CPU: not
            # alive before a step, tests/test_parallel.py)
            st = self.state.setdefault(id(g), {})
            if not self._bucket_at_first_gradient():
                bucket = g.alloc(const(self.reduce_bucket), self.model_dt, "reduce bucket (ipg_buffer)")
                bucket.region = "communication"
                st["bucket"] = bucket
            # ZeRO-2's gradient partition (`grads_in_partition`) is made by the first reduction that copies into
            # it (copy_grads_in_partition), else by the epilogue's reduction at the end of backward; it goes once
            # step() has its fp32 copy. The modelled rank is the last one, whose part of the flat group holds the
            # head: its first reduction is the first time a gradient overflows the reduce bucket
            # (reduce_independent_p_g_buckets_and_remove_grads), counted in `_released` (rank 0's part, the
            # embeddings and first layers, is reduced late in backward). Measured on CPU, tests/test_parallel.py.
            # ZeRO-1 reduces at the end of backward (`_zero1_epilogue`), ZeRO-3 as its bucket fills (`_reduce`)
        if unit == "root" and self._counts_reductions():
            st = self.state.setdefault(id(g), {})
            st["count"] = _BucketCount(self.reduce_bucket)
            st["repeated"] = self._repeated_params(g)
        elif unit not in g.repeated_units and "before_period" in self.state.get(id(g), {}):
            self._count_repeated(g, self.state[id(g)])

    def _bucket_at_first_gradient(self) -> bool:
        """ZeRO-1/2 without offload: the reduce bucket is made as the first gradient arrives (measured)."""
        return self.zero in (1, 2) and self.offload == "none"

    def _zero1_epilogue(self, g: Graph, st: dict[str, Any]) -> None:
        """ZeRO-1 reduces at the end of backward (no gradient hooks without ``overlap_comm``: reduce_gradients walks
        the parameters in the flat group's order), on rank 0, whose part comes first. Each gradient is copied into
        the reduce bucket and its own storage goes; within one bucket, the reduction flattens the bucket (its
        slices span the ranks' parts) and then makes the partition it copies rank 0's part into
        (copy_grads_in_partition): measured to the byte. With more gradients than the bucket holds, the first
        reduction makes the partition once a bucket's worth of them has gone (here those up to the repeated
        layers, whose gradients stand for every layer's: with fewer gone, the estimate errs high; the later
        reductions' flat copies are not modelled). Accumulating, the earlier micro-steps' gradients, held in
        place, go as the step begins (`optimizer`)."""
        root, k = g.unit_params.get("root", []), g.root_before_layers
        layers = [q for u, params in g.unit_params.items() if u != "root" for q in params]
        # each parameter with a gradient and that gradient, in the flat group's order
        pairs = [(q, q.final_grad) for q in (*root[:k], *layers, *root[k:]) if q.final_grad is not None]
        params, grads = [q for q, _ in pairs], [grad for _, grad in pairs]
        for q in params:
            q.final_grad = None
        if self.flat_numel > self.reduce_bucket:
            repeated = self._repeated_params(g)
            moved = 0
            for q in params:
                n = self._gathered_numel(q)
                if (moved and moved + n > self.reduce_bucket) or id(q) in repeated:
                    break
                g.drop(grads.pop(0))
                moved += n
            self._make_partition(g, st)
            g.drop(*grads)
            return
        g.drop(*grads)
        if self.world > 1:
            self._flat_copy(g, self.flat_numel, "flattened bucket (allreduce_bucket)")
        self._make_partition(g, st)

    def _zero1_partition(self) -> bool:
        """ZeRO-1 without offload: its epilogue makes a gradient partition of rank 0's part (measured)."""
        return self.zero == 1 and self.offload == "none" and self.partition_numel > 0

    def _bucket_kept(self) -> bool:
        """ZeRO-1 in a later micro-step of gradient accumulation: the first micro-step's bucket is still there
        (measured: it goes with the boundary's reduction; ZeRO-2 frees and makes it again every micro-step)."""
        return self.zero == 1 and self.offload == "none" and self.accumulating

    def _partitioned_in_backward(self) -> bool:
        return self.zero == 2 and self.offload == "none" and self.partition_numel > 0

    def _gathered_at_epilogue(self, g: Graph) -> T | None:
        """ZeRO-3 holding its live-parameter window: the model's first module's weight (the embeddings, reused first
        by the next forward) is still gathered when the epilogue reduces the bucket, and goes after it, as the
        coordinator's trace is reset (measured: the rest of the window before)."""
        zg = self.gathering
        root = g.unit_params.get("root") or []
        if zg is None or zg.at_once or not root or self._gathered_numel(root[0]) < DS_STAGE3_PERSISTENCE:
            return None
        return self._gathered(g, self._gathered_numel(root[0]) * self.model_dt, f"ZeRO-3 gathered {root[0].label}")

    def _counts_reductions(self) -> bool:
        """Whether backward's gradients are counted into the bucket as they come, for what its reductions make:
        ZeRO-2's partition and flattened bucket (stage_1_and_2.py; with an offloaded optimizer its own path),
        ZeRO-3's flattened reduce-scatter buffer. ZeRO-1 reduces at the end of backward (`_zero1_epilogue`)."""
        return self._partitioned_in_backward() or self.zero >= 3

    def _reduce(self, g: Graph, st: dict[str, Any], r: Reduction) -> None:
        """One reduction of the bucket's gradients in backward, as the modelled rank runs it.

        ZeRO-2 (stage_1_and_2.py reduce_ipg_grads), on the last rank: average_tensor slices the bucket by the rank
        whose part each gradient is in, merging neighbours of one rank, and hands every rank's slices to one
        all-reduce (``use_multi_rank_bucket_allreduce``); with more than one slice, allreduce_bucket flattens them
        into one tensor (``self.flatten``: a copy of the bucket's gradients), so a reduction across a border between
        two ranks' parts copies (measured: none in the reductions within a part); the first reduction then makes
        the rank's partition (copy_grads_in_partition).
        ZeRO-3 (stage3.py __avg_scatter_grads): reduce_scatter_coalesced interleaves every gradient's padded
        partitions into one flat buffer (``torch.cat``), kept until partition_grads has copied the rank's part out
        (measured), unless the bucket holds one gradient that divides evenly."""
        if self.zero >= 3:
            if r.tensors > 1 or r.elements % self.world:
                self._flat_copy(g, r.padded, "flattened gradients (reduce_scatter_coalesced)")
            return
        if self._crosses_parts(r):
            self._flat_copy(g, r.elements, "flattened bucket (allreduce_bucket)")
        if "partition" not in st and self._partitioned_in_backward():
            self._make_partition(g, st)

    def _reduce_repeated(self, g: Graph, st: dict[str, Any]) -> None:
        """Backward turns to the repeated layers, whose events the program repeats for every layer: what their
        reductions make is made as they start (a few layers early: the estimate errs high), the largest flat copy
        for all, from their gradients counted in their parameters' reverse order, every repetition. As they end,
        the count is redone in the order their gradients came (`_count_repeated`) and goes on exactly."""
        units = [u for u in g.unit_params if u in g.repeated_units]
        numels = [self._gathered_numel(q) for u in reversed(units) for q in reversed(g.unit_params[u]) if q.rg]
        st["before_period"] = dataclasses.replace(st["count"])
        count: _BucketCount = st["count"]
        reductions = [r for _ in range(g.repeats) for n in numels if (r := count.add(n, self.world)) is not None]
        if not reductions:
            return
        g.approximated = True
        if self.zero >= 3:
            self._reduce(g, st, max(reductions, key=lambda r: r.padded))
            return
        first = reductions[0] if "partition" not in st and self._partitioned_in_backward() else None
        if first is not None:
            self._reduce(g, st, first)  # the partition (and a flat copy, where it crosses a border)
        copies = [r for r in reductions if r is not first and self._crosses_parts(r)]
        if copies:
            self._reduce(g, st, max(copies, key=lambda r: r.elements))

    def _count_repeated(self, g: Graph, st: dict[str, Any]) -> None:
        """The repeated layers are done: count their gradients again from where they began, in the order they came,
        every repetition (nothing is made here: `_reduce_repeated` made it)."""
        count: _BucketCount = st.pop("before_period")
        order = st.pop("period", [])
        for _ in range(g.repeats):
            for n in order:
                count.add(n, self.world)
        st["count"] = count

    def _crosses_parts(self, r: Reduction) -> bool:
        """Does ZeRO-2 reduction `r` hold gradients of more than one rank's part of the flat group? Backward makes the
        gradients from the group's end (the head's), so its elements ``start .. start + elements`` counted from
        the end hold a border between parts (every ``ceil(flat / world)`` elements from the group's start)."""
        part = -(-self.flat_numel // self.world)
        lo, hi = self.flat_numel - r.start - r.elements, self.flat_numel - r.start  # from the group's start
        first = lo // part + 1  # the first border above lo
        return part > 0 and first < self.world and first * part < hi

    def _flat_copy(self, g: Graph, numel: int, label: str) -> None:
        """A reduction's flattened copy of gradients: made and freed at once, in the model's dtype."""
        flat = g.alloc(const(numel), self.model_dt, label)
        flat.region = "communication"
        g.drop(flat)

    @staticmethod
    def _repeated_params(g: Graph) -> set[int]:
        """The parameters of the repeated layers (`Graph.repeated_units`), by id."""
        return {id(q) for u in g.repeated_units for q in g.unit_params[u]}

    def _make_partition(self, g: Graph, st: dict[str, Any]) -> None:
        part = g.alloc(const(self.partition_numel), self.model_dt, "gradient partition (grads_in_partition)")
        part.is_grad = True
        st["partition"] = part

    def unit_backward_end(self, g: Graph, unit: str, grads: list[T]) -> None:
        st = self.state.setdefault(id(g), {})
        if "count" in st and unit != "root":
            units = list(g.unit_params)  # "root", then the layers' units in forward order
            if units[units.index(unit) - 1] in g.repeated_units:
                self._reduce_repeated(g, st)
        kept = None
        if unit == "root":  # backward's last modules release what is left
            g.drop(*[st.pop(k) for k in ("window", "flat") if k in st], *st.pop("copies", {}).values())
            kept = self._gathered_at_epilogue(g)
        if unit == "root" and "before_period" in st:
            self._count_repeated(g, st)
        if unit == "root" and "count" in st:
            # the epilogue's reduction of what is left in the bucket (measured)
            last = st.pop("count").flush()
            if last is not None:
                self._reduce(g, st, last)
            del st["repeated"]
        if kept is not None:
            g.drop(kept)
        if unit == "root" and self._partitioned_in_backward() and "partition" not in st:
            self._make_partition(g, st)
        if unit == "root" and self._zero1_partition():
            self._zero1_epilogue(g, st)
        if unit == "root":
            # the bucket goes; in a later micro-step the earlier micro-steps' partition then goes too, added into
            # the one this reduction made (measured, gradient accumulation over 2 micro-steps)
            g.drop(*[st.pop(k) for k in ("bucket", "earlier") if k in st])
        if self.zero >= 2:  # gradients are reduced into the rank's partition as buckets fill
            for grad in grads:
                grad.is_grad = False
            g.drop(*grads)

    def param_partitions(self, weights: list[Any]) -> list[tuple[int, int]]:
        """(bytes, count) of the rank's parameters: ZeRO-3 partitions those of at least
        ``stage3_param_persistence_threshold`` elements, the others stay whole; below ZeRO-3, all whole.
        The engine casts the module to its 16-bit dtype (``engine._configure_distributed_model``:
        ``module.bfloat16()``/``half()``), which leaves QLoRA's NF4 weights packed: bitsandbytes'
        ``Params4bit`` holds integer (or ``bnb_4bit_quant_storage``) storage, not a floating tensor, and its
        quantization state is no parameter: ZeRO-3 partitions the packed storage, and the state stays whole
        on the GPU (`replicated`)."""
        out: list[tuple[int, int]] = []
        for p, dt, _train in weights:
            shard_p = shard_world(p, self.world, self.ep) if self.zero >= 3 else 1
            numel, each = _elements(p, dt, self.model_dt)
            if shard_p == 1:
                out.append((numel * each, p.count))
                continue
            out.append((-(-numel // shard_p) * each, p.count))  # the partition (``ds_tensor``)
            if numel < DS_STAGE3_PERSISTENCE:
                # a persistent parameter keeps its partition and its whole data (measured: the partitions of a
                # 3-layer model's attention weights were missing, 592 KB at 2 ranks)
                out.append((numel * each, p.count))
        return out

    def _persistent(self, m: ModelSpec, t: TrainingSpec) -> list[tuple[int, int]]:
        """(bytes, count) of the whole data of the parameters ZeRO-3 keeps gathered (fewer elements than
        ``stage3_param_persistence_threshold``), of the rank's stage."""
        out = []
        for p, dt, _train in _with_idle(m, t):
            numel, each = _elements(p, dt, self.model_dt)
            if _held(self, p, m) and numel < DS_STAGE3_PERSISTENCE and shard_world(p, self.world, self.ep) > 1:
                out.append((numel * each, p.count))
        return out

    @staticmethod
    def replicated(weights: list[Any]) -> list[tuple[int, int]]:
        """(bytes, count) of what every rank holds whole and on the GPU, offloaded or not: QLoRA's
        quantization states (`nf4_parts`)."""
        return [(nf4[1], p.count) for p, dt, _t in weights if (nf4 := nf4_parts(p, dt)) is not None]

    def init(self, m: ModelSpec, t: TrainingSpec, weights: list[Any]) -> list[tuple[str, Sz, int]]:
        out: list[tuple[str, Sz, int]] = []
        world = self.world
        if self.offload != "optimizer+params":  # ZeRO-Infinity's offload_param: partitions on the host
            out += [("weights/params", const(n), c) for n, c in self.param_partitions(weights)]
        out += [("weights/params", const(n), c) for n, c in self.replicated(weights)]
        if self._bucket_kept():
            out.append(("overhead/communication", const(self.reduce_bucket * self.model_dt), 1))
        if self._partitioned_in_backward() and self.accumulating:
            # ZeRO-2: the earlier micro-steps' gradients, reduced into the rank's partition (`grads_in_partition`)
            out.append(("gradients", const(self.partition_numel * self.model_dt), 1))
        if self.zero < 2 and t.grad_accum > 1:
            # ZeRO-0/1 accumulate into the 16-bit ``.grad`` of every trained parameter over the
            # micro-steps (`local_grads_accumulate`): a later micro-step starts with all of them, which
            # zero_grad frees after the optimizer step (`optimizer`)
            out += [("gradients", const(p.numel * self.model_dt), p.count) for p, _dt in _trainable(self, m, t)]
        if self.offload == "none" and not t.first_step:
            # the fp32 master partition and the optimizer's state on it; ZeRO's optimizers clone the partition even
            # when the model is fp32 (stage_1_and_2.py `single_partition_of_fp32_groups`: `...[partition_id]
            # .to(self.device).clone().float().detach()`; stage3.py `fp32_partitioned_groups_flat`: `.clone()
            # .float()`; measured), ZeRO-0 steps on the 16-bit model's own parameters
            master = self.model_dt == 2 or self.zero >= 1
            per = (4 if master and t.optimizer.value != "none" else 0) + flat_state_bytes(t)
            if per:
                out.append(("optimizer_states", const(round(_partition(self, m, t, world if self.zero >= 1 else 1) * per)),
                            1))
        if self.zero not in (1, 2):  # ZeRO-1/2 make their reduce bucket in backward (`unit_backward_begin`)
            out.append(("overhead/communication", const(self.reduce_bucket * self.model_dt), 1))
        if self.zero >= 3 and self.offload == "none":
            # the rank's gradient partition; with an offloaded optimizer it is on the host instead
            # (stage_1_and_2.py copy_grads_in_partition returns before allocating grads_in_partition
            # when cpu_offload; stage3.py puts grad_partitions_flat_buffer on self.device, the CPU)
            out.append(("gradients", const(_partition(self, m, t, world) * self.model_dt), 1))
        return out

    def optimizer(self, m: ModelSpec, t: TrainingSpec) -> list[Segment]:
        n_train = sum(p.numel * p.count for p, _dt in _trainable(self, m, t))
        shard = _partition(self, m, t, self.world if self.zero >= 1 else 1)
        temp = _CAT["transient/optimizer"]
        events: list[tuple[int, int, Sz, str]] = []
        grads = sum(_round(p.numel * self.model_dt) * p.count for p, _dt in _trainable(self, m, t))
        if self._zero1_partition() and self.accumulating:
            events.append((_CAT["gradients"], -1, const(grads), "accumulated gradients released"))
        if self.offload == "none":
            # stage_1_and_2.py / stage3.py step(), measured on CPU (tests/test_parallel.py): the global norm casts
            # each gradient of the partition to fp64 in turn (get_grad_norm_direct: `g.data.to(get_norm_dtype())`,
            # double wherever the device has fp64); the partition's gradients are flattened (`self.flatten`, a
            # 16-bit copy) and that copy cast to the fp32 gradient the update reads, the 16-bit one then deleted;
            # the optimizer updates the flat fp32 partition with its own temporaries (`flat_update_temporaries`)
            largest = max((p.numel for p, _dt in _trainable(self, m, t)), default=0)
            norm = _round(min(largest // self.world if self.zero >= 3 else largest, shard) * 8)
            flat, fp32, update = _round(shard * self.model_dt), _round(shard * 4), flat_update_temporaries(t, shard)
            events += [(temp, 1, const(norm), "gradient norm in fp64 (largest gradient)"), (temp, -1, const(norm), "freed")]
            if self.model_dt != 4:
                events.append((temp, 1, const(flat), "flattened gradient partition"))
            events.append((temp, 1, const(fp32), "fp32 gradient partition"))
            if self.model_dt != 4:
                events.append((temp, -1, const(flat), "flattened copy freed"))
            # "release all the gradient since we have already created a necessary copy" (stage_1_and_2.py step:
            # free_grad_in_param_list, _release_preflattened_grad_buffers): ZeRO-2's partition, ZeRO-1's .grad
            if self.zero in (1, 2) and self.partition_numel:
                events.append((_CAT["gradients"], -1, const(_round(self.partition_numel * self.model_dt)),
                               "gradient partition released"))
            elif self.zero == 1:
                events.append((_CAT["gradients"], -1, const(grads), "gradients released"))
            if update:
                events += [(temp, 1, const(update), "optimizer update temporaries"), (temp, -1, const(update), "freed")]
            events.append((temp, -1, const(fp32), "fp32 gradient partition freed"))
        if self.zero in (1, 2):
            ag = min(DS_ALLGATHER_BUCKET, n_train) * self.model_dt
            events += [(temp, 1, const(ag), "all-gather bucket"), (temp, -1, const(ag), "freed")]
        if self.zero >= 3 and self.offload != "optimizer+params":  # (offloaded parameters: none on the device)
            # stage3.py step(): ``_partition_all_parameters()`` first releases every gathered parameter, the
            # persistent ones' whole data too (their partitions stay), and ``_post_step`` all-gathers those again
            # (measured: a 3-layer model's attention weights, 1.2 MB at 2 ranks, are gone through the update)
            kept = self._persistent(m, t)
            events = ([(_CAT["weights/params"], -c, const(n), "persistent parameters released") for n, c in kept]
                      + events + [(_CAT["weights/params"], c, const(n), "persistent parameters gathered") for n, c in kept])
        segs = [_segment("optimizer", "optimizer step", 1, tuple(events))]
        if self.zero == 0 or (self.zero == 1 and self.offload != "none"):
            segs.append(_segment("zero", "zero_grad", 1, ((_CAT["gradients"], -1, const(grads), "zero_grad"),)))
        return segs


def _elements(p: ParamTensor, dt: float, model_dt: int) -> tuple[int, int]:
    """(elements DeepSpeed counts, bytes each) of parameter `p` stored at `dt` bytes per element in a model cast to
    `model_dt`: a QLoRA NF4 weight as its packed uint8 storage (`nf4_parts`), any other in the model's dtype."""
    nf4 = nf4_parts(p, dt)
    return (nf4[0], 1) if nf4 else (p.numel, model_dt)


def zero2_grad_partition_numel(hooks: DeepSpeedHooks, m: ModelSpec, t: TrainingSpec) -> int:
    """Elements of ZeRO-2's gradient partition on rank 0 (``grads_in_partition``): stage_1_and_2.py sizes it as
    the parameters in the rank's part of the flat group, each whole (``sum(p.numel() for p in
    self.params_in_partition[i])``), so the one that crosses the part's end counts in full (measured: 1,632,768
    elements where the part is 1,436,672). The flat group takes the trainable parameters in
    ``named_parameters()`` order: a multimodal checkpoint's vision tower, then the model's."""
    held = [w for w in weight_tensors(m, t) if _held(hooks, w[0], m) and w[2]]
    sizes = [p.numel for p, _dt in idle_trainable(m, t) for _ in range(p.count)]
    sizes += [p.numel for p, _dt, _layer in _named_order(held, m)]
    sizes += [p.numel for p, _dt, _train in held if ".lora_" in p.name for _ in range(p.count)]
    part = _partition(hooks, m, t, hooks.world)
    total = 0
    for numel in sizes:  # every parameter that starts inside rank 0's part, whole
        if total >= part:
            break
        total += numel
    return total


@lru_cache(maxsize=256)
def zero2_elements(hooks: DeepSpeedHooks, m: ModelSpec, t: TrainingSpec) -> tuple[int, int]:
    """Elements of ZeRO-2's gradient partition (`zero2_grad_partition_numel`) and flat group (`zero2_flat_numel`)
    for `hooks`; memoised: every estimate asks for them."""
    return zero2_grad_partition_numel(hooks, m, t), zero2_flat_numel(hooks, m, t)


def zero2_flat_numel(hooks: DeepSpeedHooks, m: ModelSpec, t: TrainingSpec) -> int:
    """Elements of ZeRO-2's flat group of trainable parameters (a multimodal checkpoint's vision tower first), which
    stage_1_and_2.py pads to a multiple of the ranks and splits into ``ceil(flat / world)``-element parts."""
    idle = sum(p.numel * p.count for p, _dt in idle_trainable(m, t) if _held(hooks, p, m))
    return idle + sum(p.numel * p.count for p, _dt in _trainable(hooks, m, t))


def _with_idle(m: ModelSpec, t: TrainingSpec) -> list[tuple[ParamTensor, Any, bool]]:
    """The weights loading makes, in ``named_parameters()`` order: a multimodal checkpoint's vision tower (each
    tensor of it, frozen: it never gets a gradient) before the language model's (`weight_tensors`)."""
    return [*idle_tensors(m, t), *weight_tensors(m, t)]


@dataclass(frozen=True)
class Zero3Gathering:
    """What ZeRO-3 holds gathered through a step (`zero3_gathering`), in bytes: `window`, the live-parameter
    window held from the first module to backward's end, and `buffer`, the flat all-gather buffer in flight.
    `at_once`: the model is within one prefetch, gathered whole by its first module (each weight its own copy,
    released with its module's backward) through one buffer, freed as the head's weight is waited for."""

    window: int
    buffer: int
    at_once: bool = False


def zero3_gathering(weights: list[tuple[ParamTensor, Any, bool]], model_dt: int, world: int) -> Zero3Gathering | None:
    """What ZeRO-3 holds gathered through a step of the rank's `weights` (`DeepSpeedHooks.unit_forward_begin`);
    None when every parameter is persistent.

    The gathered parameters are those a partition does not keep whole (``stage3_param_persistence_threshold``
    elements or more), each its own tensor in the model's dtype (QLoRA's NF4 weights as their packed storage,
    whose uint8 elements DeepSpeed counts), up to ``stage3_max_live_parameters`` elements in all (a model with
    more gathers that many, at its average bytes per element). A prefetch gathers up to
    ``stage3_prefetch_bucket_size`` elements through one flat buffer of every rank's padded partitions: a model
    within it in one buffer; a larger one has about one prefetch's buffer in flight at a time."""
    max_live, prefetch = DS_STAGE3_MAX_LIVE, DS_STAGE3_PREFETCH
    numel = held = flat = 0
    for p, dt, _train in weights:
        n, each = _elements(p, dt, model_dt)
        if n >= DS_STAGE3_PERSISTENCE:
            numel += n * p.count
            held += _round(n * each) * p.count
            flat += world * -(-n // world) * each * p.count
    if not numel:
        return None
    if numel <= prefetch:
        return Zero3Gathering(held, _round(flat), True)
    window = held if numel <= max_live else _round(held * max_live // numel)
    return Zero3Gathering(window, _round(flat * prefetch // numel))


@lru_cache(maxsize=256)
def _zero3_load(m: ModelSpec, t: TrainingSpec, hooks: DeepSpeedHooks) -> tuple[tuple[int, ...], int]:
    """Rank 0's ZeRO-3 loading trace (`zero3_loading_events` of the weights its pipeline stage holds, in the
    engine's dtype) and its peak bytes; memoised on the model, the step's key (`program_key`) and the hooks."""
    from ..step.load import trace_peak

    weights = [(p, hooks.weight_dtype(t, dt), train) for p, dt, train in _with_idle(m, t) if _held(hooks, p, m)]
    trace = zero3_loading_events(weights, m, hooks.world, hooks.ep, shards_on_host=hooks.offload == "optimizer+params")
    return trace, trace_peak(trace)


@lru_cache(maxsize=256)
def _replicated_load(m: ModelSpec, t: TrainingSpec, hooks: DeepSpeedHooks) -> tuple[tuple[int, ...], int]:
    """Rank 0's loading trace below ZeRO-3 and its peak: ``deepspeed.initialize`` casts the host model to its
    16-bit dtype (``DeepSpeedEngine._configure_distributed_model``: ``self.module.bfloat16()`` / ``.half()``)
    and then moves it to the device, each parameter whole in the engine's dtype; its stage's parameters only
    (QLoRA instead quantizes on the device as it loads: `loading_events`). Every storage is freed at the end,
    as in `loading_events`."""
    from ..step.load import LoadTrace, trace_peak

    held = [(p, hooks.weight_dtype(t, dt), train) for p, dt, train in _with_idle(m, t) if _held(hooks, p, m)]
    adapters = [(p, dt) for p, dt, _train in held if ".lora_" in p.name for _ in range(p.count)]
    trace = LoadTrace()
    for p, dt in [(p, dt) for p, dt, _layer in _named_order(held, m)] + adapters:
        trace.malloc(round(p.numel * dt), keep=True)
    done = trace.done()
    return done, trace_peak(done)
