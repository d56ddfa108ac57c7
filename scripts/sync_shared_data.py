"""Keep the repository's copies of the shared data its tests read (``tests/data/shared/``) equal to their
source, ``../shared`` beside the checkout, where it exists.

The tests never read ``../shared``: a fresh clone must test everything on its own. This script is how
the copies are made and checked: ``--check`` (exit 1 on any difference, or when ``../shared`` is not
there, saying so), or without it, copy the files again and rewrite ``tests/data/shared/SOURCES.md``
with each file's origin and sha256.

Usage: python scripts/sync_shared_data.py [--check]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
COPIES = ROOT / "tests" / "data" / "shared"
#: copy -> source, relative to COPIES and SHARED
DATA_FILES = {"gpus.csv": "data/gpus.csv", "prices_snapshot.csv": "data/prices_snapshot.csv",
              "README.md": "data/README.md"}


def pairs() -> dict[str, str]:
    """Every copied file and its source: the shared GPU data, and each harness result a stored case cites."""
    out = dict(DATA_FILES)
    doc = json.loads((ROOT / "trainmem_nb" / "data" / "measured" / "harness_cases.json").read_text())
    for case in doc["cases"]:
        name = Path(case["source"]).name
        out[f"harness_results/{name}"] = f"harness/results/{name}"
    return out


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    ap.add_argument("--shared", type=Path, default=SHARED, help=f"the shared folder (default {SHARED})")
    args = ap.parse_args(argv)
    shared: Path = args.shared
    if not shared.is_dir():
        print(f"[sync] {shared} is not there: nothing to compare the copies with (pass --shared PATH)", file=sys.stderr)
        return 1
    bad = 0
    lines = ["# Copies of ../shared that the tests read", "",
             "Made by `python scripts/sync_shared_data.py` (checked with `--check`); the tests never read "
             "`../shared` itself, so a fresh clone tests everything.", "",
             "| copy | source | sha256 |", "|---|---|---|"]
    for copy, source in sorted(pairs().items()):
        src, dst = shared / source, COPIES / copy
        if not src.exists():
            print(f"[sync] missing source {src}", file=sys.stderr)
            bad += 1
            continue
        if args.check:
            if not dst.exists() or _sha(dst) != _sha(src):
                print(f"[sync] {dst.relative_to(ROOT)} differs from {src}", file=sys.stderr)
                bad += 1
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst)
        lines.append(f"| `{copy}` | `../shared/{source}` | `{_sha(src)}` |")
    if not args.check:
        (COPIES / "SOURCES.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"[sync] {'checked' if args.check else 'copied'} {len(pairs())} files, {bad} problem(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
