"""Re-execute the notebooks in place after a deliberate change to the numbers (``make notebooks``).

Each notebook runs top to bottom in a fresh ``python3`` kernel of this environment, from the
``notebooks/`` folder, with a timeout per cell; then it is cleaned so that a rerun changes nothing
but real results: execution timings, widget state and widget-view ids (random on every run, useless
without the state) are dropped, the notebook metadata is reduced to the kernel spec and the kernel's
``language_info`` (as JupyterLab writes it, so an opened notebook is not marked modified).
The committed outputs are what ``pytest --nbval`` compares against, so review the diff before
committing. Finally ``scripts/check_notebooks.py`` checks the result.

Usage: python scripts/refresh_notebooks.py [notebooks/NAME.ipynb ...]   (default: all of notebooks/)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def clean(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Drop what changes on every run without meaning anything. The kernel's full ``language_info``
    (what nbclient recorded from its kernel_info reply) is kept: JupyterLab writes it into the notebook
    when the kernel connects, and a stub would mark the quick start modified the moment it opens."""
    language = dict(nb.metadata.get("language_info") or {"name": "python"})
    nb.metadata = nbformat.from_dict({"kernelspec": KERNELSPEC, "language_info": language})
    for cell in nb.cells:
        tags = cell.metadata.get("tags")
        cell.metadata = nbformat.from_dict({"tags": tags} if tags else {})
        if "outputs" in cell:  # one stream output per name in a row (how the kernel flushed it is noise)
            cell.outputs = _coalesce_streams(cell.outputs)
        for out in cell.get("outputs", ()):
            data = out.get("data")
            if data and WIDGET_VIEW in data:
                del data[WIDGET_VIEW]  # a random model id; the text/plain repr stays
            if "metadata" in out:
                out.metadata = nbformat.from_dict({k: v for k, v in out.metadata.items() if k != "execution"})
    return nb


def _coalesce_streams(outputs: list) -> list:
    """Consecutive stream outputs of one name (stdout, stderr) merged into one, as nbval compares them."""
    merged: list = []
    for out in outputs:
        if out.get("output_type") == "stream" and merged and merged[-1].get("output_type") == "stream" \
                and merged[-1].get("name") == out.get("name"):
            merged[-1]["text"] = "".join(merged[-1]["text"]) + "".join(out["text"])
        else:
            merged.append(out)
    return merged


def refresh(path: Path, timeout: int) -> float:
    """Execute `path` in place; returns the seconds it took."""
    t0 = time.perf_counter()
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            store_widget_state=False, resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    nbformat.write(clean(nb), path)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: notebooks/*.ipynb")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per cell (default 300)")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted(NOTEBOOKS.glob("*.ipynb"))
    for path in paths:
        print(f"[refresh] {path.name} ...", end=" ", flush=True)
        print(f"{refresh(path.resolve(), args.timeout):.1f} s", flush=True)
    sys.path.insert(0, str(ROOT / "scripts"))
    from check_notebooks import main as check

    return check([str(p) for p in paths])


if __name__ == "__main__":
    sys.exit(main())
