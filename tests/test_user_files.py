"""Nothing a user made is lost: exports never overwrite without --force and leave one plan's files, a
measurement is never thrown away for a bad --out, --remeasure writes only where the user says, a
calibration is never replaced silently, and the measured dataset ships with the package."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trainmem_nb.cli.main import main
from trainmem_nb.errors import SpecError
from trainmem_nb.measure.paths import CASES_FILE
from trainmem_nb.planning.launch import MANIFEST, write_launch_files

ROOT = Path(__file__).resolve().parents[1]
PLAN = ["plan", "--model", "llama-2-13b", "--seq-len", "2048", "--gpu", "H100", "--tokens", "1e9"]
OPTION = {"n_gpus": 4, "nodes": 1, "gpus_per_node": 4, "engine": "fsdp", "zero": 3, "micro_batch": 1,
          "grad_accum": 1, "family": "llama"}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_export_refuses_to_overwrite_user_files_without_force(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    exp = tmp_path / "exp"
    exp.mkdir()
    (exp / "ds_config.json").write_text('{"my": "hand-tuned"}')
    (exp / "launch.sh").write_text("mine")
    code, _, err = run(capsys, *PLAN, "--export", str(exp))
    assert code == 2 and "--export" in err and "would overwrite ds_config.json, launch.sh" in err and "--force" in err
    assert (exp / "ds_config.json").read_text() == '{"my": "hand-tuned"}' and (exp / "launch.sh").read_text() == "mine"
    code, _, err = run(capsys, *PLAN, "--export", str(exp), "--force")
    assert code == 0, err
    assert json.loads((exp / "ds_config.json").read_text())["train_batch_size"] >= 1


def test_export_is_checked_before_the_plan_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import trainmem_nb.planning.search as search

    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the plan ran before --export was checked")

    monkeypatch.setattr(search, "plan", never)
    (tmp_path / "launch.sh").write_text("mine")
    code, _, err = run(capsys, *PLAN, "--export", str(tmp_path))
    assert code == 2 and "would overwrite launch.sh" in err
    file = tmp_path / "afile"
    file.write_text("x")
    code, _, err = run(capsys, *PLAN, "--export", str(file))
    assert code == 2 and f"--export {file}: exists and is not a folder" in err
    code, _, err = run(capsys, *PLAN, "--export", str(tmp_path / "no" / "such"))
    assert code == 2 and "parent folder" in err


def test_export_directory_holds_one_plans_files_with_a_manifest(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    exp = tmp_path / "exp"
    code, _, err = run(capsys, *PLAN, "--export", str(exp))
    assert code == 0, err
    first = json.loads((exp / MANIFEST).read_text())
    assert set(first["files"]) == {"ds_config.json", "accelerate_fsdp.yaml", "launch.sh"}
    assert first["command"].startswith("trainmem plan") and first["option"]["engine"] == "fsdp"
    code, _, err = run(capsys, *PLAN, "--export", str(exp), "--engine", "megatron", "--tp", "8")
    assert code == 2 and "another plan's files" in err  # a second export into the folder needs --force
    (exp / "notes.txt").write_text("my notes")
    code, _, err = run(capsys, *PLAN, "--export", str(exp), "--engine", "megatron", "--tp", "8", "--force")
    assert code == 0, err
    second = json.loads((exp / MANIFEST).read_text())
    assert second["files"] == ["launch.sh"] and second["option"]["tp"] == 8
    assert sorted(p.name for p in exp.iterdir()) == sorted(["launch.sh", MANIFEST, "notes.txt"])  # yours stay


def test_write_launch_files_refuses_existing_files_in_the_api_too(tmp_path: Path) -> None:
    (tmp_path / "launch.sh").write_text("mine")
    with pytest.raises(SpecError, match=r"would overwrite launch\.sh"):
        write_launch_files(OPTION, tmp_path)
    assert (tmp_path / "launch.sh").read_text() == "mine"
    assert [p.name for p in write_launch_files(OPTION, tmp_path, force=True)][-1] == "launch.sh"


@pytest.fixture
def fake_step(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """`trainmem measure` without torch: require_torch records the call, measure returns a stub result."""
    import trainmem_nb.measure.api as api
    import trainmem_nb.measure.extra as extra

    calls: list[str] = []

    class Result:
        def to_dict(self, timeline: bool = True) -> dict[str, Any]:
            return {"peak_allocated_bytes": 123, "model": "gpt2"}

        def summary(self) -> str:
            return "gpt2: peak allocated 123 B (stub)"

    monkeypatch.setattr(extra, "require_torch", lambda: calls.append("torch"))
    monkeypatch.setattr(api, "measure", lambda *a, **k: calls.append("step") or Result())
    return calls


MEASURE = ["measure", "--model", "gpt2", "--seq-len", "128", "--device", "fake"]


def test_measure_checks_out_before_the_step_and_never_loses_the_result(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_step: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    code, _, err = run(capsys, *MEASURE, "--out", "/nonexistent-dir/x.json")
    assert code == 2 and "--out /nonexistent-dir/x.json: the folder /nonexistent-dir does not exist" in err
    assert fake_step == []  # refused before torch was even imported, let alone the step run
    existing = tmp_path / "x.json"
    existing.write_text("mine")
    code, _, err = run(capsys, *MEASURE, "--out", str(existing))
    assert code == 2 and "exists; pass --force" in err and existing.read_text() == "mine" and fake_step == []

    import trainmem_nb.files as files

    def full_disk(path: Any, text: str) -> Path:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "write_text_atomic", full_disk)
    code, out, err = run(capsys, *MEASURE, "--out", str(tmp_path / "new.json"))
    assert fake_step == ["torch", "step"]
    assert "peak allocated 123 B" in out  # the measurement is on the screen
    assert code == 2 and "could not write (No space left on device); the measurement is printed above" in err


def test_measure_out_written_after_the_result_is_printed(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                         fake_step: list[str]) -> None:
    out_file = tmp_path / "m.json"
    code, _, err = run(capsys, *MEASURE, "--out", str(out_file))
    assert code == 0, err
    assert json.loads(out_file.read_text())["peak_allocated_bytes"] == 123
    code, _, err = run(capsys, *MEASURE, "--out", str(out_file), "--force")
    assert code == 0, err


def test_save_calibration_is_checked_before_torch(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                  fake_step: list[str]) -> None:
    cal = tmp_path / "cal.json"
    cal.write_text('{"calibration": {}}')
    code, _, err = run(capsys, "measure", "--model", "gpt2", "--device", "cuda", "--save-calibration", str(cal))
    assert code == 2 and "--save-calibration" in err and "exists; pass --force" in err
    assert fake_step == [] and cal.read_text() == '{"calibration": {}}'


def test_save_calibration_never_replaces_an_existing_file_silently(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from trainmem_nb.measure.cuda import write_calibration

    class Measured:
        gpu_name, mode = "stub", "cuda"

        def to_dict(self, timeline: bool = True) -> dict[str, Any]:
            return {}

    import trainmem_nb.measure.calibration as calibration
    from trainmem_nb.spec.calibration import Calibration

    original = calibration.calibration_from
    calibration.calibration_from = lambda m: Calibration(gpu_name="stub")  # type: ignore[assignment]
    try:
        cal = tmp_path / "cal.json"
        cal.write_text("mine")
        with pytest.raises(SpecError, match="exists; pass --force"):
            write_calibration(Measured(), cal)
        assert cal.read_text() == "mine"
        write_calibration(Measured(), cal, force=True)
        assert json.loads(cal.read_text())["calibration"]["gpu_name"] == "stub"
    finally:
        calibration.calibration_from = original  # type: ignore[assignment]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_remeasure_writes_only_into_the_folder_the_user_names(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                              fake_step: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import trainmem_nb.measure.dataset as dataset

    before = _digest(CASES_FILE)
    lines = [line for line in CASES_FILE.read_text().splitlines() if '"id":"families/gpt2' in line][:2]
    written: list[Path] = []

    def regenerate(out: Path, only: str = "", keep: bool = False, jobs: int = 1, **kw: Any) -> tuple[int, list[Any]]:
        written.append(Path(out))
        Path(out).write_text("\n".join(lines) + "\n")
        return len(lines), []

    monkeypatch.setattr(dataset, "regenerate", regenerate)
    report = tmp_path / "report"
    code, _, err = run(capsys, "validate", "--remeasure", "--out", str(report))
    assert code in (0, 1), err
    assert written == [report / "cases.jsonl"]
    assert (report / "SUMMARY.md").exists() and (report / "validation.json").exists()
    assert _digest(CASES_FILE) == before  # the shipped dataset is untouched
    code, _, err = run(capsys, "validate", "--remeasure", "--out", str(report))
    assert code == 2 and "cases.jsonl: exists; pass --force" in err


@pytest.mark.slow
def test_installed_wheel_validates_from_the_shipped_dataset(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(ROOT / "trainmem_nb", src / "trainmem_nb", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src),
                    "-w", str(wheels)], check=True, capture_output=True)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
                    *map(str, wheels.glob("*.whl"))], check=True, capture_output=True)
    script = ("import sys, trainmem_nb; print(trainmem_nb.__file__); from trainmem_nb.cli.main import main; "
              f"sys.exit(main(['validate', '--from-dataset', '--only', 'families/gpt2', '--out', {str(tmp_path / 'r')!r}]))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                          env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "MPLBACKEND": "Agg"})
    assert proc.returncode in (0, 1), proc.stderr
    assert proc.stdout.startswith(str(site))  # the installed copy ran, not the checkout
    assert "cases within" in proc.stdout
