"""Collectives inside a step's forward: expert parallelism's all-to-all token exchange.

Modelled from torchtitan's ``AllToAllTokenDispatcher`` (torchtitan/models/common/token_dispatcher.py):
``all_to_all_single`` of ``torch.distributed._functional_collectives`` under autograd saves nothing and
its backward is the reverse all-to-all of the incoming gradient (a new tensor the size of its input).
With balanced routing a rank receives as many (token, expert) rows as it sends.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..tape import Graph, Sz, T

__all__ = ["all_to_all", "index_put_new"]


def all_to_all(g: Graph, x: T, label: str, out_n: Sz | None = None) -> T:
    """``all_to_all_single(x, output_splits, input_splits, group)``: a new (received) tensor, nothing
    saved; backward exchanges the gradient back into a new tensor of the input's size."""
    out = g.alloc(x.n if out_n is None else out_n, x.dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(x.n, x.dt, f"{label} backward")]

    g.record(label, [x], [out], [], bwd)
    return out


def index_put_new(g: Graph, x: T, idx: T, label: str) -> T:
    """``out = x.new_empty(shape); out[idx, :] = x`` (torchtitan's ``_unpermute``): one new tensor; the
    in-place ``index_put_`` saves the indices; backward gathers the gradient's rows (``grad[idx]``, a
    new tensor)."""
    out = g.alloc(x.n, x.dt, label)

    def bwd(g: Graph, go: Sequence[T | None]) -> list[T | None]:
        return [g.alloc(x.n, x.dt, f"{label} backward gather"), None]

    g.record(label, [x, idx], [out], [idx], bwd)
    return out
