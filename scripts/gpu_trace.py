"""Record the CUDA caching allocator's own event history around one measured step (GPU only).

    python scripts/gpu_trace.py OUT.json --model llama-3.2-1b --micro-batch 2 --seq-len 1024 [--checkpointing full]

writes ``{"measurement": <trainmem measure JSON>, "trace": [[action, addr, size, stream, frame], ...],
"frames": [...], "segments": [...]}``: every ``alloc``/``free_completed``/``segment_alloc``/``segment_free`` action that
``torch.cuda.memory._record_memory_history`` saw from the model's construction to the end of the measured
step, each allocation with its innermost Python frames (an index into ``frames``), and the snapshot's segments after it. `scripts/replay_gpu_trace.py` replays the
real malloc/free sequence through `trainmem_nb.engine.allocator` and compares the segments each side
makes, so a difference in reserved bytes can be split into "the allocator model decides differently" and
"the estimated step allocates in another order".
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from trainmem_nb.measure.api import measure


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--model", required=True)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--checkpointing", default="none")
    ap.add_argument("--method", default="full")
    a = ap.parse_args(argv)
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=10_000_000)
    r = measure(a.model, device="cuda", micro_batch=a.micro_batch, seq_len=a.seq_len,
                checkpointing=a.checkpointing, method=a.method)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    keep = {"alloc", "free_completed", "segment_alloc", "segment_free", "segment_map", "segment_unmap"}
    where: dict[str, int] = {}  # the innermost Python frames of each allocation, as indices into `frames`

    def frame(e: dict) -> int:
        fs = [f"{f['filename'].rsplit('site-packages/', 1)[-1]}:{f['line']}:{f['name']}" for f in e.get("frames", ())
              if not f["filename"].startswith("??")][:3]
        return where.setdefault(" < ".join(fs), len(where))

    trace = [[e["action"], int(e["addr"]), int(e["size"]), int(e["stream"]), frame(e) if e["action"] == "alloc" else -1]
             for dev in snap["device_traces"] for e in dev if e["action"] in keep]
    segs = [{"address": int(s["address"]), "total_size": int(s["total_size"]), "segment_type": s["segment_type"],
             "blocks": [[int(b["size"]), b["state"]] for b in s["blocks"]]} for s in snap["segments"]]
    with open(a.out, "w") as f:
        json.dump({"measurement": r.to_dict(),
                   "trace": trace, "frames": list(where), "segments": segs}, f)
    print(f"{a.out}: {len(trace)} allocator actions, {len(segs)} segments, "
          f"max_reserved {torch.cuda.max_memory_reserved()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
