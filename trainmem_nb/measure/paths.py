"""Where the shipped measurements live."""

from __future__ import annotations

from pathlib import Path

__all__ = ["CASES_FILE", "HARNESS_FILE", "VALIDATION_DIR"]

#: ``validation/`` at the root of the repository (beside the package).
VALIDATION_DIR = Path(__file__).resolve().parents[2] / "validation"
CASES_FILE = VALIDATION_DIR / "cases.jsonl"
HARNESS_FILE = VALIDATION_DIR / "harness_cases.json"
