"""Every compiled step of the fingerprint grid is the same event stream as when it was recorded.

The grid and its fingerprints are `tests/data/program_fingerprints.json` (`tests/fingerprints.py`
explains them and re-records after a deliberate change). A refactor that moves code must leave every
fingerprint identical: the same allocations and frees, of the same sizes, in the same order.
"""

from __future__ import annotations

import json

import pytest
from fingerprints import DATA, fingerprint

STORED = json.loads(DATA.read_text())


def test_the_grid_covers_every_family_and_many_layouts() -> None:
    families = {case["model"]["family"] for case in STORED.values()}
    assert len(families) >= 10
    assert sum("refused" not in case for case in STORED.values()) >= 800


@pytest.mark.parametrize("family", sorted({c["model"]["family"] for c in STORED.values()}))
def test_compiled_steps_match_their_recorded_fingerprints(family: str) -> None:
    moved = []
    for cid, case in STORED.items():
        if case["model"]["family"] != family:
            continue
        now = fingerprint(case)
        recorded = {k: case[k] for k in ("program", "live", "numbers", "refused") if k in case}
        if now != recorded:
            moved.append(f"{cid}: {recorded} -> {now}")
    assert not moved, f"{len(moved)} cases changed:\n" + "\n".join(moved[:20])
