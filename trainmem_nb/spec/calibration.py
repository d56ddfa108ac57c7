"""A calibration: what only a real GPU shows (CUDA context, workspaces, allocator churn), measured by
``trainmem measure --device cuda --save-calibration`` and replacing the modelled constants.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field

from ..device import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, RESERVED_CHURN_FRACTION
from ..errors import SpecError
from .base import _FROZEN, SpecModel

__all__ = ['MAX_CALIBRATED_BYTES', 'Calibration', 'load_calibration']

#: Ceiling of a calibrated context or workspace: 16 GiB. A CUDA context is ~0.3-1 GiB and cuBLAS's
#: workspace at most 32 MiB (`trainmem_nb.device`); a value beyond 16 GiB is a unit or file mistake.
MAX_CALIBRATED_BYTES = 16 << 30
#: Ceiling of a calibrated device size: 4 TiB, 20x the largest GPU of the catalog (B200, 180 GB).
MAX_DEVICE_BYTES = 4 << 40


class Calibration(SpecModel):
    """What only a real GPU shows, measured by ``trainmem measure --device cuda --save-calibration``."""

    model_config = _FROZEN

    gpu_name: str = ""
    total_memory_bytes: int = Field(default=0, ge=0, le=MAX_DEVICE_BYTES)
    cuda_context_bytes: int = Field(default=CUDA_CONTEXT_BYTES, ge=0, le=MAX_CALIBRATED_BYTES)
    workspace_bytes: int = Field(default=CUBLAS_WORKSPACE_BYTES["default"], ge=0, le=MAX_CALIBRATED_BYTES)
    reserved_churn_fraction: float = Field(default=RESERVED_CHURN_FRACTION, ge=0.0, le=10.0)
    torch_version: str = ""
    measured_on: str = ""
    source: str = "defaults"


def load_calibration(calibration: Calibration | Mapping[str, Any] | str | Path | None,
                     what: str = "calibration") -> Calibration | None:
    """A `Calibration` from an object, a dict or a JSON file written by ``trainmem measure`` (errors name
    `what`, the argument or flag)."""
    if calibration is None or isinstance(calibration, Calibration):
        return calibration
    if isinstance(calibration, (str, Path)):
        from ..errors import read_json

        if not str(calibration).strip():
            raise SpecError(f"{what}='' names no file: give the JSON that `trainmem measure --save-calibration` wrote")
        data = read_json(calibration, what)
        calibration = data.get("calibration", data) if isinstance(data, dict) else data
    if not isinstance(calibration, Mapping):
        raise SpecError(f"{what} must be a Calibration, a dict or a JSON file path, got {type(calibration).__name__}")
    from .base import _validate

    try:
        return _validate(Calibration, calibration)  # type: ignore[no-any-return,unused-ignore]
    except SpecError as exc:
        raise SpecError(f"{what}: {exc}") from None
