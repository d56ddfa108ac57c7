"""The core is pure: importing trainmem_nb (and estimating) loads no torch, pandas, matplotlib or ipywidgets."""

from __future__ import annotations

import subprocess
import sys


def test_import_and_estimate_load_no_heavy_library() -> None:
    code = (
        "import sys, trainmem_nb as tm; tm.estimate('llama-2-7b', micro_batch=1, seq_len=512);"
        "heavy = [m for m in ('torch', 'pandas', 'matplotlib', 'ipywidgets', 'numpy', 'transformers') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_no_module_imports_one_that_imports_it_back() -> None:
    """No import cycle among trainmem_nb modules, lazy imports inside functions included (a lazy import
    hides a cycle, it does not remove it); ``if TYPE_CHECKING:`` imports never run and are left out.
    The layers themselves are `lint-imports`' contract in pyproject.toml."""
    import pytest

    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("trainmem_nb", include_external_packages=False, exclude_type_checking_imports=True)
    cycles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            chain = graph.find_shortest_chain(importer=imported, imported=module)
            if chain:
                cycles.append(" -> ".join((module, *chain)))
    assert not cycles, "\n".join(cycles[:10])
