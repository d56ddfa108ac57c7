"""The command-line options the developer scripts share: a small model shape and a training step
(``--set key=value`` for training options, ``--mset key=value`` for model fields). The scripts run as
``python scripts/<name>.py``, so this folder is on ``sys.path``."""

from __future__ import annotations

import argparse

from trainmem_nb.model.presets import get_model
from trainmem_nb.model.spec import ModelSpec
from trainmem_nb.spec.training import TrainingSpec


def add_step_args(ap: argparse.ArgumentParser, layers: int = 3, ffn: int = 768, batch: int = 2) -> None:
    """``--model`` or a shape (``--family --layers --hidden --heads --kv-heads --ffn --vocab``), the batch
    shape (``--batch --seq``) and ``--set`` / ``--mset`` overrides."""
    ap.add_argument("--model", help="a preset instead of the shape options")
    ap.add_argument("--family", default="llama")
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=0)
    ap.add_argument("--ffn", type=int, default=ffn)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--set", action="append", default=[], help="training option key=value")
    ap.add_argument("--mset", action="append", default=[], help="model field key=value")


def step_from_args(a: argparse.Namespace) -> tuple[ModelSpec, TrainingSpec]:
    """The model and training step the options name (the training step's device defaults to cpu)."""
    if a.model:
        m = get_model(a.model)
    else:
        kw = dict(family=a.family, n_layers=a.layers, hidden=a.hidden, n_heads=a.heads, n_kv_heads=a.kv_heads,
                  ffn=a.ffn, vocab=a.vocab, max_positions=max(4096, a.seq))
        kw.update({k: _value(v) for k, v in (s.split("=", 1) for s in a.mset)})
        m = ModelSpec.model_validate(kw)
    opts = {k: _value(v) for k, v in (s.split("=", 1) for s in a.set)}
    opts.setdefault("device", "cpu")
    return m, TrainingSpec.model_validate({"micro_batch": a.batch, "seq_len": a.seq, **opts})


def _value(text: str) -> object:
    """A command-line value as the JSON number, boolean or list it spells, else the text itself (the
    specs take no numeric strings)."""
    import json

    try:
        return json.loads(text)
    except ValueError:
        return text
