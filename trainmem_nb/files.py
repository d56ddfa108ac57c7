"""Writing what a user asked for without losing what they had: output paths checked before any work,
existing files replaced only when asked (``--force``), and atomic writes (never a half-written file).

Everything may import this module; it imports only the standard library and `trainmem_nb.errors`.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import SpecError

__all__ = ["check_output_file", "write_text_atomic"]


def check_output_file(path: str | Path, flag: str, force: bool = False) -> Path:
    """The file an option will write, checked before the work that produces it: a name, in a folder that
    exists and can be written, not a folder itself, and not an existing file unless `force`."""
    if not str(path).strip():
        raise SpecError(f"{flag}='' names no file")
    out = Path(path)
    if out.is_dir():
        raise SpecError(f"{flag} {out}: is a folder; give a file name")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise SpecError(f"{flag} {out}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise SpecError(f"{flag} {out}: the folder {parent} is not writable")
    if out.exists() and not force:
        raise SpecError(f"{flag} {out}: exists; pass --force to replace it, or choose another name")
    return out


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write `text` to a temporary file beside `path`, then rename it over `path`: a crash or a full disk
    leaves the old file (or none), never a truncated one."""
    out = Path(path)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
