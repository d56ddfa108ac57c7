"""A GPU run's caching-allocator segments beside the replay's, for the same step.

On a machine with a GPU::

    trainmem measure llama-3.2-1b --device cuda --micro-batch 2 --seq-len 1024 --out m.json
    python scripts/compare_snapshot.py m.json [more.json ...]

``trainmem measure --device cuda`` records ``torch.cuda.memory._snapshot()``'s segments after the measured
step (``measured_with.cuda.segments``) and ``max_memory_reserved()``; this script rebuilds the same step,
replays loading and two steps through the allocator model (`trainmem_nb.step.reserved.replay_segments`)
and prints both: reserved bytes, segments per pool, allocated and cached-free bytes, the largest free
block, the largest segments. The measured step is built on the device rather than loaded with
``from_pretrained``, so a difference in the small pool or in a loading residue is expected; the peak is
what `trainmem_nb.step.reserved.replay_step` reports. Exit status 0 when every file could be compared.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from trainmem_nb.engine.allocator.segments import segments_digest
from trainmem_nb.estimator.api import estimate
from trainmem_nb.model.spec import ModelSpec
from trainmem_nb.spec.training import TrainingSpec
from trainmem_nb.step.compile import _SINGLE, compile_step, program_key
from trainmem_nb.step.load import loading_events
from trainmem_nb.step.reserved import replay_segments
from trainmem_nb.units import format_bytes

#: how many of the largest segments each side lists
LARGEST = 6


def compare(measurement: dict[str, Any]) -> tuple[list[str], bool]:
    """The comparison's lines for one measurement (a ``trainmem measure --json`` object) and whether the
    two sides hold the same segments (sizes, pools and blocks)."""
    cuda = (measurement.get("measured_with") or {}).get("cuda") or {}
    measured = cuda.get("segments")
    if not measured:
        raise ValueError("no allocator segments in this measurement: record it with trainmem measure --device cuda "
                         "(torch with CUDA, a recent trainmem_nb)")
    m = ModelSpec.model_validate(measurement["model_spec"])
    t = TrainingSpec.model_validate(measurement["training"])
    unrolled = compile_step(m, program_key(t, m), _SINGLE, unrolled=True)
    replayed = replay_segments(unrolled, t.micro_batch, t.seq_len, t.alloc_conf, loading_events(m, t))
    est = estimate(m, t)
    a, b = segments_digest(measured), segments_digest(replayed)
    lines = [f"{m.name}: micro_batch={t.micro_batch}, seq_len={t.seq_len}, {t.precision.value}, "
             f"{t.method.value}, alloc_conf={t.alloc_conf or 'default'}",
             f"  {'after the step':<28}{'measured':>16}{'replayed':>16}"]
    for key in a:
        fmt = (lambda v: str(v)) if key.endswith("segments") else format_bytes
        lines.append(f"  {key:<28}{fmt(a[key]):>16}{fmt(b[key]):>16}")
    lines.append(f"  {'max_memory_reserved':<28}{format_bytes(int(cuda.get('max_reserved', 0))):>16}"
                 f"{format_bytes(est.peak_reserved_bytes):>16}")
    for name, segs in (("measured", measured), ("replayed", replayed)):
        sizes = sorted((s["total_size"] for s in segs), reverse=True)[:LARGEST]
        lines.append(f"  largest {name} segments: " + ", ".join(format_bytes(x) for x in sizes))
    same = sorted(map(json.dumps, measured)) == sorted(map(json.dumps, replayed))
    lines.append("  the same segments and blocks" if same else "  the segments differ")
    return lines, same


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("measurements", nargs="+", type=Path, help="JSON files written by trainmem measure --out")
    args = ap.parse_args(argv)
    status = 0
    for path in args.measurements:
        try:
            lines, _same = compare(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError) as e:
            print(f"{path}: {e}", file=sys.stderr)
            status = 1
            continue
        print("\n".join(lines))
    return status


if __name__ == "__main__":
    sys.exit(main())
