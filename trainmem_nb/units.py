"""One formatter for bytes and one for parameter counts, each stating its convention.

Memory is always ``int`` bytes in code; GiB (2**30 bytes, what ``nvidia-smi`` and PyTorch print as
"GiB"/"MiB") appear only in display. Parameter counts use powers of 1000, never 1024.
"""

from __future__ import annotations

__all__ = ["GIB", "MIB", "format_bytes", "format_count"]

GIB = 1 << 30
MIB = 1 << 20


def format_bytes(n: int | float, digits: int = 2) -> str:
    """Bytes in binary units (KiB, MiB, GiB, TiB = powers of 1024).

    >>> format_bytes(3 * 2**30 + 2**29)
    '3.50 GiB'
    >>> format_bytes(512)
    '512 B'
    """
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{sign}{value:.0f} B" if unit == "B" else f"{sign}{value:.{digits}f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_count(n: int | float) -> str:
    """A parameter or token count in powers of 1000 (K, M, B, T).

    >>> format_count(6_738_415_616)
    '6.74B'
    """
    value = float(n)
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{unit}" if value / scale < 100 else f"{value / scale:.0f}{unit}"
    return f"{value:.0f}"
