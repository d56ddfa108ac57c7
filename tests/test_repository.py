"""A fresh clone works as the README says: `make lab` starts as root and opens the quick start, the
committed notebooks do not turn modified when opened, the tests carry their data, and every Binder link
points at the repository named in pyproject.toml."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import set_repository  # noqa: E402


def _lab_command(tmp_path: Path, uid: int, *args: str) -> subprocess.CompletedProcess[str]:
    """scripts/lab.sh in dry-run mode, with `id -u` answering `uid`."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    (fake / "id").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "TRAINMEM_LAB_DRY_RUN": "1"}
    return subprocess.run(["bash", str(ROOT / "scripts" / "lab.sh"), *args], capture_output=True, text=True, env=env,
                          check=True)


def test_lab_script_allows_root_and_opens_the_quick_start(tmp_path: Path) -> None:
    root = _lab_command(tmp_path, 0, "--port", "9999")
    assert root.stdout.split() == ["jupyter", "lab", "--LabApp.default_url=/lab/tree/notebooks/00_quick_start.ipynb",
                                   "--allow-root", "--port", "9999"]
    assert "--allow-root" in root.stderr  # says why
    user = _lab_command(tmp_path, 1000)
    assert "--allow-root" not in user.stdout and "00_quick_start.ipynb" in user.stdout


def test_make_lab_passes_lab_args() -> None:
    proc = subprocess.run(["make", "-n", "lab", "LAB_ARGS=--no-browser --port 9999"], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    assert "bash scripts/lab.sh --no-browser --port 9999" in proc.stdout


def test_committed_language_info_matches_the_kernels() -> None:
    """JupyterLab writes the kernel's language_info into the notebook when it connects; anything else makes
    the document dirty at once."""
    jupyter_client = pytest.importorskip("jupyter_client.manager")
    km, kc = jupyter_client.start_new_kernel(kernel_name="python3")
    try:
        info = kc.kernel_info(reply=True, timeout=60)["content"]["language_info"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        committed = nbformat.read(path, as_version=4).metadata
        assert committed["language_info"] == info, path.name
        assert committed["kernelspec"]["name"] == "python3", path.name


def test_binder_links_use_the_repository_in_pyproject() -> None:
    slug, branch = set_repository.configured()
    found = {p.name: set_repository.links(p) for p in set_repository.files()}
    assert found["README.md"] and all(found[name] for name in found if name.endswith(".ipynb"))
    for name, links in found.items():
        assert links and all(link == (slug, branch) for link in links), (name, links)
    assert set_repository.check() == []


def test_set_repository_rewrites_every_link_and_only_the_links(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    for name in ("README.md", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "notebooks", tmp_path / "notebooks")
    monkeypatch.setattr(set_repository, "ROOT", tmp_path)
    monkeypatch.setattr(set_repository, "PYPROJECT", tmp_path / "pyproject.toml")
    before = {p.name: p.read_text() for p in set_repository.files()}
    changed = set_repository.rewrite("alice/tm", "dev")
    assert set_repository.configured() == ("alice/tm", "dev") and set_repository.check() == []
    assert {p.name for p in changed} == {"pyproject.toml", *before}
    for path in set_repository.files():
        pattern = re.escape("https://mybinder.org/v2/gh/alice/tm/dev")
        assert re.sub(pattern, "X", path.read_text()) == re.sub(set_repository.BINDER, "X", before[path.name])


def test_no_test_skips_for_a_missing_sibling_folder() -> None:
    """The repository carries what its tests read (tests/data/shared): nothing reaches outside it."""
    for path in sorted((ROOT / "tests").rglob("*.py")):
        text = path.read_text()
        depth = len(path.relative_to(ROOT).parts)  # parents[depth - 1] of the file is the repository
        for m in re.finditer(r"__file__\)\.resolve\(\)\.parents\[(\d+)\]((?:\.parent)*)", text):
            up = int(m.group(1)) + 1 + m.group(2).count(".parent")
            assert up <= depth, f"{path.relative_to(ROOT)} reaches {up - depth} folder(s) above the repository"
        assert not re.search(r"skipif\([^)]*shared", text), path.name
    assert (ROOT / "tests" / "data" / "shared" / "gpus.csv").exists()
    assert len(list((ROOT / "tests" / "data" / "shared" / "harness_results").glob("*.json"))) == 46
