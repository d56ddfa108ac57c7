"""The step driver: one training step of a model as a `Program` of allocations and frees.

`compile_step` runs a family recipe on symbolic tensors for the first layer, a generic one and the last
(a generic layer's events repeat ``n_layers - 2`` times), backward through them, then the optimizer
step. Engines (`EngineHooks`) add their buffers and sharding at unit boundaries.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from ..device import CUBLAS_HANDLES_PER_STEP, CUBLAS_WORKSPACE_BYTES
from ..engine import ops
from ..engine.program import CAT_INDEX, Program, Segment, _segment
from ..engine.tape import Graph, Sz, T, const, per_token
from ..model.families import describe
from ..model.params import buffer_inventory, idle_tensors, idle_weights, on_stage, quantized, weight_tensors
from ..model.spec import ModelSpec
from ..recipes.head import (
    LITGPT_CHUNK,
    fabric_convert_output,
    litgpt_chunked_cross_entropy,
    litgpt_chunks,
    litgpt_cut_last,
    litgpt_head_chunks,
    torchtune_rows_symbolic,
)
from ..recipes.registry import recipe_for, runs_loss
from ..spec.choices import AdafactorImpl, Checkpointing, Device, Fp8Recipe, LossImpl, Method, OptimizerName, Precision
from ..spec.training import TrainingSpec
from .checkpoint import _checkpointed_layer, _Frame
from .layers import in_layer_of, layer_plan
from .optimizers import optimizer_program, state_bytes

__all__ = ['compile_step', 'program_key']


def _category(t: T, fwd_end: int) -> str:
    if t.region == "communication":
        return "overhead/communication"
    if t.region == "gathered":
        return "weights/gathered"
    if t.phase == "init" and t.is_grad:  # a gradient alive before the step, freed in it (`Graph.external`)
        return "gradients"
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
    """What a parallel engine adds around the single-device step (see `trainmem_nb.parallel`).

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
    #: FSDP1 with ``use_orig_params=True``: a unit whose FlatParameter trains any parameter computes a
    #: gradient for every parameter in it (they are views of one tensor that requires grad)
    flat_unit_grads: bool = False
    #: whose fp8 linears the engine runs (`trainmem_nb.engine.ops.Ctx.fp8_kernels`): torchao's, or Transformer Engine's
    fp8_kernels: str = "torchao"
    #: the causal-LM loss the engine computes itself (`trainmem_nb.recipes.head.causal_lm_loss`'s variants):
    #: "" for the training's (transformers' by its version)
    causal_lm_loss: str = ""
    #: Megatron's gradient_accumulation_fusion: linears add their weight gradients into the engine's fp32 buffer
    #: (`trainmem_nb.engine.tape.Graph.wgrad_fused`)
    wgrad_fused: bool = False
    #: does `init` lay out the idle weights (`trainmem_nb.model.params.idle_weights`, given to it frozen after
    #: the step's own) as the engine shards them, rather than whole on the rank (FSDP2's root group holds them)
    shards_idle: bool = False

    def weight_dtype(self, t: TrainingSpec, dt: int) -> int:
        """Bytes per element of the weights the layers compute with."""
        return dt

    def buffer_dtype(self, t: TrainingSpec) -> int | None:
        """Bytes per element of the model's floating buffers where they differ from the weights the layers
        compute with (`weight_dtype`); None where they do not."""
        return None

    def init(self, m: ModelSpec, t: TrainingSpec, weights: list[Any]) -> list[tuple[str, Sz, int]] | None:
        """Replace what is alive before the step for weights, states and gradients (None: unchanged)."""
        return None

    def loading(self, m: ModelSpec, t: TrainingSpec) -> tuple[tuple[int, ...], int] | None:
        """How the engine loads the model where it differs from a rank loading its share of it
        (`trainmem_nb.step.load.loading_events`): the loading trace and its peak bytes, for the step's key
        `t` (`program_key`); None: its share."""
        return None

    def unit_forward_begin(self, g: Graph, unit: str) -> None: ...
    def unit_forward_end(self, g: Graph, unit: str) -> None: ...
    def unit_backward_begin(self, g: Graph, unit: str, prefetch: str | None = None) -> None: ...
    def unit_backward_end(self, g: Graph, unit: str, grads: list[T]) -> None: ...

    def head_begin(self, g: Graph) -> None:
        """The base model has returned (its final norm applied); the head runs next."""

    def optimizer(self, m: ModelSpec, t: TrainingSpec) -> list[Segment] | None:
        """Replace the optimizer and zero_grad segments (None: the single-device ones)."""
        return None


_SINGLE = EngineHooks()


def compile_step(m: ModelSpec, t: TrainingSpec, hooks: EngineHooks = _SINGLE,
                 workspace_bytes: int | None = None, unrolled: bool = False) -> Program:
    """The step's program for `m` and `t` (the batch shape in `t` is ignored: sizes stay symbolic);
    `hooks` adds a parallel engine's buffers and sharding (hashable: part of the cache key);
    `workspace_bytes`, a calibration's cuBLAS workspaces (None: `CUBLAS_WORKSPACE_BYTES`, one per handle); `unrolled`
    runs every layer instead of repeating one period of the layer pattern (same bytes, slower: the
    check of the repetition argument). Cached: every spelling of the same arguments shares one entry."""
    if workspace_bytes in (None, CUBLAS_WORKSPACE_BYTES["default"]):  # one per cuBLAS handle: forward's, backward's
        workspace = (CUBLAS_WORKSPACE_BYTES["default"] // CUBLAS_HANDLES_PER_STEP, CUBLAS_HANDLES_PER_STEP)
    else:
        workspace = (workspace_bytes, 1)
    return _compile_step(m, t, hooks, workspace, unrolled)


@lru_cache(maxsize=1024)
def _compile_step(m: ModelSpec, t: TrainingSpec, hooks: EngineHooks, workspace: tuple[int, int],
                  unrolled: bool = False) -> Program:
    mixed = t.mixed and hooks.autocast
    ctx = ops.Ctx(autocast=2 if mixed else None, device=t.device.value, batch1=t.micro_batch == 1,
                  causal_lm_loss=hooks.causal_lm_loss or t.causal_lm_loss.value, fp8=None if t.fp8 is Fp8Recipe.NONE else t.fp8.value,
                  buffer_dt=hooks.buffer_dtype(t), fp8_kernels=hooks.fp8_kernels)
    if hooks.fp8_kernels == "te" and t.fp8 is not Fp8Recipe.NONE:
        d = describe(m.family)
        ctx.te_fused = {module: group[-1] for module, group in d.fused_group.items()}
        # Megatron has the attention's output projection save its original input under any recipe but delayed
        # scaling (megatron/core/transformer/attention.py:428-444, ``set_save_original_input(self.linear_proj)``)
        ctx.te_original_input = d.attention_output if t.fp8 is not Fp8Recipe.DELAYED else ""
    g = Graph()
    g.sac_policy = "op" if t.checkpointing is Checkpointing.SELECTIVE_OP else "all"
    g.bnb_saves_input = t.bnb_saves_input
    g.softmax_saves_input = t.softmax_saves_input
    g.bnb_fp16_state = t.bnb_fp16_state
    g.wgrad_fused = hooks.wgrad_fused
    all_weights = weight_tensors(m, t)
    weights = [w for w in all_weights if on_stage(w[0], m, hooks.first_stage, hooks.last_stage)]
    held = {id(w[0]) for w in weights}
    # the layers the step runs: the prefix, the first, a generic middle and the last period of the
    # repeating layer pattern, the suffix (a uniform stack: its first, a middle and its last layer).
    # Every tensor passed between layers (outputs, gradients, an engine's lingering buffers) then has a
    # predecessor and a successor in the repeated period, in forward and in backward
    plan = layer_plan(m, unrolled)
    n_sim = len(plan.kinds)
    units = plan.units
    layer_params: list[dict[str, T]] = [{} for _ in range(n_sim)]
    other: dict[str, T] = {}
    unit_params: dict[str, list[T]] = {"root": [], **{u: [] for u in units}}
    trains: set[str] = set()  # units holding a trained parameter (FSDP1's FlatParameter requires grad)
    if hooks.flat_unit_grads:
        for p, _dt, trainable in weights:
            if trainable:
                trains.update([units[i] for i, kind in enumerate(plan.kinds) if in_layer_of(p, kind)]
                              if p.in_layer else ["root"])
    for p, dt, trainable in all_weights:
        dt = hooks.weight_dtype(t, dt)
        if id(p) not in held:  # on another pipeline stage: the recipe may name it, nothing trains it
            other[p.name] = g.param(const(p.numel), dt, p.name, False)
        elif p.in_layer:
            if not g.root_before_layers and not any(unit_params[u] for u in units):
                g.root_before_layers = len(unit_params["root"])
            short = p.name[len("layers."):]
            for i, kind in enumerate(plan.kinds):
                if not in_layer_of(p, kind):
                    continue
                layer_params[i][short] = g.param(const(p.numel), dt, f"L{i}.{short}", trainable or units[i] in trains)
                if t.method is Method.QLORA and quantized(p):
                    layer_params[i][short].nf4 = 4 if t.precision is Precision.FP32 else 2
                unit_params[units[i]].append(layer_params[i][short])
        else:
            other[p.name] = g.param(const(p.numel), dt, p.name, trainable or "root" in trains)
            if t.method is Method.QLORA and quantized(p, t.qlora_head):  # the head, where the stack quantizes it
                other[p.name].nf4 = 4 if t.precision is Precision.FP32 else 2
            unit_params["root"].append(other[p.name])
    g.unit_params = unit_params
    g.repeated_units, g.repeats = frozenset(units[plan.block[0]:plan.block[1]]), plan.reps
    g.merge_scalar_chains = not unrolled
    recipe = recipe_for(m, t, ctx)
    # with gradient accumulation the costliest micro-step is a later one: every .grad exists from its
    # start and new gradients are added in place (HF Trainer zeroes them only after optimizer.step());
    # so with zero_grad(set_to_none=False), which zeroes them in place and keeps them (`grads_persist`)
    g.grads_exist = t.grads_persist and hooks.local_grads_accumulate
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
    for i, kind in enumerate(plan.kinds):
        g.region = "layers"
        g.mark(f"L{i}_fwd_start")
        node_marks.append(len(g.nodes))
        hooks.unit_forward_begin(g, units[i])
        if checkpointed:
            y = _checkpointed_layer(g, ctx, recipe, x, shared, layer_params[i], kind,
                                    selective=t.checkpointing in (Checkpointing.SELECTIVE, Checkpointing.SELECTIVE_OP))
        else:
            y = recipe.layer(g, x, shared, layer_params[i], kind)
        y.chain = True
        layer_inputs.append(x)
        layer_outputs.append(y)
        g.drop(x)
        x = y
        hooks.unit_forward_end(g, units[i])
        g.mark(f"L{i}_fwd_end")
    g.region = "head"
    head_node = len(g.nodes)
    if hooks.last_stage:
        h = recipe.final_norm(g, x, other)
        g.drop(x)
    else:
        h = x  # sent to the next stage; its gradient comes back in backward
    # the base model returns: its locals (inputs_embeds, position ids, masks, cos/sin) go
    for sh in (*shared.extra, embeds if kept else None, *shared.all_masks(), *shared.rotary_tensors()):
        if sh is not None:
            g.drop(sh)
    hooks.head_begin(g)
    logits: list[T] = []
    if hooks.last_stage and runs_loss(m, t) is LossImpl.LITGPT:
        # lit-gpt's GPT returns its logits in chunks (its hidden state goes); then the loop runs the loss
        logits = litgpt_head_chunks(g, ctx, h, recipe.lm_head_weight(other), m.hidden, m.vocab, t.micro_batch, t.seq_len,
                                    softcap=bool(m.final_softcap))
        g.drop(h)
        # Fabric's forward context (autocast) ends with the model's forward; its output goes to fp32
        if ctx.autocast is not None:
            ops.end_autocast(g, ctx)
        if t.precision is not Precision.FP32:
            logits = fabric_convert_output(g, logits)
        litgpt_cut_last(g, logits, t.seq_len, m.vocab)
        loss = litgpt_chunked_cross_entropy(g, ctx, logits, t.micro_batch, t.seq_len)
    else:
        if hooks.last_stage:
            loss, out = recipe.lm_head_loss(g, h, ids, other)
            logits = [out] if out is not None else []
        else:
            loss = _send_to_next_stage(g, h)
        g.drop(h)  # *ForCausalLM returns: the base output (holding h) goes
        if ctx.autocast is not None:
            ops.end_autocast(g, ctx)
    # the caller keeps only `.loss` of the output; a loop that names the output keeps it until its next
    # forward returns (`loop_keeps_outputs`): this step's logits stay, the last step's go after the forward
    kept_logits = logits if t.loop_keeps_outputs else []
    if not kept_logits:
        g.drop(*logits)
    kept_logits = [x.base if x.base is not None else x for x in kept_logits]  # a view keeps its whole storage
    hooks.unit_forward_end(g, "root")
    g.mark("fwd_end")
    fwd_end = len(g.events)

    g.phase = "backward"
    g.region = "backward"
    # a region's backward ends when backward reaches the node before the region's first one (regions
    # without nodes end where the next one does)
    starts: list[tuple[int, str]] = [(head_node, "head_bwd_end")]
    starts += [(nm, f"L{i}_bwd_end") for i, nm in reversed(list(enumerate(node_marks)))]

    unit_order = {"head_bwd_end": units[-1], **{f"L{i}_bwd_end": (units[i - 1] if i else None) for i in range(n_sim)}}
    ended = {"head_bwd_end": None, **{f"L{i}_bwd_end": units[i] for i in range(n_sim)}}
    prefetch_of = {units[i]: units[i - 1] if i else None for i in range(n_sim)}  # the next unit in backward
    lo, hi = plan.block  # the repeated period: simulated layers lo..hi-1 (lo == hi: none)

    def on_node(index: int) -> None:
        for first, name in starts:
            if index <= first - 1 and name not in g.marks:
                unit = ended[name]
                if unit is not None:
                    hooks.unit_backward_end(g, unit, [p.final_grad for p in unit_params[unit] if p.final_grad])
                g.mark(name)
                if lo < hi and name == f"L{lo}_bwd_end" and (below := layer_inputs[lo].grad) is not None:
                    below.chain = True  # the gradient handed to the layer below the repeated period
                nxt = unit_order[name]
                if nxt is not None:
                    hooks.unit_backward_begin(g, nxt, prefetch_of[nxt])

    def on_checkpoint(frame: object) -> None:
        assert isinstance(frame, _Frame)
        frame.recompute(g, ctx, recipe)

    if not loss.rg:
        from ..errors import SpecError

        raise SpecError("nothing is trained: no parameter requires a gradient (check method and lora_targets)")
    scaler = t.precision is Precision.FP16_MIXED and hooks.grad_scaler
    if scaler:
        # GradScaler's state: ``_scale`` (fp32) and ``_growth_tracker`` (int32), 0-dim tensors kept
        # between steps (torch/amp/grad_scaler.py); ``scaler.scale(loss)`` is ``loss * _scale``, a new
        # 0-dim tensor the loop keeps until the step ends, whose backward makes the loss's gradient
        scale = g.external(const(1), 4, "GradScaler _scale")
        g.external(const(1), 4, "GradScaler _growth_tracker")
    g.mark("bwd_start")
    hooks.unit_backward_begin(g, "root", units[-1] if units else None)
    if scaler:
        loss = ops.mul(g, loss, scale, "GradScaler.scale(loss)")
    g.backward(loss, seed_dt=4, on_node=on_node, on_checkpoint=on_checkpoint)
    for _first, name in starts:
        if name not in g.marks:
            on_node(-1)
    hooks.unit_backward_end(g, "root", [p.final_grad for p in unit_params["root"] if p.final_grad])
    # bitsandbytes < 0.43.2's kept inputs go with the graph: the HF Trainer's `loss` (which holds the graph) is a
    # local of training_step, gone before the optimizer step. A loop that keeps the output (litgpt's `logits`,
    # `loop_keeps_outputs`) keeps the graph, and with it these inputs, until its next forward returns (litgpt
    # finetune/lora.py: `loss` becomes a float when it is logged, `logits` is rebound after the next forward)
    bnb_stale: list[T] = []
    if kept_logits:
        bnb_stale = list({id(b): b for b in (x.base if x.base is not None else x for x in g.bnb_kept)}.values())
    else:
        g.drop(*g.bnb_kept)
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
    reps = plan.reps
    # a tensor born in the repeated period but freed elsewhere (e.g. an autocast weight copy freed
    # when autocast exits) is freed once per repetition; what is passed between layers (outputs,
    # input gradients, lingering buffers: `chain`) is the exception, each layer freeing its predecessor's
    repeated = ([(mk[f"L{lo}_fwd_start"], mk[f"L{hi - 1}_fwd_end"]), (mk[f"L{hi}_bwd_end"], mk[f"L{lo}_bwd_end"])]
                if lo < hi else [])

    tokens: dict[T, int] = {}  # each tensor of the step, numbered for the allocator replay

    def evs(a: int, b: int) -> tuple[tuple[tuple[int, int, Sz, str], ...], tuple[int, ...]]:
        out, toks = [], []
        inside = any(lo == a and hi == b for lo, hi in repeated)
        for tt, sign in g.events[a:b]:
            k = sign
            if sign < 0 and not inside and not tt.chain and any(lo <= tt.born < hi for lo, hi in repeated):
                k = -reps
            out.append((CAT_INDEX[_category(tt, fwd_end)], k, tt.bytes, tt.label))
            toks.append(tokens.setdefault(tt, len(tokens) + 1))
        return tuple(out), tuple(toks)

    segs: list[Segment] = []
    segs.append(_segment("forward", "embeddings", 1, *evs(0, mk["L0_fwd_start"])))
    for i in range(n_sim):
        if lo <= i < hi:
            if i == lo:
                a = mk[f"L{lo}_fwd_start"]
                cuts = tuple(mk[f"L{j}_fwd_start"] - a for j in range(lo + 1, hi))  # the period's layers
                segs.append(_segment("forward", plan.labels[i], reps, *evs(a, mk[f"L{hi - 1}_fwd_end"]), cuts))
            continue
        segs.append(_segment("forward", plan.labels[i], 1, *evs(mk[f"L{i}_fwd_start"], mk[f"L{i}_fwd_end"])))
    segs.append(_segment("forward", "head and loss", 1, *evs(mk[f"L{n_sim - 1}_fwd_end"], mk["fwd_end"])))
    # the last (micro-)step's output, alive until this forward returns (a first step with accumulation is
    # modelled at a later micro-step, which has one before it)
    previous = bool(kept_logits) and (not t.first_step or t.grad_accum > 1)
    # the last step's kept inputs of MatMul4Bit: one per repetition where the repeated layers made them
    stale = [(CAT_INDEX[_category(x, fwd_end)], reps if any(a <= x.born < b for a, b in repeated) else 1, x.bytes)
             for x in bnb_stale]
    if previous:
        segs.append(_segment("forward", "the loop rebinds `outputs`: the last step's logits go", 1,
                             tuple((CAT_INDEX["activations/head"], -1, x.bytes, "the last step's logits")
                                   for x in kept_logits)
                             + tuple((cat, -n, sz, "the last step's MatMul4Bit kept input (its graph)")
                                     for cat, n, sz in stale)))
    segs.append(_segment("backward", "loss and head", 1, *evs(mk["bwd_start"], mk["head_bwd_end"])))
    prev = "head_bwd_end"
    for i in reversed(range(n_sim)):
        if lo <= i < hi:
            if i == hi - 1:
                a = mk[prev]
                cuts = tuple(mk[f"L{j}_bwd_end"] - a for j in range(hi - 1, lo, -1))
                segs.append(_segment("backward", plan.labels[i], reps, *evs(a, mk[f"L{lo}_bwd_end"]), cuts))
                prev = f"L{lo}_bwd_end"
            continue
        segs.append(_segment("backward", plan.labels[i], 1, *evs(mk[prev], mk[f"L{i}_bwd_end"])))
        prev = f"L{i}_bwd_end"
    segs.append(_segment("backward", "embeddings", 1, *evs(mk["L0_bwd_end"], mk["bwd_end"])))
    segs.extend(opt_events)

    # -- what is alive before the step --------------------------------------------------------
    init: list[tuple[int, Sz, int]] = []
    idle = idle_weights(m, t)  # a multimodal checkpoint's vision tower: held, never run
    # an engine that shards the idle weights with the root module's (FSDP2) lays them out itself, frozen:
    # they never get a gradient
    engine_init = hooks.init(m, t, [*weights, *idle_tensors(m, t)] if hooks.shards_idle else weights)
    if engine_init is None:
        for p, dt, _ in weights:
            init.append((CAT_INDEX["weights/params"], const(p.numel * dt), p.count))
        if not t.first_step:
            for nbytes, count in state_bytes(m, t):
                init.append((CAT_INDEX["optimizer_states"], nbytes, count))
        if t.grads_persist:
            for p, dt, trainable in weights:
                if trainable:
                    init.append((CAT_INDEX["gradients"], const(p.numel * dt), p.count))
    else:
        init += [(CAT_INDEX[cat], sz, count) for cat, sz, count in engine_init]
    if not hooks.shards_idle:  # whole on every rank
        init += [(CAT_INDEX["weights/params"], const(p.numel * dt), p.count) for p, dt in idle]
    for _name, buf_bytes, count in buffer_inventory(m):
        init.append((CAT_INDEX["weights/buffers"], const(buf_bytes), count))
    init.append((CAT_INDEX["activations/inputs"], per_token(8), 1))
    if m.num_labels:  # a classifier's labels, one per sequence, are a second input (int64; fp32 to regress)
        init.append((CAT_INDEX["activations/inputs"], Sz(b_=8 if m.num_labels > 1 else 4), 1))
    if previous:
        init += [(CAT_INDEX["activations/head"], x.bytes, 1) for x in kept_logits]
        init += [(cat, sz, n) for cat, n, sz in stale]
    if scaler:
        init.append((CAT_INDEX["optimizer_states"], const(4), 2))  # GradScaler's _scale and _growth_tracker
    if t.device is Device.CUDA:
        init.append((CAT_INDEX["overhead/workspaces"], const(workspace[0]), workspace[1]))
    n_params = sum(p.numel * p.count for p, _, _ in weights) + sum(p.numel * p.count for p, _ in idle)
    n_train = sum(p.numel * p.count for p, _, trainable in weights if trainable)
    chain = frozenset(n for tt, n in tokens.items() if tt.chain)
    streams = tuple((n, tt.stream) for tt, n in tokens.items() if tt.stream)
    return Program(tuple(init), tuple(segs), n_params, n_train, chain, streams, g.approximated)


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


compile_step.cache_clear = _compile_step.cache_clear  # type: ignore[attr-defined]
compile_step.cache_info = _compile_step.cache_info  # type: ignore[attr-defined]


def program_key(t: TrainingSpec, m: ModelSpec | None = None) -> TrainingSpec:
    """The part of `t` that shapes the step program: the batch shape stays symbolic, except whether
    there is one sequence or several; gradient accumulation only matters as "more than one step";
    and, for a model `m` with a sliding attention window, whether ``seq_len >= sliding_window`` (then
    transformers gives SDPA an explicit mask: `trainmem_nb.recipes.mistral`). The allocator's
    configuration shapes only its replay of the step (`trainmem_nb.step.reserved.replay_step`)."""
    window = m.sliding_window if m is not None else 0
    shaped = (window, m.hidden, m.vocab) if m is not None else (0, 0, 0)  # what of `m` the key depends on
    hit = _KEYS.get(id(t))
    if hit is not None and hit[0] is t and hit[1] == shaped:  # one estimate asks up to four times
        return hit[2]
    seq = window if window and t.seq_len >= window else 1
    batch = 1 if t.micro_batch == 1 else 2
    if t.loss_impl is LossImpl.LITGPT:  # lit-gpt's chunks: the first length with as many, on the window's side
        first = LITGPT_CHUNK * (litgpt_chunks(t.seq_len) - 1) + 1
        seq = max(first, window) if window and t.seq_len >= window else first
    elif t.loss_impl is LossImpl.CHUNKED:  # torchtune's rows: a length with the same residue of the tokens
        seq = _same_residue(t, m, batch, window)
    # model_copy skips validation: the values come from a validated spec. Liger's chunk rows and torchtune's
    # where they cannot be symbolic depend on the token count (`recipes.head`): those programs keep the shape.
    shape = ({} if t.loss_impl is LossImpl.LIGER or seq == 0 else {"micro_batch": batch, "seq_len": seq})
    # the stack shapes the program only through the options it sets; the CUDA context is not in it
    update = {**shape, "grad_accum": min(t.grad_accum, 2), "alloc_conf": "", "stack": "", "versions": "",
              "cuda_lazy_loading": True}
    if t.optimizer is not OptimizerName.ADAFACTOR:  # which Adafactor it would be: no part of another optimizer's step
        update["adafactor"] = AdafactorImpl.TORCH
    # one key object per distinct key: a new spec of a new batch shape finds it without copying the spec
    # (every estimate builds its own spec), and the program cache then matches it by identity (a spec's
    # __dict__ holds its fields alone, in their order)
    values = {**t.__dict__, **update}
    sig = tuple(values.values())
    key = _KEY_OBJECTS.get(sig)
    if key is None:
        if len(_KEY_OBJECTS) >= 256:
            _KEY_OBJECTS.clear()
        key = _KEY_OBJECTS[sig] = t.model_copy(update=update)
    if len(_KEYS) >= 64:
        _KEYS.clear()
    _KEYS[id(t)] = (t, shaped, key)  # holding `t` keeps its id from being reused while it is here
    return key


def _same_residue(t: TrainingSpec, m: ModelSpec | None, batch: int, window: int) -> int:
    """A sequence length for torchtune's chunked loss's program key: ``batch x length`` leaves the tokens'
    residue modulo the chunk count, on the same side of the window; 0 where its rows cannot be symbolic
    (`torchtune_rows_symbolic`) or no such length exists (the program then keeps the batch shape)."""
    c = t.loss_chunks
    if m is None or not torchtune_rows_symbolic(m.hidden, c, m.vocab):
        return 0
    r = t.tokens % c
    lo, hi = (window, window + c) if window and t.seq_len >= window else (1, 1 + c)
    for seq in range(lo, hi):
        if (batch * seq) % c == r and (not window or (seq >= window) == (t.seq_len >= window)):
            return seq
    return 0


_KEYS: dict[int, tuple[TrainingSpec, tuple[int, int, int], TrainingSpec]] = {}
_KEY_OBJECTS: dict[tuple[object, ...], TrainingSpec] = {}
