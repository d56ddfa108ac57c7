"""Where the shipped measurements live: package data, so an installed trainmem_nb (not only a checkout)
can run ``trainmem validate --from-dataset``; the reports about them are in the repository's ``validation/``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CASES_FILE", "DATA_DIR", "HARNESS_FILE", "VALIDATION_DIR"]

#: ``trainmem_nb/data/measured/``: the measured steps, shipped with the package.
DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "measured"
CASES_FILE = DATA_DIR / "cases.jsonl"
HARNESS_FILE = DATA_DIR / "harness_cases.json"
#: ``validation/`` at the root of a checkout (beside the package): the generated reports (SUMMARY.md,
#: harness_agreement.*) and published.md. It does not exist in an installed package.
VALIDATION_DIR = Path(__file__).resolve().parents[2] / "validation"
