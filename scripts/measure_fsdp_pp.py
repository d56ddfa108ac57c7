"""Measure FSDP2 + pipeline parallelism on CPU: pp stages x dp FSDP ranks, gloo on 127.0.0.1.

Each of ``pp * dp`` processes builds the same small llama (``trainmem_nb.measure.step.build``), keeps
its stage's layers (embeddings on the first stage, final norm, head and loss on the last), shards the
stage with ``fully_shard`` the way torchtitan does under PP (every layer and the stage root,
``reshard_after_forward=False``, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), wraps
it in ``torch.distributed.pipelining.PipelineStage`` and trains with ``Schedule1F1B`` (or GPipe) over
``grad_accum`` micro-batches, then steps AdamW. ``schedule.step`` keeps torch's default
``return_outputs=True``, as torchtitan's train.py does (``--no-return-outputs`` passes False): the
last stage keeps every micro-batch's logits and merges them. One untracked step warms up (pipelining's
metadata inference and receive buffers, FSDP's lazy init, the optimizer states at lr 0); the next whole
step - every micro-batch, the deferred reduce-scatter, the output merge, optimizer step and zero_grad -
runs under `ResizeAwareTracker`, which also follows FSDP's storage resizes. What the warm-up step left
is adopted: the receive buffers (kept for good), their ``.grad`` and the last stage's
``output_chunks`` (both cleared by the next ``step``'s ``clear_runtime_states``). The per-rank peak (512-byte rounded, as the estimator counts) is
compared with ``tm.estimate(..., engine="fsdp", zero=3, gpus=pp*dp, pp=pp, device="cpu")``.

    .venv/bin/python scripts/measure_fsdp_pp.py            # prints a table; --json for machine output
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODEL = dict(family="llama", n_layers=8, hidden=256, n_heads=4, n_kv_heads=2, ffn=768, vocab=1000, max_positions=4096)


def _stage_module(model: Any, lo: int, hi: int, first: bool, last: bool) -> Any:
    from torch import nn

    class Stage(nn.Module):
        """One pipeline stage of a Hugging Face llama: the layers [lo, hi) and the ends it owns."""

        def __init__(self) -> None:
            super().__init__()
            inner = model.model
            self.embed_tokens = inner.embed_tokens if first else None
            self.layers = nn.ModuleList(list(inner.layers)[lo:hi])
            self.norm = inner.norm if last else None
            self.lm_head = model.lm_head if last else None
            self.rotary_emb = inner.rotary_emb

        def forward(self, x: Any) -> Any:
            import torch

            h = self.embed_tokens(x) if self.embed_tokens is not None else x
            pos = torch.arange(h.shape[1], device=h.device)[None]
            pe = self.rotary_emb(h, pos)
            for layer in self.layers:
                out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
                h = out[0] if isinstance(out, tuple) else out
            if self.norm is not None:
                h = self.lm_head(self.norm(h))
            return h

    return Stage()


def _rank(rank: int, a: dict[str, Any], init_method: str, out: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from trainmem_nb.measure.fsdp import ResizeAwareTracker, _follow_resizes
    from trainmem_nb.measure.step import build, make_optimizer
    from trainmem_nb.measure.tracker import cuda_round
    from trainmem_nb.model.spec import ModelSpec
    from trainmem_nb.spec.training import TrainingSpec

    pp, dp, n_mb = a["pp"], a["dp"], a["grad_accum"]
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=pp * dp)
    try:
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
        stage_idx = mesh.get_local_rank("pp")
        m = ModelSpec.model_validate(a["model"])
        t = TrainingSpec.model_validate({"micro_batch": a["micro_batch"], "seq_len": a["seq_len"], "device": "cpu",
                                         "precision": "fp32", "optimizer": "adamw"})
        model, _inputs = build(m, t, "cpu")  # fp32; FSDP's policy casts for compute (no autocast)
        per = m.n_layers // pp
        lo, hi = stage_idx * per, (stage_idx + 1) * per
        first, last = stage_idx == 0, stage_idx == pp - 1
        mod = _stage_module(model, lo, hi, first, last)
        del model
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in mod.layers:
            fully_shard(layer, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=a["reshard"])
        fully_shard(mod, mesh=mesh["dp"], mp_policy=policy, reshard_after_forward=a["reshard"])
        stage = PipelineStage(mod, stage_idx, pp, torch.device("cpu"), group=mesh["pp"].get_group())

        def loss_fn(logits: Any, labels: Any) -> Any:  # transformers' ForCausalLMLoss (fp32 logits)
            from transformers.loss.loss_utils import ForCausalLMLoss

            return ForCausalLMLoss(logits, labels, vocab_size=m.vocab)

        sched_cls = Schedule1F1B if a["schedule"] == "1f1b" else ScheduleGPipe
        sched = sched_cls(stage, n_microbatches=n_mb, loss_fn=loss_fn)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, m.vocab, (a["micro_batch"] * n_mb, a["seq_len"]), generator=gen)
        trainable = [q for q in mod.parameters() if q.requires_grad]
        opt = make_optimizer(t, trainable)
        assert opt is not None

        def step(track: ResizeAwareTracker | None) -> None:
            kw: dict[str, Any] = {} if a.get("return_outputs", True) else {"return_outputs": False}
            if last:
                kw.update(target=ids, losses=[])
            if track is not None:
                track.mark("forward")  # the schedule interleaves forward and backward micro-batches
            # torchtitan drops what step returns (the last stage's merged outputs)
            if first:
                sched.step(ids, **kw)
            else:
                sched.step(**kw)
            if track is not None:
                track.mark("optimizer")
            opt.step()
            if track is not None:
                track.mark("zero")
            opt.zero_grad(set_to_none=True)

        lrs = [g["lr"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"] = 0.0
        step(None)  # warm-up: metadata inference, lazy init, optimizer states
        for g, lr in zip(opt.param_groups, lrs, strict=True):
            g["lr"] = lr
        tracker = ResizeAwareTracker({})
        tracker.adopt([getattr(q, "_local_tensor", q) for q in mod.parameters()], "weights/params", param=True)
        tracker.adopt(list(mod.buffers()), "weights/buffers")
        tracker.adopt([getattr(v, "_local_tensor", v) for s in opt.state.values() for v in s.values()
                       if isinstance(v, torch.Tensor) and v.dim()], "optimizer_states")
        recv = [i.buffer for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values())
                for i in infos if getattr(i, "buffer", None) is not None]
        tracker.adopt(recv, "overhead/communication")
        # left by the warm-up step until the measured step's clear_runtime_states: the stage inputs'
        # gradients (stage_backward accumulates into the receive buffers, leaves) and the kept outputs
        tracker.adopt([i.buffer.grad for infos in stage.args_recv_info.values() for i in infos
                       if getattr(i, "buffer", None) is not None and i.buffer.grad is not None],
                      "overhead/communication")
        tracker.adopt([o for o in stage.output_chunks if isinstance(o, torch.Tensor)], "activations/head")
        tracker.adopt([ids], "activations/inputs")
        with tracker, _follow_resizes(tracker):
            step(tracker)
        tracker.close()
        live, peak, at = 0, -1, 0
        for i, (idx, sign) in enumerate(tracker.events):
            live += sign * cuda_round(tracker.records[idx].nbytes)
            if live > peak:
                peak, at = live, i
        cats: dict[str, int] = {}
        for idx, sign in tracker.events[: at + 1]:
            rec = tracker.records[idx]
            key = rec.category or rec.op
            cats[key] = cats.get(key, 0) + sign * cuda_round(rec.nbytes)
        phase = max((p for p in tracker.phase_starts if p[1] <= at), key=lambda p: p[1], default=("init", 0))[0]
        out.put((rank, {"stage": stage_idx, "peak": peak, "phase": phase,
                        "recv_buffers": sum(cuda_round(b.untyped_storage().nbytes()) for b in recv),
                        "at_peak": {k: v for k, v in sorted(cats.items(), key=lambda kv: -kv[1]) if v}}))
    except Exception as exc:  # report instead of hanging the parent
        import traceback

        out.put((rank, {"error": f"{exc!r}\n{traceback.format_exc()}"}))
        raise
    finally:
        dist.destroy_process_group()


def measure(a: dict[str, Any], timeout_s: float = 600) -> list[dict[str, Any]]:
    """Every rank's measured peak for the layout in `a` (see `main`'s options)."""
    from trainmem_nb.measure.fsdp import spawn_ranks

    return spawn_ranks(_rank, lambda r, init_method: (r, a, init_method), a["pp"] * a["dp"], timeout_s)


def estimate(a: dict[str, Any]) -> Any:
    import trainmem_nb as tm
    from trainmem_nb.model.spec import ModelSpec
    from trainmem_nb.spec.parallel import ParallelSpec
    from trainmem_nb.spec.training import TrainingSpec

    m = ModelSpec.model_validate(a["model"])
    t = TrainingSpec.model_validate({"micro_batch": a["micro_batch"], "seq_len": a["seq_len"], "device": "cpu",
                                     "precision": "bf16-mixed", "optimizer": "adamw", "grad_accum": a["grad_accum"]})
    p = ParallelSpec(gpus=a["pp"] * a["dp"], engine="fsdp", zero=3, pp=a["pp"], pp_schedule=a["schedule"],
                     pp_return_outputs=a.get("return_outputs", True))
    return tm.estimate(m, t, parallel=p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--grad-accum", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    ap.add_argument("--reshard", action="store_true", help="reshard_after_forward=True (torchtitan: False under PP)")
    ap.add_argument("--no-return-outputs", action="store_true",
                    help="schedule.step(return_outputs=False) (default: torch's True, which torchtitan keeps)")
    ap.add_argument("--hidden", type=int, default=MODEL["hidden"], help="hidden size (heads of 64, ffn 3x hidden)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    model = dict(MODEL, hidden=args.hidden, n_heads=args.hidden // 64, n_kv_heads=args.hidden // 128,
                 ffn=3 * args.hidden)
    a = dict(model=model, return_outputs=not args.no_return_outputs, pp=args.pp, dp=args.dp, grad_accum=args.grad_accum, micro_batch=args.micro_batch,
             seq_len=args.seq_len, schedule=args.schedule, reshard=args.reshard)
    ranks = measure(a)
    est = estimate(a)
    rows = []
    for r, res in enumerate(ranks):
        if "error" in res:
            print(f"rank {r}: {res['error']}", file=sys.stderr)
            return 1
        e = est.per_rank[res["stage"]].peak_allocated_bytes
        rows.append({"rank": r, **res, "estimate": e, "error": e / res["peak"] - 1})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for row in rows:
            print(f"rank {row['rank']} stage {row['stage']}: measured {row['peak']:,} B ({row['phase']}), "
                  f"estimated {row['estimate']:,} B, {row['error']:+.1%}")
            print("   at the peak:", {k: v for k, v in list(row["at_peak"].items())[:8]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
