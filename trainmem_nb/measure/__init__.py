"""Measure a real training step's memory with PyTorch (the optional ``measure`` extra).

Importing this package needs torch and transformers; the estimator never imports it.
"""

from __future__ import annotations

MISSING_EXTRA = 'trainmem measure needs the measure extra: pip install "trainmem_nb[measure]"'


def require_torch() -> None:
    """Raise a one-line `RuntimeError` saying how to install the extra when torch is missing."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise RuntimeError(MISSING_EXTRA) from None
