"""One training step as a program of allocations and frees, and its peak.

`compile_step` runs a family recipe on symbolic tensors for two transformer layers (the first layer
and a generic one), backward through them, then the optimizer step. The generic layer's events repeat
``n_layers - 1`` times; since every repetition adds the same bytes, the peak over repetitions is at
the first or the last one, so evaluating a step costs the same for 2 layers or 200. The compiled
program depends on the model and the training options but not on the batch shape; `evaluate` turns it
into bytes for one (micro_batch, seq_len) in well under a millisecond.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from typing import Any, NamedTuple

from . import ops
from .activations import recipe_for
from .breakdown import DETAIL_KEYS, TOP_KEYS
from .device import CUBLAS_WORKSPACE_BYTES, CUDA_BLOCK_BYTES, Calibration
from .optimizers import optimizer_program, paged_state_bytes, state_bytes
from .parallelism import ParallelSpec
from .params import buffer_inventory, on_stage, quantized, weight_tensors
from .specs import Checkpointing, Device, Method, ModelSpec, OptimizerName, Precision, TrainingSpec
from .tape import Graph, Sz, T, const, per_token

__all__ = [
    "Program", "Segment", "TimelinePoint", "compile_step", "evaluate", "program_key", "reserved_and_total", "simulate",
    "timeline",
]

CAT_INDEX = {k: i for i, k in enumerate(DETAIL_KEYS)}


class Segment(NamedTuple):
    """Events of one part of the step, repeated `repeat` times (a layer's events repeat)."""

    phase: str  # forward | backward | optimizer | zero
    label: str
    repeat: int
    events: tuple[tuple[int, int, Sz, str], ...]  # (category index, +k alloc / -k free of k tensors, bytes, label)
    fast: tuple[tuple[int, float, int], ...] = ()  # per event: (monomial index or -1, coefficient, sign)
    general: tuple[int, ...] = ()  # events whose size has several terms (computed in full)
    #: the segment's net effect per category: (category, monomial index, coefficient, summed sign) of its
    #: one-term events (an alloc and its free inside the segment cancel out), for `_breakdown_at`
    net: tuple[tuple[int, int, float, int], ...] = ()
    sizes_of: tuple[tuple[int, float], ...] = ()  # the distinct one-term sizes (monomial index, coefficient)
    which: tuple[tuple[int, int], ...] = ()  # per event: (index into sizes_of, sign)


def _segment(phase: str, label: str, repeat: int, events: tuple[tuple[int, int, Sz, str], ...]) -> Segment:
    """A segment with its events' sizes precompiled for `evaluate`."""
    fast = tuple((*_terms(sz), sign) for _c, sign, sz, _l in events)
    net: dict[tuple[int, int, float], int] = {}
    for (cat, _sign, _sz, _l), (i, c, k) in zip(events, fast, strict=True):
        if i >= 0:
            net[(cat, i, c)] = net.get((cat, i, c), 0) + k
    distinct: dict[tuple[int, float], int] = {}
    which = tuple((distinct.setdefault((max(i, 0), c), len(distinct)), k) for i, c, k in fast)
    return Segment(phase, label, repeat, events, fast, tuple(j for j, f in enumerate(fast) if f[0] < 0),
                   tuple((cat, i, c, k) for (cat, i, c), k in net.items() if k), tuple(distinct), which)


@dataclass(frozen=True)
class Program:
    """A compiled step: what is alive before it (by category) and its segments."""

    init: tuple[tuple[int, Sz, int], ...]  # (category index, bytes of one tensor, count)
    segments: tuple[Segment, ...]
    n_params: int
    n_trainable: int


def _round(nbytes: float) -> int:
    n = round(nbytes)
    return -(-n // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES if n > 0 else 0


def _category(t: T, fwd_end: int) -> str:
    if t.region == "communication":
        return "overhead/communication"
    if t.region == "gathered":
        return "weights/gathered"
    if t.phase == "forward":
        if 0 <= t.freed < fwd_end:
            return "transient/forward"
        if t.wcopy:
            return "activations/weight_copies"
        return f"activations/{t.region}"
    if t.phase == "backward":
        if t.is_grad:
            return "gradients"
        if t.region == "recomputed":
            return "activations/recomputed"
        return "transient/backward"
    if t.phase == "optimizer":
        return "transient/optimizer"
    return "transient/forward"


class EngineHooks:
    """What a parallel engine adds around the single-device step (see `trainmem_nb.distributed`).

    The driver calls these at unit boundaries (the root module and each transformer layer), in
    forward and backward; the default does nothing (one GPU)."""

    autocast: bool = True  # does the recipe run under autocast (FSDP's mixed precision does not)
    #: with gradient accumulation, do later micro-steps add into existing full-size ``.grad`` tensors
    #: (FSDP instead accumulates into sharded gradients; its unsharded ones are new each micro-step)
    local_grads_accumulate: bool = True
    #: pipeline parallelism: does this rank run the embeddings (first stage) / the head and loss (last)
    first_stage: bool = True
    last_stage: bool = True
    #: fp16-mixed: does the training loop scale the loss with torch's ``GradScaler`` (DeepSpeed and
    #: Megatron bring their own loss scalers)
    grad_scaler: bool = True

    def weight_dtype(self, t: TrainingSpec, dt: int) -> int:
        """Bytes per element of the weights the layers compute with."""
        return dt

    def init(self, m: ModelSpec, t: TrainingSpec, weights: list[Any]) -> list[tuple[str, Sz, int]] | None:
        """Replace what is alive before the step for weights, states and gradients (None: unchanged)."""
        return None

    def unit_forward_begin(self, g: Graph, unit: str) -> None: ...
    def unit_forward_end(self, g: Graph, unit: str) -> None: ...
    def unit_backward_begin(self, g: Graph, unit: str) -> None: ...
    def unit_backward_end(self, g: Graph, unit: str, grads: list[T]) -> None: ...

    def optimizer(self, m: ModelSpec, t: TrainingSpec) -> list[Segment] | None:
        """Replace the optimizer and zero_grad segments (None: the single-device ones)."""
        return None


_SINGLE = EngineHooks()


def compile_step(m: ModelSpec, t: TrainingSpec, hooks: EngineHooks = _SINGLE,
                 workspace_bytes: int | None = None) -> Program:
    """The step's program for `m` and `t` (the batch shape in `t` is ignored: sizes stay symbolic);
    `hooks` adds a parallel engine's buffers and sharding (hashable: part of the cache key);
    `workspace_bytes`, a calibration's cuBLAS workspaces (None: `CUBLAS_WORKSPACE_BYTES`). Cached:
    every spelling of the same arguments shares one entry."""
    workspace = CUBLAS_WORKSPACE_BYTES["default"] if workspace_bytes is None else workspace_bytes
    return _compile_step(m, t, hooks, workspace)


@lru_cache(maxsize=1024)
def _compile_step(m: ModelSpec, t: TrainingSpec, hooks: EngineHooks, workspace_bytes: int) -> Program:
    mixed = t.mixed and hooks.autocast
    ctx = ops.Ctx(autocast=2 if mixed else None, device=t.device.value, batch1=t.micro_batch == 1)
    g = Graph()
    g.sac_policy = "op" if t.checkpointing is Checkpointing.SELECTIVE_OP else "all"
    all_weights = weight_tensors(m, t)
    weights = [w for w in all_weights if on_stage(w[0], m, hooks.first_stage, hooks.last_stage)]
    held = {id(w[0]) for w in weights}
    # simulate the first layer, a generic middle one (repeated n_layers - 2 times) and the last: every
    # tensor passed between layers (outputs, gradients, an engine's lingering buffers) then has a
    # predecessor and a successor in the repeated layer, in forward and in backward
    n_layers = m.n_layers
    n_sim = min(n_layers, 3)
    layer_params: list[dict[str, T]] = [{} for _ in range(n_sim)]
    other: dict[str, T] = {}
    unit_params: dict[str, list[T]] = {"root": [], **{f"L{i}": [] for i in range(n_sim)}}
    for p, dt, trainable in all_weights:
        dt = hooks.weight_dtype(t, dt)
        if id(p) not in held:  # on another pipeline stage: the recipe may name it, nothing trains it
            other[p.name] = g.param(const(p.numel), dt, p.name, False)
        elif p.in_layer:
            short = p.name[len("layers."):]
            for i in range(n_sim):
                layer_params[i][short] = g.param(const(p.numel), dt, f"L{i}.{short}", trainable)
                if t.method is Method.QLORA and quantized(p):
                    layer_params[i][short].nf4 = 4 if t.precision is Precision.FP32 else 2
                unit_params[f"L{i}"].append(layer_params[i][short])
        else:
            other[p.name] = g.param(const(p.numel), dt, p.name, trainable)
            unit_params["root"].append(other[p.name])
    recipe = recipe_for(m, t, ctx)
    # with gradient accumulation the costliest micro-step is a later one: every .grad exists from its
    # start and new gradients are added in place (HF Trainer zeroes them only after optimizer.step())
    g.grads_exist = t.grad_accum > 1 and hooks.local_grads_accumulate
    ids = g.external(per_token(1), 8, "input_ids")
    ids.region = "inputs"

    g.phase = "forward"
    g.region = "embeddings"
    hooks.unit_forward_begin(g, "root")
    embeds, shared = recipe.embed(g, ids, other)
    if not hooks.first_stage:
        # a later pipeline stage receives the previous stage's output instead of embedding tokens
        # (the recipe still builds the positions and masks every stage computes for itself)
        received = g.alloc(embeds.n, embeds.dt, "activations from the previous stage", rg=True)
        g.drop(embeds)
        embeds = received
        g.input_leaves.append(embeds)
    if t.method is not Method.FULL and t.checkpointing is not Checkpointing.NONE:
        # PEFT wraps a model whose gradient checkpointing is on with `enable_input_require_grads()`: a
        # forward hook makes the embedding output require grad so gradients reach checkpointed layers
        embeds.rg = True
        g.input_leaves.append(embeds)
    # `hidden_states = inputs_embeds`: the model keeps `inputs_embeds` until it returns; a recipe whose
    # embedding output is a temporary no model local names (a sum with position embeddings, a dropout)
    # sets `embed_output_kept = False` and hands its reference to the first layer instead
    kept = getattr(recipe, "embed_output_kept", True) or not hooks.first_stage
    x = g.hold(embeds) if kept else embeds
    node_marks = []
    layer_inputs: list[T] = []
    layer_outputs: list[T] = []
    checkpointed = t.checkpointing is not Checkpointing.NONE
    for i in range(n_sim):
        g.region = "layers"
        g.mark(f"L{i}_fwd_start")
        node_marks.append(len(g.nodes))
        hooks.unit_forward_begin(g, f"L{i}")
        if checkpointed:
            y = _checkpointed_layer(g, ctx, recipe, x, shared, layer_params[i],
                                    selective=t.checkpointing in (Checkpointing.SELECTIVE, Checkpointing.SELECTIVE_OP))
        else:
            y = recipe.layer(g, x, shared, layer_params[i])
        y.chain = True
        layer_inputs.append(x)
        layer_outputs.append(y)
        g.drop(x)
        x = y
        hooks.unit_forward_end(g, f"L{i}")
        g.mark(f"L{i}_fwd_end")
    g.region = "head"
    head_node = len(g.nodes)
    if hooks.last_stage:
        h = recipe.final_norm(g, x, other)
        g.drop(x)
    else:
        h = x  # sent to the next stage; its gradient comes back in backward
    # the base model returns: its locals (inputs_embeds, position ids, mask, cos/sin) go
    for sh in (*shared.extra, embeds if kept else None, shared.mask, shared.cos, shared.sin):
        if sh is not None:
            g.drop(sh)
    if hooks.last_stage:
        loss, logits = recipe.lm_head_loss(g, h, ids, other)
    else:
        loss, logits = _send_to_next_stage(g, h), None
    g.drop(h)  # *ForCausalLM returns: the base output (holding h) goes
    if ctx.autocast is not None:
        ops.end_autocast(g, ctx)
    g.drop(logits)  # the caller keeps only `.loss` of the output
    hooks.unit_forward_end(g, "root")
    g.mark("fwd_end")
    fwd_end = len(g.events)

    g.phase = "backward"
    g.region = "backward"
    # a region's backward ends when backward reaches the node before the region's first one (regions
    # without nodes end where the next one does)
    starts: list[tuple[int, str]] = [(head_node, "head_bwd_end")]
    starts += [(nm, f"L{i}_bwd_end") for i, nm in reversed(list(enumerate(node_marks)))]

    unit_order = {"head_bwd_end": f"L{n_sim - 1}", **{f"L{i}_bwd_end": (f"L{i - 1}" if i else None) for i in range(n_sim)}}
    ended = {"head_bwd_end": None, **{f"L{i}_bwd_end": f"L{i}" for i in range(n_sim)}}
    mid = 1 if n_sim == 3 else None  # the repeated layer

    def on_node(index: int) -> None:
        for first, name in starts:
            if index <= first - 1 and name not in g.marks:
                unit = ended[name]
                if unit is not None:
                    hooks.unit_backward_end(g, unit, [p.final_grad for p in unit_params[unit] if p.final_grad])
                g.mark(name)
                if mid is not None and name == f"L{mid}_bwd_end" and (below := layer_inputs[mid].grad) is not None:
                    below.chain = True  # the gradient handed to the layer below
                nxt = unit_order[name]
                if nxt is not None:
                    hooks.unit_backward_begin(g, nxt)

    def on_checkpoint(frame: object) -> None:
        assert isinstance(frame, _Frame)
        frame.recompute(g, ctx, recipe)

    if not loss.rg:
        from .specs import SpecError

        raise SpecError("nothing is trained: no parameter requires a gradient (check method and lora_targets)")
    scaler = t.precision is Precision.FP16_MIXED and hooks.grad_scaler
    if scaler:
        # GradScaler's state: ``_scale`` (fp32) and ``_growth_tracker`` (int32), 0-dim tensors kept
        # between steps (torch/amp/grad_scaler.py); ``scaler.scale(loss)`` is ``loss * _scale``, a new
        # 0-dim tensor the loop keeps until the step ends, whose backward makes the loss's gradient
        scale = g.external(const(1), 4, "GradScaler _scale")
        g.external(const(1), 4, "GradScaler _growth_tracker")
    g.mark("bwd_start")
    hooks.unit_backward_begin(g, "root")
    if scaler:
        loss = ops.mul(g, loss, scale, "GradScaler.scale(loss)")
    g.backward(loss, seed_dt=4, on_node=on_node, on_checkpoint=on_checkpoint)
    for _first, name in starts:
        if name not in g.marks:
            on_node(-1)
    hooks.unit_backward_end(g, "root", [p.final_grad for p in unit_params["root"] if p.final_grad])
    g.mark("bwd_end")
    # the training loop keeps `loss` until after the optimizer step: it is not freed here

    g.phase = "optimizer"
    opt_events = hooks.optimizer(m, t)
    if opt_events is None:
        opt_events = optimizer_program(m, t)
    if scaler and t.optimizer is not OptimizerName.NONE:  # no optimizer: the loop skips unscale_/update
        opt_events = _grad_scaler_steps(opt_events)
    g.mark("opt_end")

    # -- segments ---------------------------------------------------------------------------
    mk = g.marks
    reps = n_layers - 2
    # a tensor born in the repeated layer but freed elsewhere (e.g. an autocast weight copy freed
    # when autocast exits) is freed once per repeated layer; what is passed between layers (outputs,
    # input gradients, lingering buffers: `chain`) is the exception, each layer freeing its predecessor's
    repeated = [(mk["L1_fwd_start"], mk["L1_fwd_end"]), (mk["L2_bwd_end"], mk["L1_bwd_end"])] if mid else []

    def evs(a: int, b: int) -> tuple[tuple[int, int, Sz, str], ...]:
        out = []
        inside = any(lo == a and hi == b for lo, hi in repeated)
        for tt, sign in g.events[a:b]:
            k = sign
            if sign < 0 and not inside and not tt.chain and any(lo <= tt.born < hi for lo, hi in repeated):
                k = -reps
            out.append((CAT_INDEX[_category(tt, fwd_end)], k, tt.bytes, tt.label))
        return tuple(out)

    segs: list[Segment] = []
    segs.append(_segment("forward", "embeddings", 1, evs(0, mk["L0_fwd_start"])))
    segs.append(_segment("forward", "layer 0", 1, evs(mk["L0_fwd_start"], mk["L0_fwd_end"])))
    if mid:
        segs.append(_segment("forward", "layers", reps, evs(mk["L1_fwd_start"], mk["L1_fwd_end"])))
    if n_sim > 1:
        last = n_sim - 1
        segs.append(_segment("forward", f"layer {n_layers - 1}", 1, evs(mk[f"L{last}_fwd_start"], mk[f"L{last}_fwd_end"])))
    segs.append(_segment("forward", "head and loss", 1, evs(mk[f"L{n_sim - 1}_fwd_end"], mk["fwd_end"])))
    segs.append(_segment("backward", "loss and head", 1, evs(mk["bwd_start"], mk["head_bwd_end"])))
    prev = "head_bwd_end"
    for i in reversed(range(n_sim)):
        label = "layers" if i == mid else f"layer {0 if i == 0 else n_layers - 1}"
        segs.append(_segment("backward", label, reps if i == mid else 1, evs(mk[prev], mk[f"L{i}_bwd_end"])))
        prev = f"L{i}_bwd_end"
    segs.append(_segment("backward", "embeddings", 1, evs(mk["L0_bwd_end"], mk["bwd_end"])))
    segs.extend(opt_events)

    # -- what is alive before the step --------------------------------------------------------
    init: list[tuple[int, Sz, int]] = []
    engine_init = hooks.init(m, t, weights)
    if engine_init is None:
        for p, dt, _ in weights:
            init.append((CAT_INDEX["weights/params"], const(p.numel * dt), p.count))
        if not t.first_step:
            for nbytes, count in state_bytes(m, t):
                init.append((CAT_INDEX["optimizer_states"], nbytes, count))
        if t.grad_accum > 1:
            for p, dt, trainable in weights:
                if trainable:
                    init.append((CAT_INDEX["gradients"], const(p.numel * dt), p.count))
    else:
        init += [(CAT_INDEX[cat], sz, count) for cat, sz, count in engine_init]
    for _name, buf_bytes, count in buffer_inventory(m):
        init.append((CAT_INDEX["weights/buffers"], const(buf_bytes), count))
    init.append((CAT_INDEX["activations/inputs"], per_token(8), 1))
    if scaler:
        init.append((CAT_INDEX["optimizer_states"], const(4), 2))  # GradScaler's _scale and _growth_tracker
    if t.device is Device.CUDA:
        init.append((CAT_INDEX["overhead/workspaces"], const(workspace_bytes), 1))
    n_params = sum(p.numel * p.count for p, _, _ in weights)
    n_train = sum(p.numel * p.count for p, _, trainable in weights if trainable)
    return Program(tuple(init), tuple(segs), n_params, n_train)


def _grad_scaler_steps(opt: list[Segment]) -> list[Segment]:
    """GradScaler around the optimizer step (torch/amp/grad_scaler.py), as measured: ``unscale_``
    makes ``inv_scale = _scale.double().reciprocal().float()`` and ``found_inf = torch.full((), 0.)``,
    replicates both to the gradients' device (``_MultiDeviceReplicator``) and keeps only ``inv_scale``
    in the optimizer's state until ``update()`` resets it, after ``step`` and before ``zero_grad``."""
    temp = CAT_INDEX["transient/optimizer"]
    f64, f32 = const(8), const(4)
    unscale = _segment("optimizer", "GradScaler.unscale_", 1, (
        (temp, 1, f64, "_scale.double()"), (temp, 1, f64, "reciprocal"), (temp, -1, f64, "_scale.double() freed"),
        (temp, 1, f32, "inv_scale"), (temp, -1, f64, "reciprocal freed"), (temp, 1, f32, "found_inf"),
        (temp, 2, f32, "per-device copies"), (temp, -2, f32, "per-device copies freed"),
        (temp, -1, f32, "found_inf freed")))
    update = _segment("optimizer", "GradScaler.update", 1, ((temp, -1, f32, "inv_scale freed"),))
    # after what finishes backward (FSDP's deferred reduce-scatter under pipelining), before the step
    start = next((i for i, seg in enumerate(opt) if seg.phase != "backward"), len(opt))
    zero = next((i for i, seg in enumerate(opt) if seg.phase == "zero"), len(opt))
    return [*opt[:start], unscale, *opt[start:zero], update, *opt[zero:]]


def _send_to_next_stage(g: Graph, out: T) -> T:
    """A pipeline stage's output goes to the next stage; backward starts from the gradient the next
    stage sends back (one tensor of the output's size), not from a loss."""
    sent = g.alloc(const(0), 4, "stage output sent")  # a marker: the output itself is what goes

    def backward(g: Graph, grads: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(out.n, out.dt, "gradient from the next stage")]

    g.record("send to next stage", [out], [sent], [], backward)
    return sent


class _Frame:
    """One checkpointed layer call (``torch.utils.checkpoint`` without reentrant autograd)."""

    def __init__(self, x: T, shared: object, params: dict[str, T]) -> None:
        self.x = x
        self.shared = shared
        self.params = params
        self.first_node: object = None  # its earliest node with packed tensors
        self.held: list[T] = []
        self.sac: list[tuple[T, ...]] | None = None  # selective checkpointing's cache of op outputs

    def release(self, g: Graph) -> None:
        """The frame dies with its last saved-tensor hooks: its input, keyword tensors and whatever
        the selective-checkpointing cache still holds go."""
        g.drop(*self.held)
        self.held = []
        for outs in self.sac or ():
            g.drop(*outs)
        self.sac = None

    def recompute(self, g: Graph, ctx: ops.Ctx, recipe: object) -> None:
        """Re-run the layer's forward (with its own autocast region) to refill its nodes."""
        nodes = [n for n in g.nodes if n.checkpoint is self]
        outer = dict(ctx.wcache)
        ctx.wcache.clear()

        def rerun() -> None:
            y = recipe.layer(g, self.x, self.shared, self.params)  # type: ignore[attr-defined]
            g.drop(y)
            if ctx.autocast is not None:
                ops.end_autocast(g, ctx)

        g.sac_replay = self.sac
        g.sac_mm_count = 0
        g.recompute(nodes, rerun)
        g.sac_replay = None
        ctx.wcache.update(outer)


def _checkpointed_layer(g: Graph, ctx: ops.Ctx, recipe: object, x: T, shared: object, params: dict[str, T],
                        selective: bool = False) -> T:
    """A layer under non-reentrant checkpointing: ``_NoopSaveInputs`` saves the layer input, the
    layer's ops pack holders instead of saving, and backward recomputes the layer."""
    frame = _Frame(x, shared, params)
    dummy = g.external(const(0), 4, "checkpoint dummy")
    dummy.rg = True

    # _NoopSaveInputs saves the layer input; the frame keeps the layer's keyword tensors (cos/sin,
    # position ids, mask) through the recompute function's closure. Both live as long as the frame,
    # which dies with the hooks of its earliest saving node, late in the layer's backward.
    kw = [s for s in (*shared.extra, shared.mask, shared.cos, shared.sin) if s is not None]  # type: ignore[attr-defined]
    frame.held = [g.hold(x), *(g.hold(s) for s in kw)]
    first = len(g.nodes)
    g.saving = False
    g.checkpoint = frame
    if selective:
        frame.sac = []
        g.sac_store = frame.sac
        g.sac_mm_count = 0
    y = recipe.layer(g, x, shared, params)  # type: ignore[attr-defined]
    g.sac_store = None
    g.saving = True
    g.checkpoint = None
    frame.first_node = next((n for n in g.nodes[first:] if n.n_saved), None)
    _ = dummy
    return y


class Evaluation(NamedTuple):
    """Bytes of a compiled program for one batch shape."""

    peak: int
    peak_phase: str
    peak_at: str
    detail: dict[str, int]
    phase_peaks: dict[str, int]


# The size forms' monomials, in the order of `_terms`: 1, b, s, b*s, s*s, b*s*s.
_FIELDS = ("c0", "b_", "s_", "bs", "ss", "bss")


def _terms(sz: Sz) -> tuple[int, float]:
    """An event's size as (monomial index, coefficient) when it has one term, else (-1, 0)."""
    hit = _TERMS.get(sz)
    if hit is None:
        nz = [(i, c) for i, c in enumerate((sz.c0, sz.b_, sz.s_, sz.bs, sz.ss, sz.bss)) if c]
        if len(nz) == 1:
            coef = nz[0][1]
            hit = nz[0][0], int(coef) if float(coef).is_integer() else coef
        else:
            hit = (-1, 0) if nz else (0, 0)
        if len(_TERMS) < 1 << 16:  # sizes recur across layers and programs; bound the memo all the same
            _TERMS[sz] = hit
    return hit


_TERMS: dict[Sz, tuple[int, float]] = {}


def _sizes(seg: Segment, b: int, s: int, mono: tuple[int, ...]) -> list[float]:
    """Signed, 512-B-rounded bytes of each event at (b, s)."""
    vals = [-(-(c * mono[i]) // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES for i, c in seg.sizes_of]
    out = [k * vals[u] for u, k in seg.which]
    for j in seg.general:
        out[j] = seg.fast[j][2] * _round(seg.events[j][2].at(b, s))
    return out


def evaluate(prog: Program, micro_batch: int, seq_len: int) -> Evaluation:
    """The peak of `prog` for one batch shape, with its category breakdown and phase."""
    b, s = micro_batch, seq_len
    mono = (1, b, s, b * s, s * s, b * s * s)
    init = _init_bytes(prog, b, s)
    total: float = sum(init)
    best, best_where = total, (-1, 0, 0)  # (segment index, event index, repetitions before)
    phase_peaks: dict[str, float] = {}
    all_sizes: list[list[float]] = []
    for si, seg in enumerate(prog.segments):
        n = seg.repeat
        sizes = _sizes(seg, b, s, mono) if n > 0 and seg.events else []
        all_sizes.append(sizes)
        if not sizes:
            continue
        run = list(accumulate(sizes))
        net = run[-1]
        pmax = max(run)
        if pmax > 0:
            reps_before = (n - 1) if net > 0 else 0
            cand = total + reps_before * net + pmax
            phase_peaks[seg.phase] = max(phase_peaks.get(seg.phase, 0), cand)
            if cand > best:
                best, best_where = cand, (si, run.index(pmax), reps_before)
        total += net * n
    detail = _breakdown_at(prog, init, all_sizes, *best_where, mono)
    si, ei, reps = best_where
    if si < 0:
        phase, where = "forward", "start of step"
    else:
        seg = prog.segments[si]
        rep = "" if seg.repeat == 1 else f" ({'last' if reps else 'first'} of {seg.repeat})"
        phase, where = seg.phase, f"{seg.label}{rep}: {seg.events[ei][3]}"
    return Evaluation(int(best), phase, where, detail, {k: int(v) for k, v in phase_peaks.items()})


def _init_bytes(prog: Program, b: int, s: int) -> list[int]:
    """Bytes per detailed category alive before the step."""
    cats = [0] * len(DETAIL_KEYS)
    for cat, sz, count in prog.init:
        cats[cat] += (_round(sz.c0) if sz.c0 == sz.at(b, s) else _round(sz.at(b, s))) * count
    return cats


def _breakdown_at(prog: Program, init: list[int], all_sizes: list[list[float]], si: int, ei: int,
                  reps: int, mono: tuple[int, ...]) -> dict[str, int]:
    """Bytes per detailed category just after event `ei` of segment `si` (repeated `reps` times before)."""
    cats: list[float] = list(init)
    for j, seg in enumerate(prog.segments):
        if si < 0 or j > si:
            break
        sizes = all_sizes[j]
        times = seg.repeat if j < si else reps
        if times and sizes:
            for cat, i, c, k in seg.net:
                cats[cat] += k * -(-(c * mono[i]) // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES * times
            for e in seg.general:
                cats[seg.events[e][0]] += sizes[e] * times
        if j == si:
            for (cat, _, _, _), d in zip(seg.events[: ei + 1], sizes[: ei + 1], strict=True):
                cats[cat] += d
    return {DETAIL_KEYS[i]: int(v) for i, v in enumerate(cats) if v}


compile_step.cache_clear = _compile_step.cache_clear  # type: ignore[attr-defined]
compile_step.cache_info = _compile_step.cache_info  # type: ignore[attr-defined]


def program_key(t: TrainingSpec, m: ModelSpec | None = None) -> TrainingSpec:
    """The part of `t` that shapes the step program: the batch shape stays symbolic, except whether
    there is one sequence or several; gradient accumulation only matters as "more than one step";
    and, for a model `m` with a sliding attention window, whether ``seq_len >= sliding_window`` (then
    transformers gives SDPA an explicit mask: `trainmem_nb.families.mistral`)."""
    window = m.sliding_window if m is not None else 0
    seq = window if window and t.seq_len >= window else 1
    # model_copy skips validation: the values come from a validated spec
    return t.model_copy(update={"micro_batch": 1 if t.micro_batch == 1 else 2, "seq_len": seq,
                                "grad_accum": min(t.grad_accum, 2)})


def reserved_and_total(t: TrainingSpec, peak: int, churn: int, calibration: Calibration | None,
                       unified: int = 0) -> tuple[int, int]:
    """The caching allocator's reserved bytes and the device total (nvidia-smi) for an allocated peak.

    ``churn`` is the activation and temporary bytes at the peak: memory that is freed and reused within
    a step, where cached blocks and fragmentation come from; ``unified``, CUDA unified memory outside the
    allocator (a paged optimizer's states, `paged_state_bytes`), which nvidia-smi counts while resident.
    CPU: both equal the peak."""
    if t.device is not Device.CUDA:
        return peak, peak
    from .device import CUDA_CONTEXT_BYTES, LARGE_SEGMENT_BYTES, RESERVED_CHURN_FRACTION

    frac = calibration.reserved_churn_fraction if calibration else RESERVED_CHURN_FRACTION
    context = calibration.cuda_context_bytes if calibration else CUDA_CONTEXT_BYTES
    reserved = -(-int(peak + frac * churn) // LARGE_SEGMENT_BYTES) * LARGE_SEGMENT_BYTES
    return reserved, reserved + context + unified


def simulate(m: ModelSpec, t: TrainingSpec, calibration: Calibration | None = None,
             parallel: ParallelSpec | None = None) -> object:
    """`estimate()`'s engine: compile (cached), evaluate, add the device's reserved and context bytes."""
    from .estimate import MemoryEstimate

    if parallel is not None and not parallel.single_device:
        from .distributed import simulate_parallel

        return simulate_parallel(m, t, parallel, calibration)

    prog = compile_step(m, program_key(t, m), _SINGLE, calibration.workspace_bytes if calibration else None)
    ev = evaluate(prog, t.micro_batch, t.seq_len)
    tops = dict.fromkeys(TOP_KEYS, 0)
    for k, v in ev.detail.items():
        tops[k.split("/")[0]] += v
    paged = paged_state_bytes(m, t) if t.device is Device.CUDA else 0
    reserved, total = reserved_and_total(t, ev.peak, tops["activations"] + tops["transient"], calibration, paged)
    overhead = {}
    if t.device is Device.CUDA:
        overhead = {"allocator_cache": reserved - ev.peak, "cuda_context": total - reserved - paged}
        if paged:  # unified memory: outside the allocator, on the device while it has room
            overhead["paged_optimizer_states"] = paged
    from .distributed import RankMemory

    only = RankMemory("the only device (rank 0)", 0, m.n_layers, ev.peak, reserved, total, ev.peak_phase, ev.peak_at,
                      tops, dict(ev.detail), 0)
    return MemoryEstimate(
        model=m, training=t, n_params=prog.n_params, n_trainable_params=prog.n_trainable,
        peak_allocated_bytes=ev.peak, peak_reserved_bytes=reserved, device_total_bytes=total,
        peak_phase=ev.peak_phase, peak_at=ev.peak_at, detail_bytes=ev.detail,
        phase_peaks_bytes=ev.phase_peaks, overhead_bytes=overhead, calibration=calibration, program=prog,
        parallel=parallel or ParallelSpec(), per_rank=(only,),
    )


class TimelinePoint(NamedTuple):
    """Live memory after one operation of the step."""

    step: int  #: position in the step (operations since its start)
    phase: str  #: forward | backward | optimizer | zero
    label: str  #: what was just allocated or freed
    total_bytes: int
    by_category: tuple[int, ...]  #: bytes per `trainmem_nb.breakdown.TOP_KEYS` entry


def timeline(prog: Program, micro_batch: int, seq_len: int, max_points: int = 1500) -> list[TimelinePoint]:
    """Live bytes through the step. Repeated layers are drawn in full for the first and last one and
    as their start and peak in between, so a 126-layer model costs about as much as a 2-layer one;
    the result is thinned to `max_points`, keeping each bucket's highest point (the peak survives)."""
    b, s = micro_batch, seq_len
    top_of = [TOP_KEYS.index(k.split("/")[0]) for k in DETAIL_KEYS]
    cats = [0] * len(TOP_KEYS)
    for cat, sz, count in prog.init:
        cats[top_of[cat]] += _round(sz.at(b, s)) * count
    points = [TimelinePoint(0, "forward", "start of step", sum(cats), tuple(cats))]
    step = 0
    for seg in prog.segments:
        deltas = [(top_of[cat], sign * _round(sz.at(b, s)), label) for cat, sign, sz, label in seg.events]
        n = seg.repeat
        # every repetition of a repeated layer changes memory the same way: its highest point is at the
        # same event, offset by what the earlier repetitions left (found once, not per repetition)
        running, best_i, best_run = 0, -1, 0
        net = [0] * len(TOP_KEYS)
        best_net: list[int] = list(net)
        for i, (top, d, _label) in enumerate(deltas):
            running += d
            net[top] += d
            if best_i < 0 or running > best_run:
                best_i, best_run, best_net = i, running, list(net)
        for rep in range(n):
            if rep in (0, n - 1):
                total = sum(cats)
                prefix = f"{seg.label}: "
                for top, d, label in deltas:
                    cats[top] += d
                    total += d
                    step += 1
                    points.append(TimelinePoint(step, seg.phase, prefix + label, total, tuple(cats)))
                continue
            if best_i >= 0:
                at = tuple(c + d for c, d in zip(cats, best_net, strict=True))
                points.append(TimelinePoint(step + best_i + 1, seg.phase,
                                            f"{seg.label} ({rep + 1} of {n}): {deltas[best_i][2]}", sum(at), at))
            cats = [c + d for c, d in zip(cats, net, strict=True)]
            step += len(deltas)
            points.append(TimelinePoint(step, seg.phase, f"{seg.label} ({rep + 1} of {n}) done", sum(cats), tuple(cats)))
    if len(points) <= max_points:
        return points
    size = -(-len(points) // max_points)
    return [max(points[i:i + size], key=lambda p: p.total_bytes) for i in range(0, len(points), size)]


def activations_at_forward_end(prog: Program, micro_batch: int, seq_len: int) -> int:
    """Bytes of activations alive when the forward pass ends: what is kept for backward (saved
    tensors, autocast weight copies, the loss path) plus the inputs."""
    b, s = micro_batch, seq_len
    mono = (1, b, s, b * s, s * s, b * s * s)
    acts = {i for i, k in enumerate(DETAIL_KEYS) if k.startswith("activations/")}
    total: float = sum(_round(sz.at(b, s)) * count for cat, sz, count in prog.init if cat in acts)
    for seg in prog.segments:
        if seg.phase != "forward":
            break
        for (cat, _, _, _), d in zip(seg.events, _sizes(seg, b, s, mono), strict=True):
            if cat in acts:
                total += d * seg.repeat
    return int(total)
