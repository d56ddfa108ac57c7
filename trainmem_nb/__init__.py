"""trainmem_nb: will this training run fit, on which GPU, how many of them, and what will it cost?

The estimator simulates one training step on symbolic tensors, op by op as Hugging Face models and
PyTorch's autograd run it, and is checked byte for byte against measured steps. It needs only
pydantic: ``import trainmem_nb`` never imports torch, pandas, matplotlib or ipywidgets.

>>> import trainmem_nb as tm
>>> est = tm.estimate("tinyllama-1.1b", micro_batch=1, seq_len=2048, precision="bf16-mixed")
>>> est.peak_phase
'optimizer'
"""

from __future__ import annotations

from typing import Any

from .errors import SpecError
from .estimator.api import estimate
from .estimator.result import MemoryEstimate
from .model.presets import get_model, list_presets
from .model.spec import ModelSpec
from .spec.stack import list_stacks
from .spec.training import TrainingSpec
from .units import format_bytes, format_count

__all__ = [
    "MemoryEstimate",
    "ModelSpec",
    "SpecError",
    "TrainingSpec",
    "__version__",
    "estimate",
    "format_bytes",
    "format_count",
    "get_model",
    "list_presets",
    "list_stacks",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Load the optional parts (widgets, plots, sweeps, planner, measurement) only when used."""
    lazy = {
        "explore": ("trainmem_nb.ui.explorer", "explore"),
        "sweep": ("trainmem_nb.planning.sweeps", "sweep"),
        "fit": ("trainmem_nb.planning.fit", "fit"),
        "plan": ("trainmem_nb.planning.search", "plan"),
        "max_micro_batch": ("trainmem_nb.planning.fit", "max_micro_batch"),
        "fewest_gpus": ("trainmem_nb.planning.fit", "fewest_gpus"),
        "get_gpu": ("trainmem_nb.planning.gpus", "get_gpu"),
        "list_gpus": ("trainmem_nb.planning.gpus", "list_gpus"),
        "measure": ("trainmem_nb.measure", "measure"),
        "plots": ("trainmem_nb.ui.plots", None),
    }
    if name in lazy:
        import importlib

        module_name, attr = lazy[name]
        module = importlib.import_module(module_name)
        return module if attr is None else getattr(module, attr)
    raise AttributeError(f"module 'trainmem_nb' has no attribute {name!r}")
