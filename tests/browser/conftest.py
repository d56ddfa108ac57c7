"""Real-browser fixtures: Voila and JupyterLab on 127.0.0.1 with a token, driven by headless Chromium.

Chromium is Debian's (``/usr/bin/chromium``, or ``$CHROMIUM``) driven by PyPI ``playwright`` through
``executable_path``; ``playwright install`` is never used. Every test here skips, saying why, when the
browser, playwright, Voila or JupyterLab is missing. Screenshots and server logs go to ``shots/``
(``$SHOTS_DIR`` overrides; gitignored).

These tests start servers and a browser (about a minute on 2 cores), so they run in their own stage of
``scripts/test.sh``: they are collected only when this folder (or a file in it) is named on the command
line, e.g. ``pytest tests/browser -s``; a plain ``pytest tests`` leaves them out.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHOTS = Path(os.environ.get("SHOTS_DIR", ROOT / "shots"))
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--disable-quic", "--disable-dev-shm-usage",
]


def _chromium() -> str | None:
    for candidate in (os.environ.get("CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test here `browser`, and skip them all with the reason when something is missing."""
    reason = None
    if _chromium() is None:
        reason = "no Chromium: apt-get install chromium (or set CHROMIUM=/path/to/chromium)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            reason = 'no playwright: pip install -e ".[browser]" (never `playwright install`: Debian\'s chromium is used)'
    for item in items:
        if "tests/browser" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.browser)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Leave the browser tests out unless tests/browser (or one of its files) was asked for."""
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    here = Path(__file__).resolve().parent
    invoked = Path(config.invocation_params.dir)
    for arg in config.args:
        target = (invoked / arg.split("::")[0]).resolve()
        if target == here or here in target.parents:
            return None
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A server started for the tests: its base URL, token and log file."""

    url: str
    token: str
    log: Path
    process: subprocess.Popen[bytes]
    log_handle: Any


def _start(cmd: list[str], name: str, ready_path: str, cwd: Path, env: dict[str, str] | None = None) -> Server:
    SHOTS.mkdir(parents=True, exist_ok=True)
    log = SHOTS / f"{name}.log"
    port = _free_port()
    token = secrets.token_hex(16)
    argv = [a.format(port=port, token=token) for a in cmd]
    handle = log.open("wb")
    proc = subprocess.Popen(argv, cwd=cwd, stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            handle.close()
            raise RuntimeError(f"{name} exited with {proc.returncode}; see {log}:\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}{ready_path}?token={token}", timeout=5) as r:
                if r.status == 200:
                    return Server(url, token, log, proc, handle)
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    proc.wait(timeout=20)
    handle.close()
    raise RuntimeError(f"{name} did not answer within 90 s; see {log}")


def _stop(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait(timeout=20)
    server.log_handle.close()


@pytest.fixture(scope="session")
def voila_server() -> Iterator[Server]:
    """Voila serving notebooks/ on 127.0.0.1 (what Binder's Voila link opens)."""
    pytest.importorskip("voila", reason='no voila: pip install -e ".[app]"')
    server = _start(
        [sys.executable, "-m", "voila", "notebooks", "--no-browser", "--port={port}", "--Voila.ip=127.0.0.1",
         "--token={token}", "--show_tracebacks=True"],
        "voila", "/voila/render/app.ipynb", ROOT, env={"MPLBACKEND": "Agg"},
    )
    yield server
    _stop(server)


@pytest.fixture(scope="session")
def lab_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """JupyterLab on a copy of notebooks/ (autosave off, no news toast, every cell kept in the DOM)."""
    pytest.importorskip("jupyterlab", reason='no jupyterlab: pip install -e ".[notebook]"')
    root = tmp_path_factory.mktemp("lab")
    shutil.copytree(ROOT / "notebooks", root / "notebooks")
    settings = root / "settings"
    for plugin, values in {
        "@jupyterlab/apputils-extension/notification": {"fetchNews": "false"},
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
        "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    }.items():
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    server = _start(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--port={port}", "--ServerApp.ip=127.0.0.1",
         "--IdentityProvider.token={token}", "--allow-root", "--expose-app-in-browser",
         f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={root / 'workspaces'}",
         f"--ServerApp.root_dir={root}"],
        "jupyterlab", "/api/status", root, env={"MPLBACKEND": "Agg"},
    )
    yield server
    _stop(server)


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """Headless Debian Chromium through playwright (no downloaded browser)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=_chromium(), args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh page with a desktop-sized viewport; requests outside 127.0.0.1 are blocked and reported."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    blocked: list[str] = []

    def route(r: Any) -> None:
        if r.request.url.startswith(("http://127.0.0.1", "ws://127.0.0.1", "data:", "blob:")):
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()

    pg.route("**/*", route)
    pg.blocked = blocked
    yield pg
    context.close()


def stable_png(locator: Any, tries: int = 10) -> bytes:
    """A screenshot of `locator` taken twice in a row identical (widgets re-render asynchronously)."""
    last = b""
    for _ in range(tries):
        try:
            shot = locator.screenshot()
        except Exception:  # detached in the middle of a re-render: try again
            time.sleep(0.3)
            continue
        if shot == last:
            return shot
        last = shot
        time.sleep(0.3)
    return last


def md5(data: bytes) -> str:
    """Short digest to compare screenshots."""
    return hashlib.md5(data).hexdigest()
