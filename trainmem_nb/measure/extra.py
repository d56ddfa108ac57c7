"""Whether the measure extra (torch, transformers) is installed, and the line that says how to get it."""

from __future__ import annotations

__all__ = ["MISSING_EXTRA", "require_torch"]

MISSING_EXTRA = 'trainmem measure needs the measure extra: pip install "trainmem_nb[measure]"'


def require_torch() -> None:
    """Raise a one-line `RuntimeError` saying how to install the extra when torch is missing."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise RuntimeError(MISSING_EXTRA) from None
