"""The estimate against training steps measured on a real GPU (an NVIDIA H200, validation/gpu/h200).

Two kinds of record, both written by a GPU session's ``scripts/gpu_check.sh`` / ``scripts/gpu_trace.py``:

* ``trace-*.json.gz``: PyTorch's own record of every caching-allocator request and free over a measured run
  (``torch.cuda.memory._record_memory_history``). Replayed through `trainmem_nb.engine.allocator`, the
  real request sequence must give the real reserved bytes and segments: the allocator model against
  torch's allocator, with the step model out of the way.
* ``*.json`` (``trainmem measure --device cuda --out``): a training loop's steady step (built, a first
  step that creates the optimizer state, then the measured one); `estimate` of the same model and
  training spec must land on the GPU's ``max_memory_allocated``, ``max_memory_reserved`` and used
  device memory within the tolerances below.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from trainmem_nb.engine.allocator import CachingAllocator
from trainmem_nb.estimator.api import estimate
from trainmem_nb.model.spec import ModelSpec
from trainmem_nb.spec.training import TrainingSpec

H200 = Path(__file__).resolve().parents[1] / "validation" / "gpu" / "h200"
TRACES = sorted(H200.glob("trace-*.json.gz"))
STEPS = sorted(p for p in H200.glob("*.json") if not p.name.startswith("calibration"))

#: allocated: the step's tensors and the two cuBLAS workspaces are modelled to the byte (llama, qwen3, olmo2:
#: within 0.6 MiB); what the GPU allocates beyond the tracked tensors is not, yet: gpt2's fp16 step starts with
#: 13.8 MiB more and peaks 17.8 MiB over; LoRA steps allocate 76-110 MiB more at the loss's backward
ALLOCATED_TOL = {"full": 0.002, "lora": 0.005}
#: reserved and device: the allocator replay over the loop's history; olmo2 with eager attention reserves
#: 1.3 % less than replayed (the other eight within 0.2 %)
RESERVED_TOL = 0.015


def _load(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def test_the_gpu_records_are_there() -> None:
    """The checks below run on recorded GPU data; an empty folder would make them vacuous."""
    assert len(TRACES) >= 4 and len(STEPS) >= 9


@pytest.mark.parametrize("path", TRACES, ids=[p.name for p in TRACES])
def test_allocator_model_replays_a_real_gpu_request_sequence_to_its_reserved_bytes(path: Path) -> None:
    """Every request and free of a real run, in order (null: ``torch.cuda.empty_cache()``), through the
    allocator model: the same ``max_memory_reserved`` to the byte and the same number of segments."""
    rec = _load(path)
    a, blocks = CachingAllocator(), []
    for e in rec["events"]:
        if e is None:
            a.empty_cache()
        elif e >= 0:
            blocks.append(a.malloc(e))
        else:
            a.free(blocks[~e])
    assert a.peak_reserved == rec["max_memory_reserved"]
    assert a.num_segments == rec["segments_after"]


def _estimate(rec: dict[str, Any]) -> Any:
    return estimate(ModelSpec.model_validate(rec["model_spec"]), TrainingSpec.model_validate(rec["training"]))


@pytest.mark.parametrize("path", STEPS, ids=[p.stem for p in STEPS])
def test_estimate_matches_a_gpu_measured_step(path: Path) -> None:
    """Allocated, reserved and device-used bytes of a measured H200 step, from the estimate of its spec."""
    rec = _load(path)
    cuda = rec["measured_with"]["cuda"]
    est = _estimate(rec)
    method = rec["training"]["method"]
    for what, measured, estimated, tol in (
            ("allocated", cuda["max_allocated"], est.peak_allocated_bytes, ALLOCATED_TOL[method]),
            ("reserved", cuda["max_reserved"], est.peak_reserved_bytes, RESERVED_TOL),
            ("device", cuda["device_used"], est.device_total_bytes, RESERVED_TOL)):
        err = (estimated - measured) / measured
        assert abs(err) <= tol, f"{path.stem} {what}: estimated {estimated} vs measured {measured} ({err:+.2%})"


def test_loop_history_matters_for_reserved_on_the_gpu() -> None:
    """The history replayed before the steady step is the measured loop's (a first step creates the optimizer
    state): replaying two steady steps with the state allocated at load misses a measured step's reserved
    bytes by more than the tolerance, so the check above can tell the two apart."""
    from trainmem_nb.step.compile import _SINGLE, compile_step, program_key
    from trainmem_nb.step.load import loading_events
    from trainmem_nb.step.reserved import replay_step

    rec = _load(H200 / "llama1b-full.json")
    m, t = ModelSpec.model_validate(rec["model_spec"]), TrainingSpec.model_validate(rec["training"])
    unrolled = compile_step(m, program_key(t, m), _SINGLE, unrolled=True)
    measured = rec["measured_with"]["cuda"]["max_reserved"]
    steady = replay_step(unrolled, t.micro_batch, t.seq_len, t.alloc_conf, loading_events(m, t), first_step=False)
    loop = replay_step(unrolled, t.micro_batch, t.seq_len, t.alloc_conf, loading_events(m, t), first_step=True)
    assert abs(loop.peak_reserved_bytes - measured) / measured <= RESERVED_TOL
    assert abs(steady.peak_reserved_bytes - measured) / measured > RESERVED_TOL
