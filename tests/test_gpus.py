"""The GPU catalog and the price snapshot: faithful to ../shared/data, names that resolve, users' own files."""

from __future__ import annotations

import csv
import doctest
import json
import re
import sys
from datetime import date, datetime
from importlib import resources
from pathlib import Path

import pytest

import trainmem_nb.planning.gpus as gpus_module
from trainmem_nb.errors import SpecError
from trainmem_nb.planning.gpus import GPU, get_gpu, list_gpus, list_prices, load_gpus, load_prices, snapshot_date

#: copies of ../shared/data kept in the repository (scripts/sync_shared_data.py; sha256 in SOURCES.md there)
SHARED = Path(__file__).resolve().parent / "data" / "shared"


def _data_rows(name: str) -> list[dict[str, str]]:
    with resources.files("trainmem_nb").joinpath(f"data/{name}").open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("name", ["gpus.csv", "prices_snapshot.csv"])
def test_packaged_copies_keep_every_shared_cell_and_source(name: str) -> None:
    with (SHARED / name).open(newline="", encoding="utf-8") as f:
        shared = list(csv.DictReader(f))
    ours = _data_rows(name)
    assert len(ours) == len(shared)
    for theirs, mine in zip(shared, ours, strict=True):
        assert {k: mine[k] for k in theirs} == theirs


def test_every_catalog_row_loads_with_its_source_and_confidence() -> None:
    gpus = list_gpus()
    assert len(gpus) == len(_data_rows("gpus.csv"))
    assert len({g.name for g in gpus}) == len(gpus)
    for g in gpus:
        assert g.source.startswith("http") and g.confidence in ("high", "medium", "low")
        assert g.memory_bytes > 0 and g.gpus_per_node >= 1


def test_usable_memory_is_the_nvidia_smi_total_where_one_was_seen() -> None:
    for row in _data_rows("gpus.csv"):
        g = get_gpu(row["name"])
        if row["nvidia_smi_total_mib"] and row["devices_per_package"] == "1":
            assert g.memory_bytes == int(row["nvidia_smi_total_mib"]) << 20
            assert g.memory_bytes_source == "nvidia-smi"
        else:  # derived, and below what is marketed
            assert g.memory_bytes_source.startswith("derived")
            assert g.memory_bytes < float(row["memory_gib"]) / int(row["devices_per_package"]) * 2**30


def test_datacenter_gddr_without_a_seen_total_loses_one_sixteenth_to_ecc() -> None:
    # ../shared/data/README.md: L40S (ECC on) shows 46068 MiB; the L40 has no seen total
    l40, l40s = get_gpu("L40"), get_gpu("L40S")
    assert abs(l40.memory_bytes - l40s.memory_bytes) / l40s.memory_bytes < 0.002


def test_throughput_is_dense_not_the_sparse_datasheet_figure() -> None:
    # NVIDIA prints H100 SXM "1,979 TFLOPS BF16" with 2:4 sparsity; dense is half (shared README)
    assert get_gpu("H100").bf16_tflops == pytest.approx(1979 / 2, abs=0.1)


def test_mi250x_is_two_devices_of_half_the_package() -> None:
    row = next(r for r in _data_rows("gpus.csv") if r["short_name"].startswith("MI250X"))
    g = get_gpu("MI250X")
    assert g.devices_per_package == 2
    assert g.bf16_tflops == pytest.approx(float(row["bf16_dense_tflops"]) / 2)
    assert g.memory_marketed_gb == pytest.approx(float(row["memory_gib"]) / 2)


def test_cards_without_bf16_offer_fp16_only() -> None:
    for name in ("V100", "T4"):
        g = get_gpu(name)
        assert not g.supports_bf16
        assert g.dense_tflops("bf16-mixed") is None
        assert g.dense_tflops("fp16-mixed") == g.fp16_tflops


@pytest.mark.parametrize(("alias", "expected"), [
    ("H100", "H100 SXM 80GB"), ("h100-80gb", "H100 SXM 80GB"), ("A100 80GB", "A100 SXM 80GB"),
    ("NVIDIA L40S", "L40S 48GB"), ("NVIDIA GeForce RTX 4090", "RTX 4090 24GB"), ("rtx-4090", "RTX 4090 24GB"),
    ("mi300x", "MI300X 192GB"), ("TPU v5e", "TPU v5e"), ("h200", "H200 SXM 141GB"), ("a100 pcie", "A100 PCIe 80GB"),
])
def test_names_resolve_case_insensitively_through_aliases(alias: str, expected: str) -> None:
    assert get_gpu(alias).name == expected


def test_an_ambiguous_name_lists_the_candidates() -> None:
    with pytest.raises(SpecError, match=r"matches several GPUs: .*H100 NVL.*H100 PCIe.*H100 SXM"):
        get_gpu("H10")


def test_an_unknown_name_suggests_the_closest() -> None:
    with pytest.raises(SpecError, match=r"unknown gpu 'A1OO'.*did you mean"):
        get_gpu("A1OO")


def test_own_gpus_from_dicts_resolve_before_the_catalog() -> None:
    mine = load_gpus([{"name": "lab-card", "memory_gib": 24, "bf16_dense_tflops": 80, "aliases": "lab|card"}])
    assert get_gpu("LAB", mine).name == "lab-card"
    assert mine[0].memory_bytes < 24 * 2**30 and mine[0].memory_bytes_source.startswith("derived")


def test_own_gpus_from_csv_and_json_files(tmp_path: Path) -> None:
    rows = [{"name": "box-a", "memory_bytes": str(20 << 30), "bf16_tflops": "50", "gpus_per_node": "4"}]
    with (tmp_path / "g.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (tmp_path / "g.json").write_text(json.dumps({"gpus": rows}))
    for path in (tmp_path / "g.csv", tmp_path / "g.json"):
        (g,) = load_gpus(path)
        assert (g.name, g.memory_bytes, g.bf16_tflops, g.gpus_per_node) == ("box-a", 20 << 30, 50.0, 4)


def test_own_gpus_from_yaml_when_pyyaml_is_installed(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    (tmp_path / "g.yaml").write_text("- name: box-b\n  memory_gib: 48\n  memory_type: GDDR6\n  segment: workstation\n")
    (g,) = load_gpus(tmp_path / "g.yaml")
    assert g.name == "box-b" and g.memory_bytes < 48 * 2**30


def test_yaml_without_pyyaml_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "g.yaml").write_text("- name: x\n")
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    with pytest.raises(SpecError, match="needs PyYAML"):
        load_gpus(tmp_path / "g.yaml")


def test_a_bad_gpu_column_is_named_with_a_suggestion() -> None:
    with pytest.raises(SpecError, match=r"unknown GPU column 'memory_gb'.*did you mean"):
        load_gpus([{"name": "x", "memory_gb": 24}])
    with pytest.raises(SpecError, match="needs memory_bytes"):
        load_gpus([{"name": "x", "bf16_tflops": 10}])


def test_every_snapshot_price_is_dated_and_names_a_catalog_gpu() -> None:
    names = {g.name for g in list_gpus()}
    prices = list_prices()
    assert prices
    for p in prices:
        assert p.date_seen and p.source
        assert p.gpu == "" or p.gpu in names
    iso = [p.date_seen for p in prices if re.fullmatch(r"\d{4}-\d{2}-\d{2}", p.date_seen)]
    assert snapshot_date() == max(iso)


def test_billing_granularity_is_read_from_the_providers_wording() -> None:
    by = {(p.provider, p.gpu_label): p for p in list_prices()}
    aws = by[("AWS", "H100 SXM 80GB")]
    assert (aws.billing_granularity_s, aws.minimum_billed_s) == (1, 60)  # per second, 60 s minimum
    assert by[("Lambda", "H100 SXM 80GB")].billing_granularity_s == 60  # per minute
    assert by[("Nebius", "H100 SXM 80GB")].billing_granularity_s is None  # not stated


def test_prices_are_per_gpu_hour_for_multi_gpu_instances() -> None:
    # AWS p5.48xlarge: the snapshot's note gives the instance price; the row is per GPU
    p5 = next(p for p in list_prices("H100") if p.provider == "AWS")
    instance = float(re.search(r"\$([\d.]+)/h", p5.notes).group(1))  # type: ignore[union-attr]
    assert p5.on_demand_usd_per_gpu_hour == pytest.approx(instance / p5.gpus_per_instance, rel=1e-3)


def test_own_prices_from_a_plain_dict_and_from_rows() -> None:
    (p,) = load_prices({"a100 80gb": 1.5})
    assert (p.gpu, p.on_demand_usd_per_gpu_hour, p.provider) == ("A100 SXM 80GB", 1.5, "yours")
    (q,) = load_prices([{"provider": "lab", "gpu": "H100", "spot_usd_per_gpu_hour": "1.1",
                         "billing_granularity": "per hour", "date_seen": "2026-01-02"}])
    assert (q.gpu, q.spot_usd_per_gpu_hour, q.billing_granularity_s) == ("H100 SXM 80GB", 1.1, 3600)
    with pytest.raises(SpecError, match="unknown price column"):
        load_prices([{"gpu": "H100", "price": 2}])


def test_gpu_is_frozen_and_rejects_unknown_fields() -> None:
    g = get_gpu("H100")
    with pytest.raises(ValueError):
        g.memory_bytes = 1  # type: ignore[misc]
    with pytest.raises(ValueError):
        GPU(name="x", memory_bytes=1, colour="red")  # type: ignore[call-arg]


def test_module_examples_run() -> None:
    assert doctest.testmod(gpus_module).failed == 0


def test_an_unquoted_yaml_date_seen_is_read_as_iso_text(tmp_path: Path) -> None:
    # YAML loads `date_seen: 2025-01-01` as a datetime.date, not a string
    pytest.importorskip("yaml")
    (tmp_path / "p.yaml").write_text("- gpu: H100\n  provider: lab\n  on_demand_usd_per_gpu_hour: 2.0\n"
                                     "  date_seen: 2025-01-01\n")
    (p,) = load_prices(tmp_path / "p.yaml")
    assert p.date_seen == "2025-01-01" and snapshot_date([p]) == "2025-01-01"


def test_date_and_datetime_cells_become_iso_text_in_prices_and_gpus() -> None:
    (p,) = load_prices([{"gpu": "H100", "on_demand_usd_per_gpu_hour": 2.0, "date_seen": date(2025, 1, 1)}])
    assert p.date_seen == "2025-01-01"
    (q,) = load_prices([{"gpu": "H100", "on_demand_usd_per_gpu_hour": 2.0,
                         "date_seen": datetime(2025, 1, 2, 9, 30)}])
    assert q.date_seen == "2025-01-02T09:30:00" and snapshot_date([p, q]) == "2025-01-02"
    (g,) = load_gpus([{"name": "lab-card", "memory_gib": 24, "notes": date(2025, 3, 4)}])
    assert g.notes == "2025-03-04"
