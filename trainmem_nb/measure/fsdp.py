"""Measure one rank of an FSDP2 (``fully_shard``) training step, in a single process.

PyTorch's fake process group (``torch.testing._internal.distributed.fake_pg``) lets this process play
rank ``rank`` of a ``world_size``-GPU job: collectives return tensors of the right shapes without
communicating. With fake tensors on top, any model size is measured on a laptop. FSDP2 frees and
re-allocates unsharded parameters by resizing their storage (``_fsdp_param.alloc_storage`` /
``free_storage``), which no dispatch mode sees; `ResizeAwareTracker` is told about them.

The recipe is torchtitan's: every transformer layer and the root are ``fully_shard``-ed; ZeRO-3 =
``reshard_after_forward=True`` (FULL_SHARD), ZeRO-2 = ``False`` (SHARD_GRAD_OP); mixed precision is
``MixedPrecisionPolicy(param_dtype=bf16|fp16, reduce_dtype=fp32)`` without autocast (sharded params,
gradients and optimizer states stay fp32; the gathered parameters and activations are 16-bit).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..model.spec import ModelSpec
from ..spec.choices import Checkpointing, Precision
from ..spec.parallel import ParallelSpec
from ..spec.training import TrainingSpec
from .step import _categorize, _module_context, build, decoder_layers, layer_module_names, make_optimizer
from .tracker import StorageTracker

__all__ = ["ResizeAwareTracker", "measure_fsdp1_wrap", "measure_fsdp_gloo", "run_fsdp_step", "spawn_ranks"]


class ResizeAwareTracker(StorageTracker):
    """A `StorageTracker` that also follows storages resized in place (FSDP's unshard/reshard)."""

    def __init__(self, layer_names: dict[str, int] | None = None) -> None:
        super().__init__(layer_names)
        self._current: dict[int, int] = {}  # id(storage) -> the record currently holding its bytes
        self.context_category = ""  # set while FSDP's collectives allocate their buffers

    def _see(self, t: torch.Tensor, op: str, force_category: str = "", source_param: bool = False) -> int | None:
        # a dispatch mode sees DTensor-level ops (global shapes); the memory is the local shard's
        t = getattr(t, "_local_tensor", t)
        key = id(t.untyped_storage())
        if key in self._current and self._current[key] is None:
            return None  # resized to 0 and not yet re-allocated: nothing to count
        idx = super()._see(t, op, force_category or self.context_category, source_param)
        if idx is not None:
            self._current[key] = idx
        return idx

    def _make_death(self, key: int, idx: int) -> Any:
        def _died(_ref: Any) -> None:
            if self.closed or self._current.get(key) != idx:
                return
            self._current.pop(key, None)
            self._live.pop(key, None)
            self.records[idx].died = len(self.events)
            self.events.append((idx, -1))

        return _died

    def resized(self, t: torch.Tensor, nbytes: int) -> None:
        """A storage was resized to `nbytes`: free its current record, start a new one if non-empty."""
        storage = t.untyped_storage()
        key = id(storage)
        old = self._current.get(key)
        if old is not None:
            self.records[old].died = len(self.events)
            self.events.append((old, -1))
            self._live.pop(key, None)
        self._current[key] = None  # type: ignore[assignment]
        if nbytes:
            self._current.pop(key, None)
            from .tracker import Record

            module = self.module_stack[-1] if self.module_stack else ""
            rec = Record(nbytes=nbytes, phase=self.phase, op="fsdp.alloc_storage", module=module,
                         dtype=str(t.dtype).replace("torch.", ""), shape=tuple(t.shape), born=len(self.events),
                         category="weights/gathered", in_layer=False)
            idx = len(self.records)
            self.records.append(rec)
            self.events.append((idx, 1))
            self._live[key] = idx
            self._current[key] = idx
            import weakref

            self._refs[idx] = weakref.ref(storage, self._make_death(key, idx))


def _tracked(tracker: ResizeAwareTracker, alloc: Callable[..., None],
             free: Callable[[torch.Tensor], None]) -> tuple[Callable[..., None], Callable[[torch.Tensor], None]]:
    """FSDP's storage allocate and free functions (``alloc(tensor[, size])``, ``free(tensor)``: a storage resized in
    place), wrapped so that `tracker` sees each resize."""
    def tracked_alloc(tensor: torch.Tensor, *size: Any) -> None:
        before = tensor.untyped_storage().size()
        alloc(tensor, *size)
        after = tensor.untyped_storage().size()
        if after != before:
            tracker.resized(tensor, after)

    def tracked_free(tensor: torch.Tensor) -> None:
        before = tensor.untyped_storage().size()
        free(tensor)
        if before:
            tracker.resized(tensor, 0)

    return tracked_alloc, tracked_free


@contextlib.contextmanager
def _follow_resizes(tracker: ResizeAwareTracker) -> Iterator[None]:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param, _fsdp_param_group

    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage
    originals = {
        (_fsdp_param_group, "foreach_all_gather"): "overhead/communication",
        (_fsdp_param_group, "foreach_all_gather_copy_out"): "weights/gathered",
        (_fsdp_param_group, "foreach_reduce"): "overhead/communication",
    }
    saved = {key: getattr(*key) for key in originals}

    def tagging(fn: Any, category: str) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            tracker.context_category, before = category, tracker.context_category
            try:
                return fn(*args, **kwargs)
            finally:
                tracker.context_category = before

        return wrapper

    for (module, name), category in originals.items():
        setattr(module, name, tagging(saved[(module, name)], category))
    _ = _fsdp_collectives

    _fsdp_param.alloc_storage, _fsdp_param.free_storage = _tracked(tracker, alloc, free)  # type: ignore[assignment]
    try:
        yield
    finally:
        _fsdp_param.alloc_storage, _fsdp_param.free_storage = alloc, free
        for (module, name), fn in saved.items():
            setattr(module, name, fn)


@contextlib.contextmanager
def _follow_fsdp1_resizes(tracker: ResizeAwareTracker) -> Iterator[None]:
    """FSDP1 unshards and reshards its FlatParameters by resizing their storage (``_flat_param.py``'s
    ``_alloc_storage(tensor, size)`` / ``_free_storage(tensor)``), which no dispatch mode sees."""
    from torch.distributed.fsdp import _flat_param

    alloc, free = _flat_param._alloc_storage, _flat_param._free_storage
    _flat_param._alloc_storage, _flat_param._free_storage = _tracked(tracker, alloc, free)  # type: ignore[assignment]
    try:
        with _fsdp1_quiet():
            yield
    finally:
        _flat_param._alloc_storage, _flat_param._free_storage = alloc, free


@contextlib.contextmanager
def _fsdp1_quiet() -> Iterator[None]:
    """FSDP1's notices that are about the run, not the measurement: its data-pointer checks on fake tensors and
    its warning that a FlatParameter mixing frozen and trained parameters holds gradients for all of them (the
    mechanism measured)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed\.fsdp")
        yield


def _shard_fsdp1(model: nn.Module, p: ParallelSpec, t: TrainingSpec) -> nn.Module:
    """Lightning Fabric's FSDPStrategy as lit-gpt sets it: FSDP1 around every transformer layer and the
    root (``auto_wrap_policy={Block}``), FULL_SHARD (ZeRO-3) or SHARD_GRAD_OP (ZeRO-2),
    ``limit_all_gathers=True``, the parameters' own dtype (no MixedPrecision policy)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    layers = _decoder_layers(model)
    layer_cls = type(layers[0])
    checkpointed = t.checkpointing is Checkpointing.FULL
    if checkpointed:  # Fabric checkpoints the wrapped blocks itself (below), not through transformers
        for mod in model.modules():
            if getattr(mod, "gradient_checkpointing", False):
                setattr(mod, "gradient_checkpointing", False)  # noqa: B010 (a module attribute mypy types as Tensor | Module)
    strategy = ShardingStrategy.FULL_SHARD if p.zero >= 3 else ShardingStrategy.SHARD_GRAD_OP
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({layer_cls}),
                                       sharding_strategy=strategy, use_orig_params=t.use_orig_params,
                                       device_id=torch.device("cpu"), limit_all_gathers=True,
                                       sync_module_states=t.sync_module_states)
    if checkpointed:  # lightning/fabric/strategies/fsdp.py, _setup_activation_checkpointing
        apply_activation_checkpointing(
            wrapped, checkpoint_wrapper_fn=lambda mod: checkpoint_wrapper(mod, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda mod: isinstance(mod, layer_cls))
    return wrapped


def measure_fsdp1_wrap(m: ModelSpec, t: TrainingSpec, p: ParallelSpec, rank: int = 0) -> tuple[int, tuple[int, ...]]:
    """What wrapping a model held on the device in FSDP1 (`_shard_fsdp1`) allocates on rank `rank` of ``p.dp``,
    played over PyTorch's fake process group with real CPU tensors, as a loading trace (``e >= 0`` mallocs ``e``
    bytes, ``~i`` frees allocation ``i``) whose first allocations are the model's parameters and buffers
    (their number is returned with it). ``FlatParamHandle.shard`` frees the unsharded FlatParameter by resizing
    its storage, which no dispatch mode sees: the tracker is told right after the shard is cloned."""
    import gc
    from unittest import mock

    import torch.distributed as dist
    from torch.distributed.fsdp import _init_utils
    from torch.distributed.fsdp._flat_param import FlatParamHandle
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=p.dp)
    get_shard, sync = FlatParamHandle._get_shard, _init_utils._sync_params_and_buffers
    try:
        model, _inputs = build(m, t, "cpu")
        tracker = ResizeAwareTracker()
        tracker.adopt([*model.parameters(), *model.buffers()], "weights", param=True)
        before = len(tracker.records)

        def shard_then_free(tensor: torch.Tensor, r: int, world: int) -> tuple[torch.Tensor, int]:
            out = get_shard(tensor, r, world)
            tracker.resized(tensor, 0)  # shard(): ``flat_param._typed_storage()._resize_(0)``
            return out

        def synced(*args: Any, **kwargs: Any) -> Any:
            # the broadcast's flat buckets live in C++ (broadcast_coalesced frees them before it returns); the
            # tracker sees one go when Python drops the wrapper the dispatch mode made for it, which a reference
            # cycle can delay past the next allocations: collecting here puts each free where the allocator has it
            out = sync(*args, **kwargs)
            gc.collect()
            return out

        with (mock.patch.object(FlatParamHandle, "_get_shard", staticmethod(shard_then_free)),
              mock.patch.object(_init_utils, "_sync_params_and_buffers", synced),
              # sync_module_states refuses CPU states (it broadcasts over NCCL): lifted, so the broadcast's
              # bucket copies run on the process group the measurement plays
              mock.patch.object(_init_utils, "_check_module_states_for_sync_module_states", lambda *_a, **_k: None),
              tracker, _follow_fsdp1_resizes(tracker)):
            # no collection but `synced`'s: one the interpreter starts on its own (its thresholds depend on what the
            # process allocated before) would drop a cycle's wrappers wherever it runs, moving their frees; one
            # collection first, so that what earlier work left in cycles goes before the wrap, not during it
            gc.collect()
            gc.disable()
            try:
                model = _shard_fsdp1(model, p, t)
            finally:
                gc.enable()
        del model
        return before, tracker.loading_trace(_on_host)
    finally:
        dist.destroy_process_group()


def _on_host(r: Any) -> bool:
    """The 0-dim tensor ``_get_dtype_size`` makes to read a dtype's size (``torch.empty((), dtype=dtype)``: on
    the default device, the host)."""
    return bool(r.op == "empty.memory_format" and r.shape == ())


def _float8_gather_scales(model: nn.Module) -> list[torch.Tensor]:
    """The scale each weight torchao all-gathers in fp8 kept from its last gather (the previous step's backward:
    ``fsdp_post_all_gather`` gives the unsharded ``Float8TrainingTensor`` a new one at every gather)."""
    out = []
    for mod in model.modules():
        get_state = getattr(mod, "_get_fsdp_state", None)
        group = get_state()._fsdp_param_group if get_state is not None else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            scale = getattr(getattr(fsdp_param, "_unsharded_param", None), "_scale", None)
            if isinstance(scale, torch.Tensor):
                out.append(scale)
    return out


def _flat_grads(model: nn.Module) -> list[torch.Tensor]:
    """Every FSDP1 FlatParameter's ``.grad`` (its sharded gradient after a synchronised backward)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return [mod._handle.flat_param.grad for mod in model.modules()
            if isinstance(mod, FullyShardedDataParallel) and mod._handle is not None
            and mod._handle.flat_param.grad is not None]


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer layers FSDP wraps one by one: the language model's (`decoder_layers`), never a vision
    tower's."""
    found = decoder_layers(model)
    if found is None:
        raise ValueError(f"{type(model).__name__} has no repeated layers to wrap")
    return found[1]


def _shard(model: nn.Module, p: ParallelSpec, t: TrainingSpec, mesh: Any) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if t.mixed:
        dtype = torch.bfloat16 if t.precision is Precision.BF16_MIXED else torch.float16
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    reshard = p.zero >= 3
    layers = _decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)


def run_fsdp_step(m: ModelSpec, t: TrainingSpec, p: ParallelSpec, rank: int = 0, device: str = "fake",
                  init_method: str | None = None) -> Any:
    """Build, shard, prime and measure one FSDP2 step on rank `rank` of ``p.dp`` data-parallel ranks.

    Without `init_method` this process plays the rank over PyTorch's fake process group; with one
    (``tcp://127.0.0.1:port``) it is one of ``p.dp`` real processes talking gloo (`measure_fsdp_gloo`)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .step import StepTrace

    if dist.is_initialized():
        dist.destroy_process_group()
    if init_method is None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=p.dp)
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=p.dp)
    timing: dict[str, float] = {}
    t0 = time.perf_counter()
    try:
        mesh = init_device_mesh("cpu", (p.dp,))  # outside fake mode: the mesh holds real tensors
        fake_ctx: Any = contextlib.nullcontext()
        fixes: Any = contextlib.nullcontext()
        if device == "fake":
            from torch._subclasses.fake_tensor import FakeTensorMode

            from .fakefix import fake_mode_fixes

            fake_ctx, fixes = FakeTensorMode(allow_non_fake_inputs=True), fake_mode_fixes()
        # the model is built in fp32 and FSDP's policy casts for compute (no autocast)
        # (a copy, not a new validation: fp8 is modelled over fp32 weights only under this policy)
        build_t = t.model_copy(update={"precision": Precision.FP32}) if t.mixed else t
        flat = t.fsdp_version == 1
        if flat and device == "fake":
            from ..errors import SpecError

            # _catch_all_reshard and _writeback_orig_params compare storages by data_ptr(), which fake tensors
            # do not have: a frozen root stays gathered, SHARD_GRAD_OP's write-back fails
            raise SpecError("FSDP1 (fsdp_version=1) cannot be measured under fake tensors (it compares data "
                            "pointers to decide what to reshard): measure it with device='cpu'")
        with fake_ctx, fixes, _fsdp1_quiet() if flat else contextlib.nullcontext():
            model, inputs = build(m, build_t, "fake" if device == "fake" else "cpu")
            if flat:
                model = _shard_fsdp1(model, p, t)
            else:
                _shard(model, p, t, mesh)
            trainable = [q for q in model.parameters() if q.requires_grad]
            opt = make_optimizer(t, trainable)
            # warm up with one untracked micro-step: FSDP's lazy init runs and, unless this is the
            # first step, the optimizer creates its (sharded) state with a zero learning rate
            model(**inputs).loss.backward()
            if opt is not None and not t.first_step:
                lrs = [g["lr"] for g in opt.param_groups]
                for g in opt.param_groups:
                    g["lr"] = 0.0
                opt.step()
                for g, lr in zip(opt.param_groups, lrs, strict=True):
                    g["lr"] = lr
            for q in trainable:
                q.grad = None
            # gradient accumulation: the measured micro-step is the last one, the sharded gradients of
            # the earlier ones are alive and the new ones are added to them (FSDP1: the earlier ones run
            # under no_sync(), as Fabric's no_backward_sync does, and leave unsharded gradients)
            for _ in range(t.grad_accum - 1):
                with model.no_sync() if flat else contextlib.nullcontext():  # type: ignore[operator]
                    model(**inputs).loss.backward()
            timing["build_s"] = time.perf_counter() - t0
            tracker = ResizeAwareTracker(layer_module_names(model))
            local = [getattr(q, "_local_tensor", q) for q in model.parameters()]
            tracker.adopt(local, "weights/params", param=True)
            tracker.adopt(list(model.buffers()), "weights/buffers")
            if opt is not None:
                states = [getattr(v, "_local_tensor", v) for s in opt.state.values() for v in s.values()
                          if isinstance(v, torch.Tensor)]
                tracker.adopt(states, "optimizer_states")
            if t.grad_accum > 1:
                tracker.adopt([getattr(q.grad, "_local_tensor", q.grad) for q in trainable if q.grad is not None]
                              + (_flat_grads(model) if flat else []), "gradients")
            if flat and t.grad_accum > 1 and p.zero < 3:  # SHARD_GRAD_OP keeps units gathered under no_sync()
                from torch.distributed.fsdp import FullyShardedDataParallel

                tracker.adopt([mod._handle.flat_param._full_param_padded for mod in model.modules()
                               if isinstance(mod, FullyShardedDataParallel) and mod._handle is not None
                               and mod._handle.flat_param._full_param_padded.untyped_storage().size()],
                              "weights/gathered")
            tracker.adopt(list(inputs.values()), "activations/inputs")
            if t.fp8_all_gather:  # each fp8-gathered weight keeps its last gather's scale into the next step
                tracker.adopt(_float8_gather_scales(model), "overhead/communication")
            t1 = time.perf_counter()
            follow = _follow_fsdp1_resizes(tracker) if flat else _follow_resizes(tracker)
            with tracker, _module_context(model, tracker), follow:
                tracker.mark("forward")
                loss = model(**inputs).loss
                tracker.mark("backward")
                loss.backward()
                grads = {tracker.index_of(getattr(q.grad, "_local_tensor", q.grad)) for q in trainable
                         if q.grad is not None}
                if flat:
                    grads |= {tracker.index_of(g) for g in _flat_grads(model)}
                tracker.mark("optimizer")
                if opt is not None:
                    opt.step()
                tracker.mark("zero")
                if opt is not None:
                    opt.zero_grad(set_to_none=True)
                else:
                    for q in trainable:
                        q.grad = None
                del loss
            tracker.close()
            timing["step_s"] = time.perf_counter() - t1
        for idx in grads:  # the reduce-scatter output is the sharded gradient
            if idx is not None:
                tracker.records[idx].category = ""
        _categorize(tracker, grads)
        n_params = sum(q.numel() for q in model.parameters())
        n_trainable = sum(q.numel() for q in trainable)
        return StepTrace(tracker, m, t, device, n_params, n_trainable, timing)
    finally:
        dist.destroy_process_group()


def _gloo_rank(rank: int, m: ModelSpec, t: TrainingSpec, p: ParallelSpec, init_method: str, out: Any) -> None:
    from .step import summarize

    torch.manual_seed(0)
    s = summarize(run_fsdp_step(m, t, p, rank=rank, device="cpu", init_method=init_method), timeline_points=0)
    out.put((rank, {k: s[k] for k in ("peak", "peak_phase", "detail")}))


def spawn_ranks(target: Callable[..., None], args_for_rank: Callable[[int, str], tuple[Any, ...]], world: int,
                timeout_s: float = 600) -> list[Any]:
    """Run ``target(*args_for_rank(rank, init_method), out)`` in `world` spawned processes; each rank's result.

    ``init_method`` is ``tcp://127.0.0.1:<a free port>`` (the loopback interface only) and ``out`` a
    queue on which every rank puts one ``(rank, result)``; the results come back ordered by rank. The
    parent waits at most `timeout_s` seconds for each result (``queue.Empty`` past it), then joins
    every process for up to 30 s and kills those still alive, whether or not all results came."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:  # a free port on the loopback interface only
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    init_method = f"tcp://127.0.0.1:{port}"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_for_rank(r, init_method), out)) for r in range(world)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    try:
        for _ in procs:
            rank, res = out.get(timeout=timeout_s)
            results[rank] = res
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return [results[r] for r in sorted(results)]


def measure_fsdp_gloo(m: ModelSpec, t: TrainingSpec, p: ParallelSpec, timeout_s: float = 600) -> list[dict[str, Any]]:
    """Run one real FSDP2 step in ``p.dp`` CPU processes talking gloo on 127.0.0.1; every rank's summary.

    The same step as `run_fsdp_step` with real tensors and real collectives: it checks that the
    one-process fake-process-group measurement is what each rank of a real job holds."""
    return spawn_ranks(_gloo_rank, lambda r, init_method: (r, m, t, p, init_method), p.dp, timeout_s)
