"""Loading the model before the first step: what ``from_pretrained`` puts on the device, tensor by tensor.

transformers 5.x loads a checkpoint tensor by tensor into the model's dtype on the target device
(``low_cpu_mem_usage`` is always on: the state dict is memory-mapped, not copied), so loading a 16-bit
or fp32 model allocates exactly its weights. QLoRA quantizes on load: bitsandbytes' ``Params4bit``
moves each 16-bit weight to the GPU and then quantizes it (``Params4bit._quantize`` ->
``bnb.functional.quantize_4bit``: packed 4-bit values and fp32 block absmax; with double quantization
the absmax is quantized again to uint8 with its own fp32 absmax, code and offset, and the fp32 absmax
is freed), after which the 16-bit copy is freed. Those freed 16-bit blocks stay in the caching
allocator's cache: the reserved residue loading leaves for the step (`loading_events`, replayed before
the step by `trainmem_nb.step.reserved.replay_step`).

A sharded rank materialises only the share it keeps (`shard`), as FSDP2 does when ``fully_shard`` runs on the
meta device and each rank allocates its shards (torchtitan's init). The engines that load otherwise have their
own traces, measured on CPU: FSDP1 wraps a unit at a time, whole on the device before it shards it
(`trainmem_nb.parallel.fsdp1.wrap_events`, its ``sync_module_states`` broadcast included); DeepSpeed ZeRO-3
builds each parameter whole inside ``zero.Init`` and gathers each module to copy the checkpoint in
(`trainmem_nb.parallel.deepspeed.zero3_loading_events`), and below ZeRO-3 moves its 16-bit model to the device.
The optimizer states are the first ``step()``'s (``TrainingSpec.first_step``), not loading's.
"""

from __future__ import annotations

from functools import lru_cache

from ..engine.program import TimelinePoint
from ..model.params import (
    NF4_BLOCK,
    NF4_NESTED_BLOCK,
    NF4_NESTED_CODE_BYTES,
    idle_weights,
    quantized,
    routed_expert,
    weight_tensors,
)
from ..model.spec import ModelSpec
from ..spec.choices import Method
from ..spec.training import TrainingSpec

__all__ = ["LoadTrace", "load_peak_bytes", "load_timeline", "loading_events", "trace_peak"]


def _block(n: float) -> int:
    """Bytes the allocator accounts for a request of `n` (512-B blocks, as the step's sizes)."""
    n = int(n)
    return -(-n // 512) * 512 if n > 0 else 0


class LoadTrace:
    """A loading trace as it is written: `malloc` numbers each allocation (`keep`: one loading leaves to the
    step), `free` frees allocations by number, `done` frees what is kept, last first, and gives the trace."""

    def __init__(self) -> None:
        self.events: list[int] = []
        self.kept: list[int] = []
        self._n = 0

    def malloc(self, nbytes: float, keep: bool = False) -> int:
        self.events.append(max(0, int(nbytes)))
        self._n += 1
        if keep:
            self.kept.append(self._n - 1)
        return self._n - 1

    def free(self, *allocations: int) -> None:
        self.events.extend(~a for a in allocations)

    def done(self) -> tuple[int, ...]:
        self.free(*reversed(self.kept))
        self.kept = []
        return tuple(self.events)


def loading_events(m: ModelSpec, t: TrainingSpec, shard: float = 1.0, expert_shard: float | None = None) -> tuple[int, ...]:
    """The device's allocations and frees while the model loads, as a replay trace (``e >= 0`` mallocs
    ``e`` bytes, ``~i`` frees allocation ``i``), every tensor freed at the end: the step's own trace then
    allocates what loading left (`trainmem_nb.engine.trace`), so what remains is the cache loading
    leaves behind. `shard`: the fraction of each weight a rank keeps (sharded data parallelism);
    `expert_shard`: of each routed expert stack, when expert parallelism shards those over fewer ranks.
    Memoised on what shapes the step program (the batch shape does not change what loads)."""
    from .compile import program_key

    return _loading_events(m, program_key(t, m), shard, shard if expert_shard is None else expert_shard)


@lru_cache(maxsize=256)
def _loading_events(m: ModelSpec, t: TrainingSpec, shard: float, expert_shard: float) -> tuple[int, ...]:
    trace = LoadTrace()
    malloc = trace.malloc
    qlora = t.method is Method.QLORA
    # a multimodal checkpoint's vision tower first (``named_parameters()`` order), sharded as the rest where a
    # rank keeps a share (FSDP2's root group holds it)
    weights = [(p, dt) for p, dt in idle_weights(m, t)] + [(p, pdt) for p, pdt, _ in weight_tensors(m, t)]
    for p, pdt in weights:
        for _ in range(p.count):
            numel = max(1, int(p.numel * (expert_shard if routed_expert(p) else shard)))
            if qlora and quantized(p, t.qlora_head):
                w16 = malloc(numel * 2)  # the checkpoint's 16-bit weight, moved to the GPU
                blocks = -(-numel // NF4_BLOCK)
                malloc(-(-numel // 2), keep=True)  # packed 4-bit values
                absmax = malloc(blocks * 4, keep=not t.qlora_double_quant)  # fp32 absmax per 64-value block
                if t.qlora_double_quant:
                    for nbytes in (blocks, -(-blocks // NF4_NESTED_BLOCK) * 4, NF4_NESTED_CODE_BYTES, 4):
                        malloc(nbytes, keep=True)
                    trace.free(absmax)
                trace.free(w16)
            else:
                malloc(numel * pdt, keep=True)
    return trace.done()


def load_peak_bytes(m: ModelSpec, t: TrainingSpec, shard: float = 1.0, expert_shard: float | None = None) -> int:
    """The most bytes allocated while the model loads (each storage in 512-B blocks, as the step's peak):
    its weights, and for QLoRA also the one 16-bit weight being quantized and its fp32 absmax."""
    from .compile import program_key

    return _load_peak_bytes(m, program_key(t, m), shard, shard if expert_shard is None else expert_shard)


@lru_cache(maxsize=256)
def _load_peak_bytes(m: ModelSpec, t: TrainingSpec, shard: float, expert_shard: float) -> int:
    return trace_peak(loading_events(m, t, shard, expert_shard))


def trace_peak(trace: tuple[int, ...]) -> int:
    """The most bytes a loading trace (``e >= 0`` mallocs ``e`` bytes, ``~i`` frees allocation ``i``) holds
    at once, each storage in 512-B blocks as the step's peak."""
    sizes: list[int] = []
    live = best = 0
    for e in trace:
        if e >= 0:
            sizes.append(_block(e))
            live += sizes[-1]
            best = max(best, live)
        else:
            live -= sizes[~e]
    return best


def load_timeline(trace: tuple[int, ...], max_points: int = 120) -> list[TimelinePoint]:
    """Live bytes through loading (a `loading_events` trace) as timeline points of phase "load": the
    weights that stay, and as "transient" what loading frees again (QLoRA's 16-bit weight and fp32 absmax
    being quantized, FSDP1's whole unit before it is sharded); thinned to `max_points`, keeping each
    bucket's highest point and the last (all loaded)."""
    from ..engine.breakdown import TOP_KEYS

    end = len(trace)
    while end and trace[end - 1] < 0:  # the trailing frees hand what loading left to the step
        end -= 1
    freed = {~e for e in trace[:end] if e < 0}
    w, tr = TOP_KEYS.index("weights"), TOP_KEYS.index("transient")
    cats = [0] * len(TOP_KEYS)
    sizes: list[int] = []
    points = [TimelinePoint(0, "load", "loading starts", 0, tuple(cats))]
    for i, e in enumerate(trace[:end]):
        if e >= 0:
            a = len(sizes)
            sizes.append(_block(e))
            cats[tr if a in freed else w] += sizes[a]
            label = "a copy it frees again" if a in freed else "a weight"
        else:
            cats[tr] -= sizes[~e]
            label = "a copy freed"
        points.append(TimelinePoint(i + 1, "load", f"loading: {label}", sum(cats), tuple(cats)))
    if len(points) <= max_points:
        return points
    body = points[1:-1]
    size = -(-len(body) // max(1, max_points - 2))
    return [points[0], *(max(body[i:i + size], key=lambda p: p.total_bytes) for i in range(0, len(body), size)),
            points[-1]]
