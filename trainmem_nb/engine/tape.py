"""A symbolic autograd: tensors are sizes, ops record what PyTorch saves and allocates.

The estimator runs a model's forward once on symbolic tensors. Each op allocates its outputs, keeps
(holds a reference to) what PyTorch's autograd saves for its backward, and records a backward rule
that allocates the gradients PyTorch's derivative formula allocates. `Graph.backward` then replays the
backward the way the autograd engine does (nodes in reverse creation order; for each node: its
gradient allocations, then shape reductions, then the incoming gradient and the saved tensors are
released, then gradients are accumulated out of place). Every allocation and free becomes an event,
so live memory at every point of the step follows from reference counting, exactly as in PyTorch.

Sizes are linear forms in the batch shape so one symbolic run serves every micro-batch and sequence
length: a tensor holds ``c0 + c_s*s + c_bs*b*s + c_bss*b*s*s`` elements (`Sz`). Only the standard
library is used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

__all__ = ["Graph", "Sz", "T", "const", "per_seq", "per_token", "per_token_sq"]


class Sz(NamedTuple):
    """Elements of a tensor: ``c0 + b_*b + s_*s + bs*b*s + ss*s*s + bss*b*s*s``."""

    c0: float = 0
    s_: float = 0
    bs: float = 0
    bss: float = 0
    b_: float = 0
    ss: float = 0

    def __mul__(self, k: object) -> Sz:
        if not isinstance(k, (int, float)):
            return NotImplemented
        c0, s_, bs, bss, b_, ss = self
        return _new_sz(Sz, (c0 * k, s_ * k, bs * k, bss * k, b_ * k, ss * k))  # hot in compiling: skip __new__'s defaults

    def __rmul__(self, k: object) -> Sz:
        return self.__mul__(k)  # replaced by __mul__ itself below: no extra call at run time

    def __add__(self, o: object) -> Sz:
        if not isinstance(o, Sz):
            return NotImplemented
        return Sz(self.c0 + o.c0, self.s_ + o.s_, self.bs + o.bs, self.bss + o.bss, self.b_ + o.b_, self.ss + o.ss)

    def key(self) -> tuple[float, ...]:
        """Order by growth: b*s*s terms dominate, then s*s, then b*s, then s, then b, then constants."""
        return (self.bss, self.ss, self.bs, self.s_, self.b_, self.c0)

    def at(self, b: int, s: int) -> float:
        """Elements (or bytes, for a byte form) at batch `b` and sequence length `s`."""
        return self.c0 + self.b_ * b + self.s_ * s + self.bs * b * s + self.ss * s * s + self.bss * b * s * s


# `__rmul__ = __mul__` in the class body is what we mean, but mypy accepts only fields and methods in a
# NamedTuple body (the assignment there made it see a 7th field "__rmul__"), so bind it here instead.
Sz.__rmul__ = Sz.__mul__  # type: ignore[method-assign]
_new_sz = tuple.__new__


def const(n: float) -> Sz:
    """A tensor whose size does not depend on the batch (parameters)."""
    return Sz(c0=n)


def per_token(n: float) -> Sz:
    """``(b, s, n)`` elements."""
    return Sz(bs=n)


def per_seq(n: float) -> Sz:
    """``(s, n)`` elements (shared by the batch, e.g. rotary cos/sin)."""
    return Sz(s_=n)


def per_token_sq(n: float) -> Sz:
    """``(b, n, s, s)`` elements (attention scores)."""
    return Sz(bss=n)


class T:
    """A symbolic tensor: element count, bytes per element, reference count and provenance."""

    __slots__ = ("base", "born", "chain", "dt", "final_grad", "fp8_scale", "freed", "grad", "is_grad", "is_param",
                 "label", "n", "nf4", "phase", "refs", "region", "rg", "stream", "uses", "wcopy")

    def __init__(self, n: Sz, dt: int, label: str, rg: bool, region: str, phase: str) -> None:
        self.n = n
        self.dt = dt
        self.label = label
        self.rg = rg  # requires grad
        self.refs = 1
        self.region = region
        self.phase = phase  # phase it was born in
        self.is_param = False
        self.uses = 0  # number of backward edges into a parameter (AccumulateGrad waits for all)
        self.grad: T | None = None  # pending gradient (input buffer) during backward
        self.wcopy = False  # an autocast copy of a parameter
        self.is_grad = False  # ended up as a parameter's .grad
        self.born = -1
        self.freed = -1
        self.base: T | None = None  # a view shares its base's storage and keeps it alive
        self.chain = False  # a layer's output (or its input's gradient): passed to the next layer
        self.final_grad: T | None = None  # a parameter's .grad once backward has produced it
        self.nf4 = 0  # an NF4-quantized weight (QLoRA): bytes per element of its compute dtype
        #: a weight FSDP2 all-gathered in fp8 (torchao's float8 all-gather): the scale it came with
        self.fp8_scale: T | None = None
        #: the CUDA stream it is allocated on (0: the default stream; an engine's communication streams are
        #: numbered by it): the caching allocator keeps each stream's blocks in pools of their own
        self.stream = 0

    @property
    def bytes(self) -> Sz:
        """Bytes of this tensor as a size form."""
        return self.n * self.dt

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"T({self.label}, {self.n}, dt={self.dt}, refs={self.refs})"


Backward = Callable[["Graph", Sequence["T | None"]], Sequence["T | None"]]


class Node:
    """One autograd node: its inputs, outputs, saved tensors and backward rule."""

    __slots__ = ("backward", "checkpoint", "ins", "label", "n_saved", "outs", "region", "saved")

    def __init__(self, label: str, ins: Sequence[T], outs: Sequence[T], saved: Sequence[T], backward: Backward,
                 region: str) -> None:
        self.label = label
        self.ins = tuple(ins)
        self.outs = tuple(outs)
        self.saved = tuple(saved)
        self.n_saved = 0  # tensors packed into checkpoint holders instead of saved
        self.backward = backward
        self.region = region
        self.checkpoint: object | None = None  # the checkpointed region this node belongs to


class Graph:
    """Records events (allocations and frees) and autograd nodes of one symbolic step.

    ``region`` (embeddings, layers, head) and ``phase`` (forward, backward, optimizer) label what is
    allocated; ``saving`` is False inside a checkpointed forward (nothing is kept for backward);
    ``recomputing`` marks allocations made while a checkpointed layer re-runs in backward.
    """

    def __init__(self) -> None:
        self.events: list[tuple[T, int]] = []
        self.nodes: list[Node] = []
        self.marks: dict[str, int] = {}
        self.region = "embeddings"
        self.phase = "forward"
        self.saving = True
        self.recomputing = False
        self.node_marks: dict[str, int] = {}
        self.checkpoint: object | None = None  # set while a checkpointed region runs its forward
        self._refill: list[Node] = []  # recomputation: nodes whose saved slots are being re-made
        self._stopped = False  # recomputation stopped early: further work is not executed
        self._final_refill = False  # the stop came from input saves packed before the kernel ran
        self.input_leaves: list[T] = []  # non-parameter leaves made to require grad (their grad is dropped)
        self.grads_exist = False  # gradient accumulation: .grad is already set, new grads are added in place
        self.sac_store: list[tuple[T, ...]] | None = None  # selective checkpointing: forward cache
        self.sac_replay: list[tuple[T, ...]] | None = None  # selective checkpointing: recompute reads it
        #: which op outputs selective checkpointing saves: "all" (every matmul and attention output) or
        #: "op" (torchtitan: attention outputs and every other ``mm``, counted per layer and per pass)
        self.sac_policy = "all"
        self.sac_mm_count = 0  # ``mm`` ops seen in this layer's forward (or in its recomputation)
        #: bitsandbytes < 0.43.2: ``MatMul4Bit`` keeps its input as a ctx attribute (`ops.linear_4bit`), and the
        #: inputs so kept, alive until the graph goes (the driver releases them at the end of backward)
        self.bnb_saves_input = False
        self.bnb_kept: list[T] = []
        #: torch < 1.11: ``softmax`` and ``log_softmax`` keep their input for backward as well as their result
        #: (their derivatives passed ``self`` to ``_softmax_backward_data``: pytorch/pytorch#64000)
        self.softmax_saves_input = False
        #: QLoRA under Lightning Fabric: the NF4 quantization state is fp16, so ``dequantize_4bit`` makes an fp16
        #: weight that ``MatMul4Bit`` copies to the compute dtype (`ops.linear_4bit`)
        self.bnb_fp16_state = False
        #: Megatron's gradient_accumulation_fusion: a linear's weight-gradient matmul adds into the parameter's
        #: fp32 ``main_grad`` (an engine buffer), so the node makes no weight gradient (`ops.linear`)
        self.wgrad_fused = False
        #: each FSDP unit's parameters, in the order of the model's weights (engines that gather per unit)
        self.unit_params: dict[str, list[T]] = {}
        #: how many of the root's parameters come before the layers' in the model's order (the embeddings)
        self.root_before_layers = 0
        #: the units of the repeated period (`trainmem_nb.step.layers.LayerPlan.block`), whose events the program
        #: repeats for every layer: a tensor an engine makes once cannot be made inside them
        self.repeated_units: frozenset[str] = frozenset()
        self.repeats = 0  #: how many layers' worth of events those units' events stand for
        #: set by an engine that made a tensor where the repeated units begin though it belongs a few layers in
        #: (`trainmem_nb.engine.program.Program.approximated`)
        self.approximated = False
        #: a run of same-size scalar temporaries may be one event of their blocks (the folded program, whose
        #: peak bytes it keeps; never the unrolled one, whose every malloc the caching allocator replays)
        self.merge_scalar_chains = False
        #: the CUDA stream new tensors are allocated on (`T.stream`; an engine sets it around its collectives)
        self.stream = 0
        #: called in backward with each parameter once the last node that uses it has run (its module's backward
        #: is done; its gradient, if it gets one, made): an engine that gathers parameters module by module
        #: releases it there (DeepSpeed ZeRO-3)
        self.param_released: Callable[[T], None] | None = None

    # -- memory --------------------------------------------------------------------------------
    @contextmanager
    def on_stream(self, stream: int) -> Iterator[None]:
        """New tensors inside are allocated on CUDA stream `stream` (`T.stream`), as under ``torch.cuda.stream``."""
        before, self.stream = self.stream, stream
        try:
            yield
        finally:
            self.stream = before

    def alloc(self, n: Sz, dt: int, label: str, rg: bool = False) -> T:
        """A new tensor (one reference, held by the caller)."""
        t = T(n, dt, label, rg, "recomputed" if self.recomputing else self.region, self.phase)
        t.stream = self.stream
        if self._stopped:  # code after an early-stopped recomputation never runs
            t.born = -2
            return t
        t.born = len(self.events)
        self.events.append((t, 1))
        return t

    def hold(self, t: T) -> T:
        """Add a reference (a saved tensor, a second Python name)."""
        t.refs += 1
        return t

    def drop(self, *ts: T | None) -> None:
        """Release references; a tensor whose last reference goes is freed."""
        for t in ts:
            if t is None:
                continue
            t.refs -= 1
            if t.born == -2:
                continue
            if t.refs == 0:
                if t.base is not None:
                    self.drop(t.base)
                    continue
                t.freed = len(self.events)
                self.events.append((t, -1))
            elif t.refs < 0:
                raise AssertionError(f"tensor {t.label} released more often than held")

    def view(self, x: T, label: str = "view", n: Sz | None = None) -> T:
        """A view of `x` (no allocation): it keeps `x` alive until the view is released."""
        v = T(x.n if n is None else n, x.dt, label, x.rg, x.region, self.phase)
        v.base = x.base if x.base is not None else x
        self.hold(v.base)
        return v

    def sac_outputs(self, make: Callable[[], tuple[T, ...]], kind: str = "mm") -> tuple[T, ...]:
        """Outputs of an op that selective checkpointing may save: in the forward the policy's cache
        keeps them (``_CachingTorchDispatchMode``); in the recomputation they are taken from the cache
        instead of being computed again (``_CachedTorchDispatchMode``). `kind` is the aten op family:
        ``mm``, ``attention`` (SDPA kernels) or ``other`` (addmm, bmm, baddbmm, grouped_mm), which the
        "op" policy recomputes."""
        if self.sac_store is None and not (self.sac_replay is not None and self.recomputing):
            return make()
        if self.sac_policy == "op":
            if kind == "mm":
                self.sac_mm_count += 1
            if kind == "other" or (kind == "mm" and self.sac_mm_count % 2 == 0):
                return make()  # PREFER_RECOMPUTE: computed in forward and again in the recomputation
        if self.sac_store is not None:
            outs = make()
            self.sac_store.append(tuple(self.hold(o) for o in outs))
            return outs
        if not self._stopped and self.sac_replay:
            return self.sac_replay.pop(0)
        return make()

    def mark(self, name: str) -> None:
        """Remember the current event index under `name` (segment boundaries)."""
        self.marks[name] = len(self.events)

    # -- autograd ------------------------------------------------------------------------------
    def record(self, label: str, ins: Sequence[T], outs: Sequence[T], saved: Sequence[T | None],
               backward: Backward) -> None:
        """Register an autograd node if any input requires grad; hold its saved tensors."""
        if not any(t.rg for t in ins):
            return
        for t in outs:
            t.rg = True
        if self._stopped and not self._final_refill:
            return
        packed = [t for t in saved if t is not None]
        if self.recomputing:
            # the recomputation's own graph is thrown away; what it saves refills the original nodes
            if self._final_refill:
                self._final_refill = False
                node = self._refill.pop(0)
                node.saved = tuple(self.hold(t) for t in packed)
                return
            if not packed or not self._refill:
                return
            node = self._refill.pop(0)
            node.saved = tuple(self.hold(t) for t in packed)
            if not self._refill:
                # PyTorch raises _StopRecomputationError here (early stop): nothing after this op runs
                # and unwinding frees the recomputation's locals. The recipe keeps running on phantom
                # tensors so that its ``drop`` calls free the real ones, as unwinding would.
                self._stopped = True
            return
        for t in ins:
            if t.is_param and t.rg:
                t.uses += 1
        node = Node(label, ins, outs, [self.hold(t) for t in packed] if self.saving else [], backward, self.region)
        if not self.saving:
            node.n_saved = len(packed)
            node.checkpoint = self.checkpoint
        self.nodes.append(node)

    def before_outputs(self, ins: Sequence[T], saved_inputs: Sequence[T | None]) -> None:
        """Autograd packs an op's saved *inputs* before its kernel runs; if that completes a
        recomputation, it stops before the op's outputs are allocated."""
        if not self.recomputing or self._stopped or len(self._refill) != 1 or not any(t.rg for t in ins):
            return
        if sum(t is not None for t in saved_inputs) == self._refill[0].n_saved:
            self._stopped = True
            self._final_refill = True

    def recompute(self, nodes: list[Node], rerun: Callable[[], None]) -> None:
        """Re-run a checkpointed region's forward so that `nodes` get their saved tensors back,
        stopping as soon as the last one has them (non-reentrant checkpoint with early stop)."""
        self._refill = [n for n in nodes if n.n_saved]
        if not self._refill:
            return
        self.recomputing = True
        rerun()
        self.recomputing = False
        self._stopped = False

    def backward(self, loss: T, seed_dt: int = 4,
                 on_node: Callable[[int], None] | None = None,
                 on_checkpoint: Callable[[object], None] | None = None) -> None:
        """Run the recorded nodes in reverse creation order, as ``loss.backward()`` does."""
        # torch.autograd.backward makes the seed (ones_like(loss)) and holds it until it returns
        seed = self.alloc(const(1), seed_dt, "ones_like")
        loss.grad = self.hold(seed)
        self._count_reachable_uses(loss)
        last_use: dict[int, int] = {}  # parameter -> the node that uses it first (the last to run backward)
        if self.param_released is not None:
            for index in range(len(self.nodes) - 1, -1, -1):
                for t in self.nodes[index].ins:
                    if t.is_param:
                        last_use[id(t)] = index
        for index in range(len(self.nodes) - 1, -1, -1):
            if on_node is not None:
                on_node(index)
            node = self.nodes[index]
            if node.checkpoint is not None and node.n_saved and not node.saved and on_checkpoint is not None:
                on_checkpoint(node.checkpoint)
            grads_out = []
            for o in node.outs:
                grads_out.append(o.grad)
                o.grad = None
            if all(g is None for g in grads_out):
                self.drop(*node.saved)
                self._release_params(node, index, last_use)
                continue
            grads_in = list(node.backward(self, grads_out))
            if node.checkpoint is not None:
                # recomputed tensors are handed to the node at unpack and die when its apply returns
                self.drop(*node.saved)
                node.saved = ()
            # the engine reduces broadcast gradients to their input's shape, then casts them to its dtype,
            # input by input (validate_outputs, torch/csrc/autograd/engine.cpp)
            for i, (inp, g) in enumerate(zip(node.ins, grads_in, strict=True)):
                if g is not None and inp.rg and g.n.key() > inp.n.key():
                    reduced = self.alloc(inp.n, g.dt, f"sum_to {inp.label}")
                    self.drop(g)
                    grads_in[i] = g = reduced
                if g is not None and inp.rg and g.dt != inp.dt:
                    cast = self.alloc(g.n, inp.dt, f"grad cast {inp.label}")
                    self.drop(g)
                    grads_in[i] = cast
            self.drop(*grads_out)
            self.drop(*node.saved)
            node.saved = ()
            frame = node.checkpoint
            if frame is not None and getattr(frame, "first_node", None) is node:
                frame.release(self)  # type: ignore[attr-defined]
            for inp, g in zip(node.ins, grads_in, strict=True):
                if g is None:
                    continue
                if not inp.rg:
                    self.drop(g)
                    continue
                self._accumulate(inp, g)
            self._release_params(node, index, last_use)
        for leaf in self.input_leaves:  # AccumulateGrad of a leaf that is already gone: discarded
            if leaf.grad is not None:
                self.drop(leaf.grad)
                leaf.grad = None
        self.drop(seed)

    def _release_params(self, node: Node, index: int, last_use: dict[int, int]) -> None:
        """`param_released` for each parameter whose last node in backward, `node`, has run."""
        if self.param_released is not None:
            for t in node.ins:
                if t.is_param and last_use.get(id(t)) == index:
                    self.param_released(t)

    def _count_reachable_uses(self, loss: T) -> None:
        """Keep only the parameter uses the loss depends on. The autograd engine runs the nodes
        reachable from the root and a parameter's AccumulateGrad waits for those inputs alone
        (torch/csrc/autograd/engine.cpp, ``compute_dependencies``); a use whose output never reaches
        the loss (a later pipeline stage's embedding lookup, replaced by the previous stage's
        activations while the tied head still trains the same weight) gives no gradient to wait for."""
        reached = {id(loss)}
        for node in reversed(self.nodes):
            if any(id(o) in reached for o in node.outs):
                reached.update(id(t) for t in node.ins if t.rg)
                continue
            for t in node.ins:
                if t.is_param and t.rg:
                    t.uses -= 1

    def _accumulate(self, inp: T, g: T) -> None:
        """Add `g` into `inp`'s input buffer (out of place, as InputBuffer::add does); a parameter's
        buffer becomes its ``.grad`` once all its uses have contributed (AccumulateGrad steals it)."""
        if inp.grad is None:
            inp.grad = g
        else:
            total = self.alloc(inp.grad.n, max(inp.grad.dt, g.dt), f"grad sum {inp.label}")
            self.drop(inp.grad, g)
            inp.grad = total
        if inp.is_param:
            self.param_grad_done(inp)

    def param_grad_done(self, inp: T) -> None:
        """One of parameter `inp`'s uses has given its gradient (into its input buffer, or, with
        `wgrad_fused`, into an engine's buffer inside the node); the buffer becomes its ``.grad`` once
        every use has (AccumulateGrad steals it)."""
        if inp.is_param:
            inp.uses -= 1
            if inp.uses == 0 and inp.grad is not None:
                if self.grads_exist:
                    # AccumulateGrad: `param.grad += new_grad` in place, then the new gradient goes
                    self.drop(inp.grad)
                else:
                    inp.grad.is_grad = True
                    inp.grad.label = f"grad {inp.label}"
                    inp.final_grad = inp.grad
                inp.grad = None  # now owned by the parameter until zero_grad

    # -- leaves --------------------------------------------------------------------------------
    def param(self, n: Sz, dt: int, label: str, trainable: bool = True) -> T:
        """A parameter that exists before the step (not an allocation of the step)."""
        t = T(n, dt, label, trainable, "weights", "init")
        t.is_param = True
        return t

    def external(self, n: Sz, dt: int, label: str) -> T:
        """A tensor allocated before this part of the program (no event; freed when dropped)."""
        t = T(n, dt, label, False, self.region, "init")
        return t
