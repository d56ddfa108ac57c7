"""The one error the package raises for bad input, and the helpers that word it.

Everything may import this module; it imports only the standard library.
"""

from __future__ import annotations

import difflib
import math
from typing import Any

__all__ = ['SpecError', 'did_you_mean']


class SpecError(ValueError):
    """A spec or option is invalid; the message says which field, the value and what is valid."""


def did_you_mean(value: str, choices: list[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(str(value).lower(), [c.lower() for c in choices], n=1, cutoff=0.5)
    if not close:
        return ""
    original = next(c for c in choices if c.lower() == close[0])
    return f" (did you mean {original!r}?)"


def finite_number(value: Any, field: str) -> float:
    """Parse a number, rejecting NaN and infinities with a message naming the field."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise SpecError(f"{field}={value!r} is not a number") from None
    if not math.isfinite(number):
        raise SpecError(f"{field}={value!r} must be a finite number")
    return number
