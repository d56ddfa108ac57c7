"""Print validation/published.md's replay table: every published reserved or nvidia-smi figure of
tests/test_published.py estimated with its source's stack, its reserved bytes from the churn model
(`trainmem_nb.step.reserved.screening`, what they were before the replay) and from the replay.

    python scripts/published_replay.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_published as tp

import trainmem_nb as tm
from trainmem_nb.step.reserved import screening


def _error(case: tp.Published, churn: bool) -> float:
    if churn:
        with screening():
            e = tm.estimate(**case.config, **case.stack)
    else:
        e = tm.estimate(**case.config, **case.stack)
    got = e.peak_reserved_bytes if case.kind == tp.RESERVED else e.device_total_bytes
    return (got - case.value_bytes) / case.value_bytes


def main() -> int:
    print("| case | error, churn model | error, replay | |")
    print("|---|---|---|---|")
    closer = further = 0
    for case in tp.CASES:
        if case.kind == tp.ALLOCATED:
            continue
        before, after = _error(case, True), _error(case, False)
        verdict = "closer" if abs(after) < abs(before) else "further" if abs(after) > abs(before) else "same"
        closer += verdict == "closer"
        further += verdict == "further"
        print(f"| `{case.id}` | {before:+.1%} | {after:+.1%} | {verdict} |")
    print()
    print(f"{closer} closer with the replay, {further} further.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
