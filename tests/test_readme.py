"""The README is a test: every ``trainmem`` command of its shell blocks and every Python block runs, and
its output has the documented shape (the fields of "What the numbers mean", a verdict, a table).

Commands that need a GPU, a file of yours or minutes of measuring run in a quick form, listed in
`QUICK` with the reason; a README command that is in neither `QUICK` nor runnable as written fails here,
and so does a `QUICK` entry the README no longer has. Repository paths the README names must exist, and
the flags its prose quotes must be flags of the command.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import trainmem_nb as tm
from trainmem_nb.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)

#: Lines of the shell blocks that are not trainmem commands, and where they are tested instead.
ELSEWHERE = {
    "make lab": "tests/test_repository.py runs scripts/lab.sh in dry-run mode",
    "make test": "this suite is what `make test` runs",
    'pip install -e ".[measure]"': "the environment these tests run in",
}


def _shell_lines() -> list[str]:
    out = []
    for lang, body in FENCE.findall(README):
        if lang in ("bash", "sh", "shell"):
            out += [re.sub(r"\s#.*$", "", line).strip() for line in body.splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
    return out


def _python_blocks() -> list[str]:
    return [body for lang, body in FENCE.findall(README) if lang == "python"]


def _fields_documented() -> list[str]:
    """The fields of the "What the numbers mean" table."""
    table = README.split("## What the numbers mean", 1)[1].split("\n\n", 2)[1]
    return [f for row in table.splitlines()[2:] for f in re.findall(r"`(\w+)`", row.split("|")[1])]


FIELDS = _fields_documented()


def _check_estimate_json(data: dict[str, Any]) -> None:
    for field in FIELDS:
        assert field in data, field
    assert sum(data["breakdown_bytes"].values()) == data["peak_allocated_bytes"] > 0
    assert data["peak_phase"] in ("forward", "backward", "optimizer")


def _hf_config(tmp: Path, words: list[str]) -> list[str]:
    """``--hf-config path/to/config.json`` is a placeholder: give it a real config.json (tinyllama's)."""
    from trainmem_nb.model.presets import get_preset

    path = tmp / "config.json"
    path.write_text(json.dumps(get_preset("tinyllama-1.1b").config))
    return [str(path) if w == "path/to/config.json" else w for w in words]


def _cuda_or_refused(tmp: Path, words: list[str]) -> list[str] | None:
    """Needs a CUDA GPU: run as written on one; without, it must be refused in one line naming CUDA."""
    torch = pytest.importorskip("torch")
    return words if torch.cuda.is_available() else None


def _quick_validate(tmp: Path, words: list[str]) -> list[str]:
    """Measures an 80-case matrix (minutes): the same path on one small case."""
    pytest.importorskip("torch")
    return [*words, "--only", "families/llama-tiny-gqa/fp32"]


#: README command -> its quick form (None: expect a clear refusal here), with the reason in the docstring.
QUICK: dict[str, Callable[[Path, list[str]], list[str] | None]] = {
    "trainmem estimate --hf-config path/to/config.json --micro-batch 4 --seq-len 1024 --precision fp32": _hf_config,
    "trainmem measure --model gpt2 --seq-len 1024 --device cuda --save-calibration cal.json": _cuda_or_refused,
    "trainmem validate": _quick_validate,
}
NEEDS_TORCH = ("trainmem measure", "trainmem validate")


def _commands() -> list[str]:
    lines = _shell_lines()
    unknown = [line for line in lines if not line.startswith("trainmem ") and line not in ELSEWHERE]
    assert not unknown, f"README shell lines that are neither trainmem commands nor tested elsewhere: {unknown}"
    return [line for line in lines if line.startswith("trainmem ")]


COMMANDS = _commands()


def test_every_quick_form_is_still_in_the_readme() -> None:
    assert set(QUICK) <= set(COMMANDS), set(QUICK) - set(COMMANDS)
    assert len(COMMANDS) >= 10 and len(_python_blocks()) >= 3


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(c.split()[1:6]) for c in COMMANDS])
def test_readme_command_runs_with_the_documented_output(command: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # files a command writes (cal.json, validation-report/) land here
    words = shlex.split(command)
    if command.startswith(NEEDS_TORCH):
        pytest.importorskip("torch")
    quick = QUICK.get(command)
    argv = quick(tmp_path, words) if quick else words
    if argv is None:  # refused here as it should be: one line, exit 2, naming what is missing
        code, _, err = _run(words[1:], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and "cuda" in err.lower(), err
        return
    code, out, err = _run(argv[1:], capsys)
    assert code == 0, err
    assert "Traceback" not in err
    sub = words[1]
    if "--json" in words:
        data = json.loads(out)
        if sub in ("estimate", "measure"):
            _check_estimate_json(data)
        elif sub == "plan":
            assert {"estimate", "options", "rejected", "notes", "assumptions"} <= set(data)
            assert data["options"] and all(o["gpu"] for o in data["options"])
    elif sub == "estimate":
        assert "peak allocated" in out and "device total" in out
        if "--gpu" in words:
            assert re.match(r"(fits|tight on|OOM on) ", out.strip().splitlines()[-1]), out
    elif sub == "presets":
        rows = [line.split() for line in out.splitlines()]
        assert len(rows) >= 10 and all(len(r) >= 3 for r in rows)
    elif sub == "gpus":
        assert out.startswith("gpu") and "usable" in out.splitlines()[0]
    elif sub == "plan":
        assert "layout" in out and "hours" in out
    elif sub == "validate":
        assert re.search(r"\d+/\d+ cases within", out), out


def _shape(value: Any) -> None:
    """What each kind of result the README's Python shows must look like."""
    from trainmem_nb.planning.fit import Fit
    from trainmem_nb.planning.report import Plan

    if isinstance(value, tm.MemoryEstimate):
        _check_estimate_json(value.to_dict())
    elif isinstance(value, Fit):
        assert value.verdict in ("fits", "tight", "oom") and value.message
    elif isinstance(value, Plan):
        assert value.rows and value.best("gpus") is not None
    elif isinstance(value, dict):
        _check_estimate_json(value)
    elif isinstance(value, int):
        assert value > 0
    elif isinstance(value, tuple):
        assert value and all(hasattr(r, "device_total_bytes") for r in value)


@pytest.fixture(scope="module")
def namespace() -> dict[str, Any]:
    return {}


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_readme_python_block_runs_and_each_result_has_its_shape(index: int, namespace: dict[str, Any],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The blocks run in order in one namespace, as a reader would paste them; every expression is checked."""
    for i in range(index + 1):  # earlier blocks first when this one runs alone
        if i not in namespace.setdefault("_ran", set()):
            tree = ast.parse(_python_blocks()[i])
            for node in tree.body:
                code = compile(ast.Module([node], []), f"README python block {i + 1}", "exec")
                if isinstance(node, ast.Expr):
                    value = eval(compile(ast.Expression(node.value), f"README block {i + 1}", "eval"), namespace)
                    _shape(value)
                else:
                    exec(code, namespace)
            namespace["_ran"].add(i)
    capsys.readouterr()


INLINE_PY = [m for m in re.findall(r"`(tm\.\w+\([^`]*\))`", README)]


@pytest.mark.parametrize("snippet", INLINE_PY)
def test_readme_inline_python_runs(snippet: str) -> None:
    pytest.importorskip("ipywidgets")
    assert eval(snippet, {"tm": tm}) is not None


INLINE_CLI = re.findall(r"`(trainmem \w+[^`]*)`", README)


@pytest.mark.parametrize("snippet", INLINE_CLI)
def test_readme_inline_commands_use_real_flags(snippet: str) -> None:
    words = shlex.split(snippet)
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[words[1]]  # type: ignore[union-attr]
    flags = {f for a in sub._actions for f in a.option_strings}
    for word in words[2:]:
        if word.startswith("--"):
            assert word.split("=")[0] in flags, (snippet, word)


PATHS = sorted({p.rstrip(".,:;") for p in re.findall(r"`((?:trainmem_nb|tests|scripts|validation|benchmarks|notebooks|"
                                                     r"binder)/[^`\s]*)`", README)})


@pytest.mark.parametrize("path", PATHS)
def test_readme_paths_exist(path: str) -> None:
    assert (ROOT / path).exists(), path
