"""Print validation/published.md's stack table: every published figure of tests/test_published.py estimated
with today's default stack and with the stack its source ran, and the median and p90 of the errors.

    python scripts/published_by_stack.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_published as tp


def _stack(case: tp.Published) -> str:
    s = dict(case.stack)
    name = s.pop("stack", "default")
    return name + "".join(f", {k} {v}" for k, v in s.items())


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def main() -> int:
    print("| case | stack the source ran | error, default stack | error, its stack | result |")
    print("|---|---|---|---|---|")
    default, own = [], []
    for case in tp.CASES:
        d, o = tp.relative_error(case, with_stack=False), tp.relative_error(case)
        default.append(abs(d))
        own.append(abs(o))
        result = "xfail" if case.xfail else ("pass" if abs(o) <= case.tolerance else "FAIL")
        print(f"| `{case.id}` | {_stack(case)} | {d:+.1%} | {o:+.1%} | {result} |")
    print()
    print(f"{len(tp.CASES)} figures. |error| with the default stack: median {statistics.median(default):.1%}, "
          f"p90 {_p90(default):.1%}; with each source's stack: median {statistics.median(own):.1%}, "
          f"p90 {_p90(own):.1%}.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
