"""The one error the package raises for bad input, and the helpers that word it.

Everything may import this module; it imports only the standard library.
"""

from __future__ import annotations

import difflib
import json
import math
import numbers
from pathlib import Path
from typing import Any

__all__ = ['SpecError', 'did_you_mean', 'finite_number', 'parse_json', 'read_json', 'read_text_file', 'show_value',
           'whole_number']


class SpecError(ValueError):
    """A spec or option is invalid; the message says which field, the value and what is valid."""


def did_you_mean(value: str, choices: list[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(str(value).lower(), [c.lower() for c in choices], n=1, cutoff=0.5)
    if not close:
        return ""
    original = next(c for c in choices if c.lower() == close[0])
    return f" (did you mean {original!r}?)"


def show_value(value: Any) -> str:
    """A value as a message quotes it: JSON's words for non-finite floats (``Infinity``, ``NaN``), and a
    huge integer shortened (``1e+30``) so one line stays one line."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**20:
        if abs(value) < 10**300:
            return f"{float(value):.3g}"
        return f"<a {len(str(abs(value)))}-digit integer>"
    text = repr(value)
    return text if len(text) <= 60 else text[:50] + "..." + text[-6:]


def finite_number(value: Any, field: str) -> float:
    """Parse a number, rejecting NaN, infinities, bools and empty text with a message naming the field."""
    if isinstance(value, bool) or (isinstance(value, str) and not value.strip()):
        raise SpecError(f"{field}={value!r} is not a number")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise SpecError(f"{field}={show_value(value)} is not a number") from None
    if not math.isfinite(number):
        raise SpecError(f"{field}={show_value(value)} must be a finite number")
    return number


def whole_number(value: Any, field: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer read from a file or a dict: ints and numpy integers, or a finite float with no
    fraction (``24.0``); never a bool or text. Bounds are checked before converting, so ``Infinity`` or
    ``1e400`` gets this message, not an OverflowError."""
    valid = ("an integer" if minimum is None and maximum is None else
             f"an integer >= {minimum}" if maximum is None else
             f"an integer <= {maximum}" if minimum is None else f"an integer from {minimum} to {maximum}")
    bad = SpecError(f"{field}={show_value(value)} must be {valid}")
    if isinstance(value, bool) or type(value).__name__ == "bool_" or not isinstance(value, numbers.Real):
        raise bad
    if isinstance(value, numbers.Integral):
        number = int(value)
    else:
        as_float = float(value)
        if not math.isfinite(as_float) or as_float != math.floor(as_float):
            raise bad
        if (minimum is not None and as_float < minimum) or (maximum is not None and as_float > maximum):
            raise bad
        number = int(as_float)
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise bad
    return number


def read_text_file(path: str | Path, flag: str) -> str:
    """The UTF-8 text of `path`, or a `SpecError` naming `flag` and the file: missing, unreadable, a
    folder, or binary / not UTF-8 (instead of ``'utf-8' codec can't decode byte 0x8e``)."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except IsADirectoryError:
        raise SpecError(f"{flag} {p} is a folder, not a file") from None
    except OSError as exc:
        raise SpecError(f"{flag} {p} cannot be read: {exc.strerror or exc}") from None
    if b"\x00" in data[:65536]:
        raise SpecError(f"{flag} {p} is a binary file, not UTF-8 text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{flag} {p} is not UTF-8 text (undecodable byte at offset {exc.start}; binary?)") from None


def parse_json(text: str | bytes, where: str) -> Any:
    """``json.loads(text)``, with every way it fails as one `SpecError` naming `where`: not UTF-8, not
    JSON (with the line), nested too deeply for the parser, or a number too long to read."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        raw = bytes(text)
        if b"\x00" in raw[:65536]:
            raise SpecError(f"{where} is a binary file, not UTF-8 JSON")
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise SpecError(f"{where} is not UTF-8 text (undecodable byte at offset {exc.start}; binary?)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{where} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise SpecError(f"{where} nests deeper than a JSON reader can follow; no config nests like that") from None
    except ValueError as exc:  # e.g. an integer literal beyond Python's 4300-digit limit
        raise SpecError(f"{where} is not valid JSON: {str(exc).splitlines()[0]}") from None


def read_json(path: str | Path, flag: str) -> Any:
    """`parse_json` of the file `path` (`read_text_file`'s errors), naming `flag` and the file."""
    return parse_json(read_text_file(path, flag), f"{flag} {Path(path)}")
