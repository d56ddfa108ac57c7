"""A repo id that is not a preset is read from the Hugging Face Hub with the real huggingface_hub client,
here against a local HTTP server on 127.0.0.1 that serves the Hub's file paths (``HF_ENDPOINT``): no mock
of the client, nothing from the internet. Each case runs in a fresh interpreter (huggingface_hub reads
its environment at import)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")

CONFIG = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}
TOKEN = "hf_local_test_token"
#: repo id -> (config.json or None for no such file, gated)
REPOS = {"acme/tiny-llama": (CONFIG, False), "acme/gated-llama": (CONFIG, True), "acme/no-config": (None, False)}


class _Hub(BaseHTTPRequestHandler):
    """The Hub's ``/{repo}/resolve/{revision}/{file}`` for a few repos, with its headers and error codes."""

    def _answer(self, body: bool) -> None:
        parts = self.path.split("?")[0].strip("/").split("/")
        repo = "/".join(parts[:2])
        if len(parts) < 5 or parts[2] != "resolve" or repo not in REPOS:
            return self._error(404, "RepoNotFound", "Repository Not Found")
        config, gated = REPOS[repo]
        if gated and self.headers.get("authorization") != f"Bearer {TOKEN}":
            return self._error(401, "GatedRepo", "Access to this model is restricted")
        if config is None or parts[4] != "config.json":
            return self._error(404, "EntryNotFound", "Entry not found")
        data = json.dumps(config).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
        self.send_header("X-Repo-Commit", "0" * 40)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _error(self, status: int, code: str, message: str) -> None:
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def hub() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _estimate(model: str, hub: str, cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    code = ("import trainmem_nb as tm, sys\n"
            "try:\n"
            f"    e = tm.estimate({model!r}, micro_batch=1, seq_len=64)\n"
            "    print(e.model.name, e.n_params)\n"
            "except tm.SpecError as exc:\n"
            "    print('SpecError:', exc)\n")
    full = {**os.environ, "HF_ENDPOINT": hub, "HF_HOME": str(cache), "HF_HUB_DISABLE_TELEMETRY": "1", **env}
    for key in ("HF_TOKEN", "HF_HUB_OFFLINE"):
        if key not in env:
            full.pop(key, None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=60)


def test_a_repo_id_that_is_no_preset_is_read_from_the_hub_and_then_from_its_cache(hub: str, tmp_path: Path) -> None:
    first = _estimate("acme/tiny-llama", hub, tmp_path)
    assert first.stdout.startswith("acme/tiny-llama "), first.stdout + first.stderr
    from trainmem_nb.model.spec import ModelSpec

    assert int(first.stdout.split()[1]) == ModelSpec.from_hf_config(CONFIG).n_params
    offline = _estimate("acme/tiny-llama", "http://127.0.0.1:9", tmp_path, HF_HUB_OFFLINE="1")
    assert offline.stdout == first.stdout


def test_offline_without_a_cached_copy_says_so_and_how_to_pass_a_local_config(hub: str, tmp_path: Path) -> None:
    out = _estimate("acme/tiny-llama", hub, tmp_path, HF_HUB_OFFLINE="1").stdout
    assert out.startswith("SpecError:") and "HF_HUB_OFFLINE" in out and "--hf-config" in out, out
    assert out.count("\n") == 1


def test_an_unknown_repo_is_refused_in_one_line_naming_the_presets_and_a_local_config(hub: str, tmp_path: Path) -> None:
    out = _estimate("acme/nothing-here", hub, tmp_path).stdout
    assert out.startswith("SpecError: model='acme/nothing-here' is neither a preset nor a repository"), out
    assert "trainmem presets" in out and "--hf-config" in out


def test_a_gated_repo_needs_a_token_and_reads_with_one(hub: str, tmp_path: Path) -> None:
    refused = _estimate("acme/gated-llama", hub, tmp_path).stdout
    assert refused.startswith("SpecError: model='acme/gated-llama' is a gated repository") and "HF_TOKEN" in refused
    assert _estimate("acme/gated-llama", hub, tmp_path, HF_TOKEN=TOKEN).stdout.startswith("acme/gated-llama ")


def test_a_repo_without_a_config_json_says_so(hub: str, tmp_path: Path) -> None:
    assert "has no config.json" in _estimate("acme/no-config", hub, tmp_path).stdout


def test_an_unreachable_hub_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    out = _estimate("acme/tiny-llama", "http://127.0.0.1:9", tmp_path)
    assert out.stdout.startswith("SpecError:") and "cannot be" in out.stdout and out.returncode == 0, out.stderr
    assert "Retrying" not in out.stderr, out.stderr  # huggingface_hub's five backoffs (about 24 s) are not waited


def test_an_unreachable_hub_reads_a_cached_config_at_once_without_offline_mode(hub: str, tmp_path: Path) -> None:
    first = _estimate("acme/tiny-llama", hub, tmp_path)
    again = _estimate("acme/tiny-llama", "http://127.0.0.1:9", tmp_path)
    assert again.stdout == first.stdout and "Retrying" not in again.stderr, again.stderr


def test_importing_and_estimating_a_preset_touch_no_hub() -> None:
    code = ("import sys, trainmem_nb as tm; tm.estimate('llama-3-8b', micro_batch=1, seq_len=64); "
            "print('huggingface_hub' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_the_cli_reads_a_repo_id_from_the_hub_and_refuses_an_unknown_one_in_one_line(hub: str, tmp_path: Path) -> None:
    env = {**os.environ, "HF_ENDPOINT": hub, "HF_HOME": str(tmp_path), "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    run = [sys.executable, "-m", "trainmem_nb.cli.main", "estimate", "--seq-len", "64", "--json", "--model"]
    ok = subprocess.run([*run, "acme/tiny-llama"], capture_output=True, text=True, env=env, timeout=60)
    assert ok.returncode == 0, ok.stderr
    from trainmem_nb.model.spec import ModelSpec

    assert json.loads(ok.stdout)["n_params"] == ModelSpec.from_hf_config(CONFIG).n_params
    bad = subprocess.run([*run, "acme/nothing-here"], capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "is neither a preset nor a repository" in bad.stderr, bad.stderr


def test_behind_a_proxy_the_hub_is_left_to_the_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTPS_PROXY or ALL_PROXY: a direct connection says nothing about what the client (through the proxy) reaches."""
    from trainmem_nb.model.hub import _reachable

    for key in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(key, raising=False)
    assert not _reachable("http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("ALL_PROXY", "socks5://127.0.0.1:1080")
    assert _reachable("http://127.0.0.1:9")
