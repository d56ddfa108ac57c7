"""From an allocated peak to what the caching allocator reserves and what nvidia-smi shows.

The allocator is modelled to reserve, beyond the live bytes, a fraction of the memory that churns
within a step (activations and temporaries: freed blocks stay cached and split blocks fragment). A
step's reserved peak is the highest point over the step of ``allocated + fraction * churn``
(`trainmem_nb.engine.program.peak_with_churn`), rounded up to the allocator's large segments: taken
over the whole step rather than at the allocated peak alone, it cannot fall while the allocated peak
rises (a larger batch or sequence grows every point), and it is at least the value at the allocated
peak. A calibration's fraction is measured at the allocated peak (`trainmem_nb.measure.calibration`).
"""

from __future__ import annotations

from ..spec.calibration import Calibration
from ..spec.choices import Device
from ..spec.training import TrainingSpec

__all__ = ['churn_fraction', 'reserved_and_total', 'reserved_and_total_over_step']


def churn_fraction(calibration: Calibration | None) -> float:
    """The fraction of the churning bytes the allocator keeps reserved beyond the live ones (a
    calibration's, else `trainmem_nb.device.RESERVED_CHURN_FRACTION`)."""
    from ..device import RESERVED_CHURN_FRACTION

    return calibration.reserved_churn_fraction if calibration else RESERVED_CHURN_FRACTION


def reserved_and_total(t: TrainingSpec, peak: int, churn: int, calibration: Calibration | None,
                       unified: int = 0) -> tuple[int, int]:
    """The caching allocator's reserved bytes and the device total (nvidia-smi) at one point of a step
    with `peak` allocated bytes, ``churn`` of them activations and temporaries; ``unified``, CUDA
    unified memory outside the allocator (a paged optimizer's states, `paged_state_bytes`), which
    nvidia-smi counts while resident. CPU: both equal the peak."""
    if t.device is not Device.CUDA:
        return peak, peak
    return _segments_and_total(peak + churn_fraction(calibration) * churn, calibration, unified)


def reserved_and_total_over_step(t: TrainingSpec, peak: int, high_water: float, calibration: Calibration | None,
                                 unified: int = 0) -> tuple[int, int]:
    """Reserved bytes and device total of a step whose allocated peak is `peak` and whose highest
    ``allocated + churn_fraction(calibration) * churn`` over the step is `high_water`
    (`trainmem_nb.engine.program.peak_with_churn`). CPU: both equal the peak."""
    if t.device is not Device.CUDA:
        return peak, peak
    return _segments_and_total(max(high_water, peak), calibration, unified)


def _segments_and_total(nbytes: float, calibration: Calibration | None, unified: int) -> tuple[int, int]:
    from ..device import CUDA_CONTEXT_BYTES, LARGE_SEGMENT_BYTES

    context = calibration.cuda_context_bytes if calibration else CUDA_CONTEXT_BYTES
    reserved = -(-int(nbytes) // LARGE_SEGMENT_BYTES) * LARGE_SEGMENT_BYTES
    return reserved, reserved + context + unified
