"""Check that the committed notebooks are what the notebook tests assume.

nbval passes a cell that was never executed without comparing anything, so every code cell must hold
the output of one clean run: execution counts 1, 2, …, n in order, no empty code cells, no error
output (unless the cell is tagged ``raises-exception``). Also checked: each notebook opens with a
title, one sentence of purpose and a Binder link to itself; lessons (01–08) carry at least one exercise
with an answer the student can reveal (``<details>``); no stray metadata (timings, widget state,
editor state) that would churn on every run.

Usage: python scripts/check_notebooks.py notebooks/*.ipynb     (exit status 1 on any problem)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from urllib.parse import unquote

import nbformat

#: Notebook metadata kept by scripts/refresh_notebooks.py; anything else is editor or run state.
ALLOWED_NOTEBOOK_METADATA = {"kernelspec", "language_info"}
#: The ``language_info`` keys ipykernel reports; JupyterLab writes them into the notebook when the kernel
#: connects, so a notebook committed without them shows as modified as soon as it opens.
LANGUAGE_INFO_KEYS = {"name", "version", "mimetype", "codemirror_mode", "pygments_lexer", "nbconvert_exporter",
                      "file_extension"}
#: Cell metadata kept: tags (nbval and nbclient read them).
ALLOWED_CELL_METADATA = {"tags"}
BINDER = re.compile(r"https://mybinder\.org/v2/gh/[^)\s]+/[^)\s]+\?urlpath=(lab/tree|voila/render)/notebooks/"
                    r"(?P<name>[\w.%-]+\.ipynb)")


def check(path: Path) -> list[str]:
    """The problems of one notebook (empty when it is fine)."""
    problems: list[str] = []
    nb = nbformat.read(path, as_version=4)
    extra = set(nb.metadata) - ALLOWED_NOTEBOOK_METADATA
    if extra:
        problems.append(f"notebook metadata {sorted(extra)} (run scripts/refresh_notebooks.py)")
    missing = LANGUAGE_INFO_KEYS - set(nb.metadata.get("language_info", {}))
    if missing:
        problems.append(f"language_info lacks {sorted(missing)}: JupyterLab would mark the notebook modified on "
                        "open (run scripts/refresh_notebooks.py)")
    cells = nb.cells
    if not cells or cells[0].cell_type != "markdown":
        return [*problems, "the first cell must be markdown: a title, one sentence of purpose, a Binder link"]
    head = cells[0].source
    if not re.match(r"#\s+\S", head):
        problems.append("the first cell must start with a '# ' title")
    link = BINDER.search(unquote(head))
    if not link:
        problems.append("the first cell has no Binder link (https://mybinder.org/v2/gh/...?urlpath=...)")
    elif link.group("name") != path.name:
        problems.append(f"the Binder link opens {link.group('name')}, not {path.name}")
    prose = [line for line in head.splitlines()[1:] if line.strip() and "mybinder.org" not in line]
    if not prose or not prose[0].rstrip().endswith((".", ":")):
        problems.append("the title must be followed by one sentence of purpose")
    if re.match(r"0[1-8]_", path.name) and not any(c.cell_type == "markdown" and "<details>" in c.source
                                                    for c in cells):
        problems.append("a lesson needs at least one exercise with a revealable answer (<details>)")
    expected = 0
    for i, cell in enumerate(cells):
        extra = set(cell.metadata) - ALLOWED_CELL_METADATA
        if extra:
            problems.append(f"cell {i}: metadata {sorted(extra)}")
        if cell.cell_type != "code":
            continue
        if not cell.source.strip():
            problems.append(f"cell {i}: empty code cell")
            continue
        expected += 1
        if cell.execution_count != expected:
            problems.append(f"cell {i}: execution_count {cell.execution_count}, expected {expected} "
                            "(every code cell run once, in order: scripts/refresh_notebooks.py)")
        tags = set(cell.metadata.get("tags", ()))
        for out in cell.get("outputs", ()):
            if out.output_type == "error" and "raises-exception" not in tags:
                problems.append(f"cell {i}: {out.ename}: {out.evalue}")
            if out.output_type == "stream" and out.name == "stderr":
                problems.append(f"cell {i}: output on stderr (a warning?): {out.text.strip()[:120]}")
            data = out.get("data", {})
            if "application/vnd.jupyter.widget-state+json" in data:
                problems.append(f"cell {i}: widget state stored in an output")
    return problems


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or sorted(Path("notebooks").glob("*.ipynb"))
    if not paths:
        print("check_notebooks: no notebooks given", file=sys.stderr)
        return 1
    bad = 0
    for path in paths:
        problems = check(path)
        for p in problems:
            print(f"{path}: {p}", file=sys.stderr)
        bad += bool(problems)
    print(f"check_notebooks: {len(paths) - bad}/{len(paths)} notebooks executed in order and clean")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
