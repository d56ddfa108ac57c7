"""Measure a real training step's memory with PyTorch (the optional ``measure`` extra).

``trainmem_nb.measure.measure(model, **options)`` runs one steady-state step (on fake tensors, real CPU
tensors or a CUDA GPU) and returns a `Measurement` in the same JSON contract as an estimate.
Importing this package does not import torch: the stored dataset (`trainmem_nb.measure.dataset`)
and the result type are usable where only the estimator is installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .extra import MISSING_EXTRA, require_torch

if TYPE_CHECKING:
    from .result import Measurement

__all__ = ["MISSING_EXTRA", "Measurement", "measure", "require_torch"]

def measure(*args: Any, **kwargs: Any) -> Measurement:
    """Measure one training step; see `trainmem_nb.measure.api.measure` for the arguments."""
    require_torch()
    from .api import measure as _measure

    return _measure(*args, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "Measurement":
        from .result import Measurement

        return Measurement
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
