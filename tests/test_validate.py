"""The shipped dataset (validation/) and `trainmem validate`'s plumbing; no torch needed here.

These tests check files, coverage, provenance and exit codes, not the estimator's accuracy (the
estimator's own tests compare it with every stored case).
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trainmem_nb.cli.main import main
from trainmem_nb.measure import validate
from trainmem_nb.measure.dataset import CASES_FILE, HARNESS_FILE, load_cases
from trainmem_nb.model.families import Family
from trainmem_nb.spec.choices import Checkpointing

#: the harness's result files, copied from ../shared/harness/results (scripts/sync_shared_data.py)
SHARED_RESULTS = Path(__file__).resolve().parent / "data" / "shared" / "harness_results"


def test_cases_load_without_torch() -> None:
    proc = subprocess.run(
        [sys.executable, "-c",
         "import sys\n"
         "sys.modules['torch'] = None\n"
         "from trainmem_nb.measure.dataset import load_cases\n"
         "cases = load_cases()\n"
         "assert all(sum(c.measurement.breakdown_bytes.values()) == c.measurement.peak_allocated_bytes for c in cases)\n"
         "print(len(cases))\n"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) == len(CASES_FILE.read_text().splitlines())


def test_every_case_has_provenance() -> None:
    for case in load_cases():
        w = case.measurement.measured_with
        assert case.id and case.group and case.source
        assert case.mode in ("fake", "cpu") and case.training.device.value == "cpu"
        for key in ("torch", "transformers", "peft", "python", "threads", "date", "timing"):
            assert key in w, (case.id, key)
        assert case.measurement.peak_phase in ("forward", "backward", "optimizer")


def test_dataset_covers_every_family_and_option() -> None:
    cases = load_cases()
    assert len(cases) >= 150
    seen: dict[str, set[Any]] = {k: set() for k in ("family", "precision", "optimizer", "impl", "ckpt", "attention",
                                                     "dropout", "lora", "kv", "tied", "bias", "mode")}
    for c in cases:
        m, t = c.model, c.training
        seen["family"].add(m.family.value)
        seen["precision"].add(t.precision.value)
        seen["optimizer"].add(t.optimizer.value)
        seen["impl"].add(t.resolved_optimizer_impl.value)
        seen["ckpt"].add(t.checkpointing.value)
        seen["attention"].add(t.attention.value)
        seen["dropout"].add(t.dropout)
        seen["lora"].add(t.lora_targets if t.method.value == "lora" else "full")
        seen["kv"].add(m.n_kv_heads < m.n_heads)
        seen["tied"].add(m.tie_embeddings)
        seen["bias"].add(m.qkv_bias)
        seen["mode"].add(c.mode)
    assert seen["family"] == {f.value for f in Family}
    assert {"fp32", "bf16-mixed", "bf16-true"} <= seen["precision"]
    assert {"adamw", "sgd", "sgd-momentum", "adafactor", "none"} <= seen["optimizer"]
    assert {"foreach", "fused", "for-loop"} <= seen["impl"]
    assert seen["ckpt"] == {c.value for c in Checkpointing}
    assert seen["attention"] == {"sdpa", "eager"}
    assert {0.0, 0.1} <= seen["dropout"]
    assert {"full", "qv", "all-linear"} <= seen["lora"]
    assert seen["kv"] == seen["tied"] == seen["bias"] == {True, False}
    assert seen["mode"] == {"fake", "cpu"}
    for family in Family:
        shapes = {c.model.name for c in cases if c.model.family is family}
        assert len(shapes) >= 3, (family.value, shapes)


def test_harness_copy_keeps_its_provenance_and_numbers() -> None:
    doc = json.loads(HARNESS_FILE.read_text())
    assert doc["n_cases"] == len(doc["cases"]) == 46
    assert doc["harness_versions"] and doc["copied_on"]
    for case in doc["cases"]:
        assert case["source"].startswith("shared/harness/results/")
        source = SHARED_RESULTS / Path(case["source"]).name  # the harness's own file, always in the repository
        live = json.loads(source.read_text())["live"]
        assert case["peak_cuda512_bytes"] == live["peak_cuda512"]
        assert case["peak_cuda512_breakdown"] == live["peak_cuda512_breakdown"]


def test_stored_remeasurements_agree_with_the_harness_within_one_percent() -> None:
    from trainmem_nb.measure.report import harness_agreement

    rows = harness_agreement(CASES_FILE, HARNESS_FILE)
    assert len(rows) == 46 and not any(r.get("missing") for r in rows)
    for r in rows:
        assert abs(r["peak_rel_err"]) <= 0.01, r["id"]
        assert r["phase_ours"] == r["phase_harness"], r["id"]
        assert all(abs(e) <= 0.01 for e in r["category_rel_err"].values()), r["id"]


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_validate_from_dataset_writes_a_table_a_csv_and_a_chart(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["validate", "--from-dataset", "--only", "families/", "--tolerance", "0", "--out", str(tmp_path)])
    capsys.readouterr()
    assert code in (0, 1)  # whatever the estimator's accuracy today: this test is about the plumbing
    rows = _rows(tmp_path / "validation.csv")
    assert code == (0 if all(r["within_tolerance"] == "True" for r in rows) else 1)
    assert len(rows) == sum(1 for c in load_cases() if "families/" in c.id)
    assert {"peak_err", "weights_err", "activations_err", "phase_ok", "within_tolerance"} <= set(rows[0])
    md = (tmp_path / "validation.md").read_text()
    assert md.count("\n| `families/") == len(rows)
    assert (tmp_path / "validation.png").exists() or "chart skipped" in md


def test_validate_fails_when_a_peak_is_off_by_one_byte_at_zero_tolerance(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def off_by_one(m: Any) -> dict[str, Any]:
        d = m.to_dict()
        d["peak_allocated_bytes"] += 1
        return d

    monkeypatch.setattr(validate, "_estimate_dict", off_by_one)
    code = main(["validate", "--from-dataset", "--only", "presets/gpt2", "--tolerance", "0", "--out", str(tmp_path)])
    capsys.readouterr()
    assert code == 1
    assert all(r["within_tolerance"] == "False" for r in _rows(tmp_path / "validation.csv"))


def test_validate_passes_when_the_estimate_equals_the_measurement(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(validate, "_estimate_dict", lambda m: m.to_dict())
    code = main(["validate", "--from-dataset", "--only", "presets/gpt2", "--tolerance", "0", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    rows = _rows(tmp_path / "validation.csv")
    assert rows and all(r["within_tolerance"] == "True" and float(r["peak_err"]) == 0.0 for r in rows)
    assert f"{len(rows)}/{len(rows)} cases within" in out


def test_validate_reports_an_estimator_failure_as_a_failed_case(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    def broken(m: Any) -> dict[str, Any]:
        raise NotImplementedError("no recipe")

    monkeypatch.setattr(validate, "_estimate_dict", broken)
    code = main(["validate", "--from-dataset", "--only", "families/bert-tiny", "--tolerance", "1", "--out", str(tmp_path)])
    capsys.readouterr()
    assert code == 1
    assert all("NotImplementedError: no recipe" in r["error"] for r in _rows(tmp_path / "validation.csv"))


@pytest.mark.parametrize("args", [["--tolerance", "-0.1"], ["--only", "no-such-case"]])
def test_validate_bad_input_is_one_line_exit_2(args: list[str], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["validate", "--from-dataset", "--out", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
