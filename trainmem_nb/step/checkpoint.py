"""Activation checkpointing of one layer as ``torch.utils.checkpoint`` runs it (non-reentrant, with
early stop), and selective checkpointing's cache of op outputs.
"""

from __future__ import annotations

from ..engine import ops
from ..engine.tape import Graph, T, const
from ..model.layers import LayerKind
from ..recipes.base import Recipe, Shared


class _Frame:
    """One checkpointed layer call (``torch.utils.checkpoint`` without reentrant autograd)."""

    def __init__(self, x: T, shared: Shared, params: dict[str, T], kind: LayerKind) -> None:
        self.x = x
        self.shared = shared
        self.params = params
        self.kind = kind
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

    def recompute(self, g: Graph, ctx: ops.Ctx, recipe: Recipe) -> None:
        """Re-run the layer's forward (with its own autocast region) to refill its nodes."""
        nodes = [n for n in g.nodes if n.checkpoint is self]
        outer = dict(ctx.wcache)
        ctx.wcache.clear()

        def rerun() -> None:
            y = recipe.layer(g, self.x, self.shared, self.params, self.kind)
            g.drop(y)
            if ctx.autocast is not None:
                ops.end_autocast(g, ctx)

        g.sac_replay = self.sac
        g.sac_mm_count = 0
        g.recompute(nodes, rerun)
        g.sac_replay = None
        ctx.wcache.update(outer)


def _checkpointed_layer(g: Graph, ctx: ops.Ctx, recipe: Recipe, x: T, shared: Shared, params: dict[str, T],
                        kind: LayerKind, selective: bool = False) -> T:
    """A layer under non-reentrant checkpointing: ``_NoopSaveInputs`` saves the layer input, the
    layer's ops pack holders instead of saving, and backward recomputes the layer."""
    frame = _Frame(x, shared, params, kind)
    dummy = g.external(const(0), 4, "checkpoint dummy")
    dummy.rg = True

    # _NoopSaveInputs saves the layer input; the frame keeps the layer's keyword tensors (cos/sin,
    # position ids, mask) through the recompute function's closure. Both live as long as the frame,
    # which dies with the hooks of its earliest saving node, late in the layer's backward.
    frame.held = [g.hold(x), *(g.hold(s) for s in shared.layer_inputs(kind))]
    first = len(g.nodes)
    g.saving = False
    g.checkpoint = frame
    if selective:
        frame.sac = []
        g.sac_store = frame.sac
        g.sac_mm_count = 0
    y = recipe.layer(g, x, shared, params, kind)
    g.sac_store = None
    g.saving = True
    g.checkpoint = None
    frame.first_node = next((n for n in g.nodes[first:] if n.n_saved), None)
    _ = dummy
    return y
