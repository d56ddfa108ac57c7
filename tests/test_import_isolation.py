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
