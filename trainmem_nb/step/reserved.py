"""From an allocated peak to what the caching allocator reserves and what nvidia-smi shows.
"""

from __future__ import annotations

from ..spec.calibration import Calibration
from ..spec.choices import Device
from ..spec.training import TrainingSpec

__all__ = ['reserved_and_total']


def reserved_and_total(t: TrainingSpec, peak: int, churn: int, calibration: Calibration | None,
                       unified: int = 0) -> tuple[int, int]:
    """The caching allocator's reserved bytes and the device total (nvidia-smi) for an allocated peak.

    ``churn`` is the activation and temporary bytes at the peak: memory that is freed and reused within
    a step, where cached blocks and fragmentation come from; ``unified``, CUDA unified memory outside the
    allocator (a paged optimizer's states, `paged_state_bytes`), which nvidia-smi counts while resident.
    CPU: both equal the peak."""
    if t.device is not Device.CUDA:
        return peak, peak
    from ..device import CUDA_CONTEXT_BYTES, LARGE_SEGMENT_BYTES, RESERVED_CHURN_FRACTION

    frac = calibration.reserved_churn_fraction if calibration else RESERVED_CHURN_FRACTION
    context = calibration.cuda_context_bytes if calibration else CUDA_CONTEXT_BYTES
    reserved = -(-int(peak + frac * churn) // LARGE_SEGMENT_BYTES) * LARGE_SEGMENT_BYTES
    return reserved, reserved + context + unified
