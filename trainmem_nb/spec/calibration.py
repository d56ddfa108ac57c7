"""A calibration: what only a real GPU shows (CUDA context, workspaces, allocator churn), measured by
``trainmem measure --device cuda --save-calibration`` and replacing the modelled constants.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..device import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, RESERVED_CHURN_FRACTION

__all__ = ['Calibration', 'load_calibration']


class Calibration(BaseModel):
    """What only a real GPU shows, measured by ``trainmem measure --device cuda --save-calibration``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu_name: str = ""
    total_memory_bytes: int = Field(default=0, ge=0)
    cuda_context_bytes: int = Field(default=CUDA_CONTEXT_BYTES, ge=0)
    workspace_bytes: int = Field(default=CUBLAS_WORKSPACE_BYTES["default"], ge=0)
    reserved_churn_fraction: float = Field(default=RESERVED_CHURN_FRACTION, ge=0.0, le=10.0)
    torch_version: str = ""
    measured_on: str = ""
    source: str = "defaults"


def load_calibration(calibration: Calibration | Mapping[str, Any] | str | Path | None) -> Calibration | None:
    """A `Calibration` from an object, a dict or a JSON file written by ``trainmem measure``."""
    if calibration is None or isinstance(calibration, Calibration):
        return calibration
    if isinstance(calibration, (str, Path)):
        from ..errors import SpecError

        try:
            data = json.loads(Path(calibration).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SpecError(f"calibration={str(calibration)!r} cannot be read as JSON: {exc}") from None
        calibration = data.get("calibration", data) if isinstance(data, dict) else data
    from .base import _validate

    return _validate(Calibration, calibration)  # type: ignore[arg-type]
