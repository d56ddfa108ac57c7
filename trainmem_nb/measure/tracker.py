"""Track every live tensor storage through a training step, exactly, on real or fake tensors.

A `TorchDispatchMode` sees each ATen op's outputs; every new storage is recorded with the phase,
module and op that made it, and a weakref callback on its `UntypedStorage` (PyTorch keeps one Python
object per storage) records the moment it is freed. Replaying the allocation/free events gives the live
bytes after every op, its peak, and what was alive at the peak, by category. With fake tensors
(`FakeTensorMode`) nothing is computed and the same accounting holds for any model size.

Tensor subclasses that wrap others (torchao's ``Float8TrainingTensor``) own no storage of their own: the
tracker records their inner tensors, and runs the subclass's own dispatch with itself still active, so the
copies a subclass makes inside an op (a ``contiguous()`` of its fp8 data before ``_scaled_mm``) are seen too.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

__all__ = ["CUDA_BLOCK_BYTES", "Record", "StorageTracker", "cuda_round"]

#: The CUDA caching allocator rounds every block up to a multiple of 512 bytes (kMinBlockSize in
#: c10/cuda/CUDACachingAllocator.cpp), which is what ``torch.cuda.max_memory_allocated()`` counts.
CUDA_BLOCK_BYTES = 512


def cuda_round(nbytes: int) -> int:
    """Bytes the CUDA caching allocator would account for a block of `nbytes`."""
    return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES if nbytes > 0 else 0


@dataclass
class Record:
    """One storage: its size, when and where it was made, when it died, and its category."""

    nbytes: int
    phase: str
    op: str
    module: str
    dtype: str
    shape: tuple[int, ...]
    born: int  # index into StorageTracker.events
    died: int | None = None
    category: str = ""
    source_param: bool = False  # made by copying a parameter (autocast weight copy)
    in_layer: bool = False
    layer_index: int | None = None


def _traced_through(t: Any) -> bool:
    """A tensor subclass whose own handler the tracker runs (so its inner ATen ops are recorded): one that runs
    plain-tensor ops on what it wraps (torchao's ``Float8TrainingTensor``). DTensor is not: its handler
    dispatches again on DTensors; its ops run as usual and its outputs' local shards are recorded."""
    if not is_traceable_wrapper_subclass(t):
        return False
    return not any(c.__name__ == "DTensor" for c in type(t).__mro__)


class StorageTracker(TorchDispatchMode):
    """Dispatch mode that records every storage's birth and death.

    ``events`` is the ordered list of ``(record_index, +1 | -1)``; the caller moves the step from
    ``forward`` to ``backward`` to ``optimizer`` with `mark` (or by setting ``phase``) and adopts
    pre-existing tensors with `adopt`. ``phase_starts`` lists ``(phase, first event index)`` of each
    `mark`. ``layer_names`` maps each transformer layer's module name to its index, so records know
    their layer.
    """

    def __init__(self, layer_names: dict[str, int] | None = None, device_type: str | None = None) -> None:
        super().__init__()
        self.device_type = device_type  # count only storages on this device type (cuda: not host scalars)
        self.records: list[Record] = []
        self.events: list[tuple[int, int]] = []
        self.phase = "init"
        self.module_stack: list[str] = []
        self.layer_names: dict[str, int] = dict(layer_names or {})
        self._live: dict[int, int] = {}
        self._refs: dict[int, Any] = {}
        self._param_storages: set[int] = set()
        self.phase_starts: list[tuple[str, int]] = []
        self._layer_cache: dict[str, int | None] = {}
        self.closed = False

    def mark(self, phase: str) -> None:
        """Enter `phase`: later storages are born in it and `phase_starts` records where it began."""
        self.phase = phase
        self.phase_starts.append((phase, len(self.events)))

    # -- registration ---------------------------------------------------------------------------
    def adopt(self, tensors: Iterable[torch.Tensor], category: str, param: bool = False) -> None:
        """Record storages that exist before the step (parameters, states, inputs) under `category`."""
        for t in tensors:
            idx = self._see(t, "adopt", force_category=category)
            if idx is not None and param:
                self._param_storages.add(id(t.untyped_storage()))

    def _see(self, t: torch.Tensor, op: str, force_category: str = "", source_param: bool = False) -> int | None:
        if is_traceable_wrapper_subclass(t):  # a wrapper's storage is a placeholder: record what it wraps
            inner, _ = t.__tensor_flatten__()
            for name in inner:
                self._see(getattr(t, name), op, force_category, source_param)
            return None
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._live:
            return None
        if self.device_type is not None and storage.device.type != self.device_type:
            return None
        nbytes = storage.nbytes()
        module = self.module_stack[-1] if self.module_stack else ""
        layer = self._layer_of(module)
        rec = Record(
            nbytes=nbytes, phase=self.phase, op=op, module=module, dtype=str(t.dtype).replace("torch.", ""),
            shape=tuple(t.shape), born=len(self.events), category=force_category, source_param=source_param,
            in_layer=layer is not None, layer_index=layer,
        )
        idx = len(self.records)
        self.records.append(rec)
        self._live[key] = idx
        self.events.append((idx, 1))
        self._refs[idx] = weakref.ref(storage, self._make_death(key, idx))
        return idx

    def _make_death(self, key: int, idx: int) -> Any:
        def _died(_ref: Any) -> None:
            if self.closed:  # frees after the step (the model being garbage-collected) are not part of it
                return
            if self._live.get(key) == idx:
                del self._live[key]
            self.records[idx].died = len(self.events)
            self.events.append((idx, -1))
            self._refs.pop(idx, None)

        return _died

    def _layer_of(self, module: str) -> int | None:
        if module in self._layer_cache:
            return self._layer_cache[module]
        found = None
        for name, index in self.layer_names.items():
            if module == name or module.startswith(name + "."):
                found = index
                break
        self._layer_cache[module] = found
        return found

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        wrapper = next((a for a in tree_flatten((args, kwargs))[0] if _traced_through(a)), None)
        if wrapper is not None:
            # the subclass's own handler, with this mode still on: the ATen ops it runs on its inner
            # tensors come back here and are recorded (with the mode popped, as `func` would run it, they
            # would not be)
            with self:
                return type(wrapper).__torch_dispatch__(func, types, args, kwargs or {})
        out = func(*args, **(kwargs or {}))
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        source_param = False
        if name.startswith("_to_copy") and args and isinstance(args[0], torch.Tensor):
            source_param = id(args[0].untyped_storage()) in self._param_storages
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._see(t, name, source_param=source_param)
        return out

    def __exit__(self, *exc: Any) -> Any:
        result = super().__exit__(*exc)
        return result

    def close(self) -> None:
        """Stop recording frees: what happens after the step is not part of it."""
        self.closed = True

    # -- results --------------------------------------------------------------------------------
    def live_storage_ids(self) -> dict[int, int]:
        """``{id(storage): record index}`` of the storages alive now."""
        return dict(self._live)

    def index_of(self, t: torch.Tensor) -> int | None:
        """The record index of a live tensor's storage, if tracked."""
        return self._live.get(id(t.untyped_storage()))

    def replay(self, rounding: bool = True) -> tuple[int, int, list[int]]:
        """Replay the events: ``(peak bytes, event index of the peak, live bytes after each event)``."""
        live = 0
        peak = -1
        at = 0
        curve: list[int] = []
        rnd = cuda_round if rounding else (lambda n: n)
        for i, (idx, sign) in enumerate(self.events):
            live += sign * rnd(self.records[idx].nbytes)
            curve.append(live)
            if live > peak:
                peak, at = live, i
        return max(peak, 0), at, curve

    def loading_trace(self, on_host: Callable[[Record], bool]) -> tuple[int, ...]:
        """The events as a loading trace (``e >= 0`` mallocs ``e`` bytes, ``~i`` frees allocation ``i``, as
        `trainmem_nb.step.load.loading_events` writes them), leaving out empty storages (no block) and the
        records `on_host` says a GPU run would keep in host memory."""
        number: dict[int, int] = {}
        trace: list[int] = []
        for i, sign in self.events:
            r = self.records[i]
            if r.nbytes == 0 or on_host(r):
                continue
            if sign > 0:
                number[i] = len(number)
                trace.append(r.nbytes)
            else:
                trace.append(~number[i])
        return tuple(trace)

    def alive_at(self, event_index: int) -> list[int]:
        """Record indices alive just after event `event_index`."""
        return [
            i for i, r in enumerate(self.records)
            if r.born <= event_index and (r.died is None or r.died > event_index)
        ]
