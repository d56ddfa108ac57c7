"""Accelerators and their prices: what a GPU can hold, how fast it computes and talks, what an hour costs.

The catalog (``data/gpus.csv``) and the price snapshot (``data/prices_snapshot.csv``) are copies of
``../shared/data`` with their sources kept per row; ``data/SOURCES.md`` says what was added. Memory is
``int`` bytes (``GPU.memory_bytes`` is the total ``nvidia-smi`` reports, the ceiling a training process
sees); throughput is *dense* TFLOPS (10**12 FLOP/s, never the 2:4-sparse datasheet figure); bandwidth is
decimal GB/s. Prices are USD per GPU-hour from a dated snapshot: show ``Price.date_seen`` with any price.

>>> from trainmem_nb.planning.gpus import get_gpu
>>> h100 = get_gpu("h100-80gb")
>>> h100.name, h100.memory_bytes // 2**20, h100.bf16_tflops
('H100 SXM 80GB', 81559, 989.5)
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Mapping
from datetime import date, datetime
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import Field

from ..errors import SpecError, did_you_mean, finite_number, parse_json, read_text_file, whole_number
from ..spec.base import _FROZEN, SpecModel

__all__ = [
    "ECC_GDDR_FRACTION",
    "GPU",
    "USABLE_FRACTION_GDDR",
    "USABLE_FRACTION_HBM",
    "Price",
    "get_gpu",
    "list_gpus",
    "list_prices",
    "load_gpus",
    "load_prices",
    "snapshot_date",
]

MIB = 1 << 20
GIB = 1 << 30

#: Usable share of the marketed HBM capacity where no nvidia-smi total was seen: the lowest ratio among
#: the catalog rows that have one (B200: 183359 MiB of 180 GiB = 0.9948; H100 0.9956, H200 0.9958).
USABLE_FRACTION_HBM = 0.9948
#: The same for GDDR cards with ECC off (RTX 4090: 24564 MiB of 24576 MiB).
USABLE_FRACTION_GDDR = 0.9995
#: ECC on a GDDR card costs ~1/16 of its capacity (../shared/data/README.md: L40S/A40 show 46068 MiB of
#: 48 GiB). Datacenter GDDR cards run with ECC on in clouds, so derived totals take it off.
ECC_GDDR_FRACTION = 15 / 16

class GPU(SpecModel):
    """One accelerator as a training process sees it (one software device: an MI250X is two).

    >>> g = GPU(name="my-card", memory_bytes=24 * 2**30, bf16_tflops=100.0)
    >>> g.interconnect_kind, g.gpus_per_node
    ('pcie', 8)
    """

    model_config = _FROZEN

    name: str = Field(min_length=1, description="short name, e.g. 'H100 SXM 80GB'")
    full_name: str = Field(default="", description="the catalog's name, e.g. 'NVIDIA H100 SXM 80GB'")
    aliases: tuple[str, ...] = ()
    vendor: str = "NVIDIA"
    architecture: str = ""
    form_factor: str = ""
    segment: str = "datacenter"
    release_year: int | None = None
    memory_bytes: int = Field(gt=0, description="usable total: what nvidia-smi reports as memory.total")
    memory_bytes_source: str = Field(default="given", description="'nvidia-smi' when seen, else how it was derived")
    memory_marketed_gb: float | None = Field(default=None, gt=0, description="the '80' of '80GB' (binary-sized)")
    memory_marketed_label: str = ""
    memory_type: str = ""
    memory_bandwidth_gbs: float | None = Field(default=None, gt=0, description="device memory, decimal GB/s")
    bf16_tflops: float | None = Field(default=None, gt=0, description="dense bf16 tensor TFLOPS")
    fp16_tflops: float | None = Field(default=None, gt=0, description="dense fp16 tensor TFLOPS")
    fp8_tflops: float | None = Field(default=None, gt=0, description="dense fp8 tensor TFLOPS")
    tf32_tflops: float | None = Field(default=None, gt=0, description="dense tf32 tensor TFLOPS")
    supports_bf16: bool = True
    supports_fp8: bool = False
    interconnect: str = Field(default="", description="scale-up link and host link, as the datasheet says")
    interconnect_bidir_gbs: float | None = Field(default=None, gt=0, description="per-device bidirectional GB/s")
    pcie_bidir_gbs: float | None = Field(default=None, ge=0, description="host link, bidirectional GB/s")
    gpus_per_node: int = Field(default=8, ge=1, le=4096, description="typical GPUs in one server")
    nvlink_domain: int = Field(default=1, ge=1, description="GPUs sharing the fast scale-up link (1: PCIe only)")
    devices_per_package: int = Field(default=1, ge=1, le=8, description="software devices per package (MI250X: 2)")
    perf_class: str = Field(default="generic", description="key into the planner's MFU defaults")
    tdp_w: float | None = Field(default=None, gt=0)
    confidence: str = ""
    notes: str = ""
    source: str = ""

    @property
    def interconnect_kind(self) -> str:
        """'nvswitch', 'nvlink', 'infinity-fabric', 'ici', 'roce' or 'pcie' (no fast GPU-to-GPU link)."""
        if self.nvlink_domain <= 1:
            return "pcie"
        text = self.interconnect.lower()
        for key, kind in (("nvswitch", "nvswitch"), ("nvl72", "nvswitch"), ("infinity fabric", "infinity-fabric"),
                          ("ici", "ici"), ("roce", "roce"), ("nvlink", "nvlink")):
            if key in text:
                return kind
        return "nvlink"

    @property
    def scale_up_bidir_gbs(self) -> float | None:
        """Bidirectional GB/s between GPUs of one fast domain (the PCIe figure for PCIe-only cards)."""
        if self.nvlink_domain <= 1:
            return self.pcie_bidir_gbs or self.interconnect_bidir_gbs
        return self.interconnect_bidir_gbs

    def dense_tflops(self, precision: str) -> float | None:
        """Dense peak for a `trainmem_nb.spec.choices.Precision` value; fp32 uses TF32 tensor cores (``None`` if unknown)."""
        if precision.startswith("bf16"):
            return self.bf16_tflops if self.supports_bf16 else None
        if precision.startswith("fp16"):
            return self.fp16_tflops
        return self.tf32_tflops

    def __str__(self) -> str:
        return self.name


class Price(SpecModel):
    """USD per GPU-hour for one GPU at one provider, as seen on ``date_seen`` (a snapshot: re-check it)."""

    model_config = _FROZEN

    provider: str
    gpu: str = Field(description="the catalog GPU it applies to ('' when the source does not say which)")
    gpu_label: str = Field(default="", description="the GPU as the source wrote it")
    instance: str = ""
    gpus_per_instance: int = Field(default=1, ge=1)
    on_demand_usd_per_gpu_hour: float | None = Field(default=None, ge=0)
    spot_usd_per_gpu_hour: float | None = Field(default=None, ge=0)
    billing_granularity: str = ""
    billing_granularity_s: int | None = Field(default=None, ge=1, description="None: not stated")
    minimum_billed_s: int = Field(default=0, ge=0)
    date_seen: str = ""
    source: str = ""
    notes: str = ""


# ----------------------------------------------------------------------------------------------------------
# Reading rows

#: Shared-catalog column -> GPU field.
_COLUMN_TO_FIELD = {
    "memory_gib": "memory_marketed_gb",
    "bf16_dense_tflops": "bf16_tflops",
    "fp16_dense_tflops": "fp16_tflops",
    "fp8_dense_tflops": "fp8_tflops",
    "tf32_dense_tflops": "tf32_tflops",
}
#: Shared-catalog columns read only to derive fields, or kept out of the model.
_DERIVED_COLUMNS = {"short_name", "nvidia_smi_total_mib", "nvidia_smi_usable_gib", "nvidia_smi_evidence",
                    "fp4_dense_tflops", "fp4_support"}
_PER_DEVICE = ("memory_marketed_gb", "memory_bandwidth_gbs", "bf16_tflops", "fp16_tflops", "fp8_tflops", "tf32_tflops",
               "interconnect_bidir_gbs", "tdp_w")
_VENDOR_PREFIXES = ("nvidia", "geforce", "amd", "instinct", "google", "intel", "habana")


def _blank(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def _plain(value: Any) -> Any:
    """A cell as the models take it: strings stripped, YAML's unquoted dates (``date_seen: 2025-01-01``
    loads as a `datetime.date`) back to ISO text."""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, (date, datetime)):
        return value.isoformat()
    return value


def _bool(value: Any, field: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "1", "y"):
        return True
    if text in ("false", "no", "0", "n"):
        return False
    raise SpecError(f"{field}={value!r} is not true or false")


def _number(value: Any, field: str) -> float:
    """A finite number cell (``inf``, ``nan`` and text refused with the column named)."""
    return finite_number(value, field)


#: The largest whole-number cell read (bytes of a device included): 2**53, where floats stop being exact.
_MAX_CELL = 2**53


def _whole(value: Any, field: str, minimum: int = 1) -> int:
    """A whole-number cell: ``8`` or ``8.0``, never ``inf`` or ``2.5`` (text cells of a CSV read as numbers)."""
    if isinstance(value, str):
        value = _number(value, field)
    return whole_number(value, field, minimum, _MAX_CELL)


def _usable_from_marketed(marketed_gb: float, memory_type: str, segment: str) -> tuple[int, str]:
    gddr = memory_type.upper().startswith("GDDR")
    frac = USABLE_FRACTION_GDDR if gddr else USABLE_FRACTION_HBM
    how = f"derived: marketed {marketed_gb:g} GiB x {frac}"
    if gddr and segment == "datacenter":
        frac *= ECC_GDDR_FRACTION
        how += " x 15/16 (ECC on)"
    return int(marketed_gb * GIB * frac) // MIB * MIB, how


def gpu_from_row(row: Mapping[str, Any]) -> GPU:
    """A `GPU` from one row of a catalog: the shared CSV's columns or `GPU`'s own field names.

    Memory comes from ``memory_bytes``, else ``nvidia_smi_total_mib``, else the marketed ``memory_gib``
    derated as documented (`USABLE_FRACTION_HBM`, `USABLE_FRACTION_GDDR`, `ECC_GDDR_FRACTION`).
    """
    data: dict[str, Any] = {}
    column: dict[str, str] = {}  # field -> the row's own column name, for messages
    fields = GPU.model_fields
    for key, value in row.items():
        key = str(key).strip()
        if _blank(value):
            continue
        field = _COLUMN_TO_FIELD.get(key, key)
        if field in _DERIVED_COLUMNS:
            continue
        if field not in fields:
            valid = sorted(set(fields) | set(_COLUMN_TO_FIELD) | _DERIVED_COLUMNS)
            raise SpecError(f"unknown GPU column {key!r}{did_you_mean(key, valid)}; valid columns: {', '.join(valid)}")
        data[field] = _plain(value)
        column[field] = key
    full = str(data.get("name", "")).strip()
    short = str(row.get("short_name") or "").strip()
    if not full:
        raise SpecError(f"a GPU row needs a name (got columns {sorted(row)})")
    if short:
        data["name"], data["full_name"] = short, full
    if isinstance(data.get("aliases"), str):
        data["aliases"] = tuple(a.strip() for a in data["aliases"].split("|") if a.strip())
    for key in ("supports_bf16", "supports_fp8"):
        if key in data:
            data[key] = _bool(data[key], key)
    for key in ("memory_marketed_gb", "memory_bandwidth_gbs", "bf16_tflops", "fp16_tflops", "fp8_tflops",
                "tf32_tflops", "interconnect_bidir_gbs", "pcie_bidir_gbs", "tdp_w"):
        if key in data:
            data[key] = _number(data[key], column.get(key, key))
    for key in ("release_year", "gpus_per_node", "nvlink_domain", "devices_per_package", "memory_bytes"):
        if key in data:
            data[key] = _whole(data[key], column.get(key, key))
    if "memory_marketed_gb" in data and not data["memory_marketed_gb"] > 0:
        raise SpecError(f"{column['memory_marketed_gb']}={data['memory_marketed_gb']:g} must be > 0 "
                        "(the marketed size in GiB, e.g. 80)")
    if data.get("pcie_bidir_gbs") == 0:
        data["pcie_bidir_gbs"] = None
    per = int(data.get("devices_per_package", 1))
    if per > 1:  # the catalog row is the package; software sees `per` devices (../shared/data/README.md)
        for key in _PER_DEVICE:
            if key in data:
                data[key] = data[key] / per
    if "memory_bytes" in data:
        data.setdefault("memory_bytes_source", "given")
    elif not _blank(row.get("nvidia_smi_total_mib")) and per == 1:
        data["memory_bytes"] = _whole(row["nvidia_smi_total_mib"], "nvidia_smi_total_mib") * MIB
        data["memory_bytes_source"] = "nvidia-smi"
    elif "memory_marketed_gb" in data:
        data["memory_bytes"], data["memory_bytes_source"] = _usable_from_marketed(
            data["memory_marketed_gb"], str(data.get("memory_type", "")), str(data.get("segment", "datacenter")))
    else:
        raise SpecError(f"GPU {full!r} needs memory_bytes, nvidia_smi_total_mib or memory_gib")
    from ..spec.base import _validate

    return _validate(GPU, data)  # type: ignore[no-any-return,unused-ignore]


def _read_table(source: str | Path, what: str = "file") -> list[dict[str, Any]]:
    """Rows of a CSV, YAML or JSON file (YAML needs PyYAML, which trainmem_nb does not require); errors name
    `what` (the flag or argument) and the file."""
    path = Path(source)
    if not str(source).strip():
        raise SpecError(f"{what}='' names no file")
    if not path.is_file():
        raise SpecError(f"{what} {path}: no such file")
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".yaml", ".yml", ".json"):
        raise SpecError(f"{what} {path.name}: use a .csv, .yaml/.yml or .json file")
    text = read_text_file(path, what)
    if suffix == ".csv":
        try:
            return list(csv.DictReader(io.StringIO(text, newline="")))
        except csv.Error as exc:
            raise SpecError(f"{what} {path}: not a readable CSV ({exc})") from None
    if suffix in (".yaml", ".yml"):
        try:
            import yaml  # type: ignore[import-untyped,unused-ignore]
        except ImportError:
            raise SpecError(f"reading {path.name} needs PyYAML (pip install pyyaml), or give a CSV or JSON file") from None
        try:
            data = yaml.safe_load(text)
        except (yaml.YAMLError, RecursionError) as exc:
            raise SpecError(f"{what} {path}: not valid YAML ({str(exc).splitlines()[0] if str(exc) else exc})") from None
    else:
        data = parse_json(text, f"{what} {path}")
    return _rows_of(data, f"{what} {path.name}")


def _each_row(rows: list[Any], where: str | None, read: Any) -> list[Any]:
    """`read` applied to each row; an error names the file, the row (CSV rows count from 2, after the
    header) and the GPU it describes."""
    out: list[Any] = []
    for i, row in enumerate(rows):
        try:
            got = read(row)
        except SpecError as exc:
            if where is None or (len(rows) == 1 and not where.lower().endswith((".csv", ".json", ".yaml", ".yml"))):
                if where is None:
                    raise
                raise SpecError(f"{where}: {exc}") from None
            label = str(row.get("short_name") or row.get("name") or row.get("gpu") or "") if isinstance(row, Mapping) else ""
            number = i + 2 if where.lower().endswith(".csv") else i + 1
            raise SpecError(f"{where} row {number}{f' ({label})' if label else ''}: {exc}") from None
        out.extend(got if isinstance(got, list) else [got])
    return out


def _rows_of(data: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(data, Mapping):
        for key in ("gpus", "prices", "rows"):
            if key in data and isinstance(data[key], list):
                data = data[key]
                break
        else:
            data = [data]
    if not isinstance(data, list) or not all(isinstance(r, Mapping) for r in data):
        raise SpecError(f"{where}: expected a list of rows (mappings)")
    return [dict(r) for r in data]


def load_gpus(source: str | Path | Mapping[str, Any] | Iterable[Mapping[str, Any] | GPU], what: str = "gpu file"
              ) -> list[GPU]:
    """Your own GPUs: a CSV/YAML/JSON path, one dict or a list of dicts (the shared CSV's columns or
    `GPU`'s fields). Pass the result to `trainmem_nb.planning.search.plan` (``gpus=``) or `trainmem_nb.planning.fit.fit`.

    >>> [g.name for g in load_gpus([{"name": "lab-card", "memory_gib": 24, "bf16_dense_tflops": 80}])]
    ['lab-card']
    """
    where = None
    if isinstance(source, (str, Path)):
        rows: list[Any] = _read_table(source, what)
        where = f"{what} {Path(source).name}"
    elif isinstance(source, Mapping):
        rows, where = [source], what
    elif isinstance(source, Iterable):
        rows, where = list(source), what
    else:
        raise SpecError(f"{what} must be a file path, a dict or a list of dicts / GPUs, got {type(source).__name__}")
    for r in rows:
        if not isinstance(r, (GPU, Mapping)):
            raise SpecError(f"{what}: each GPU must be a GPU or a dict of its columns, got {type(r).__name__}")
    return _each_row(rows, where, lambda r: r if isinstance(r, GPU) else gpu_from_row(r))


def _precision_for(precision: str, g: GPU) -> str:
    """bf16 recipes become fp16 on GPUs without bf16 (V100, T4): same bytes, loss scaling instead."""
    if precision.startswith("bf16") and not g.supports_bf16:
        return precision.replace("bf16", "fp16")
    return precision


def _data_text(name: str) -> str:
    return resources.files("trainmem_nb").joinpath(f"data/{name}").read_text(encoding="utf-8")


@cache
def _catalog() -> tuple[GPU, ...]:
    return tuple(gpu_from_row(r) for r in csv.DictReader(io.StringIO(_data_text("gpus.csv"), newline="")))


def list_gpus() -> list[GPU]:
    """Every GPU of the built-in catalog, in the catalog's order."""
    return list(_catalog())


def _norm(name: str) -> str:
    text = str(name).lower()
    for prefix in _VENDOR_PREFIXES:
        text = re.sub(rf"\b{prefix}\b", " ", text)
    return re.sub(r"[^a-z0-9]", "", text)


@cache
def _index() -> tuple[dict[str, GPU], list[str]]:
    index: dict[str, GPU] = {}
    for g in _catalog():
        for key in (g.name, g.full_name, *g.aliases):
            if key:
                index.setdefault(_norm(key), g)
    names = [g.name for g in _catalog()] + [a for g in _catalog() for a in g.aliases]
    return index, names


def get_gpu(name: str | GPU, catalog: Iterable[GPU] | None = None) -> GPU:
    """A GPU by name or alias, case-insensitively ("H100", "h100-80gb", "A100 80GB", "NVIDIA L40S").

    Looks in `catalog` first when one is given (your `load_gpus` list), then in the built-in one.

    >>> get_gpu("A100 80GB").name
    'A100 SXM 80GB'
    """
    if isinstance(name, GPU):
        return name
    if not isinstance(name, str):
        raise SpecError(f"gpu={name!r} must be a GPU name such as 'H100' (see `trainmem gpus`) or a GPU, "
                        f"not {type(name).__name__}")
    key = _norm(name)
    if not key:
        raise SpecError(f"gpu={name!r} is empty; see `trainmem gpus` for the catalog")
    for g in catalog or ():
        if key in {_norm(n) for n in (g.name, g.full_name, *g.aliases) if n}:
            return g
    index, names = _index()
    if key in index:
        return index[key]
    partial = {g.name: g for k, g in index.items() if key in k}
    if len(partial) == 1:
        return next(iter(partial.values()))
    if len(partial) > 1:
        raise SpecError(f"gpu={name!r} matches several GPUs: {', '.join(sorted(partial))}; name one of them")
    extra = [g.name for g in catalog or ()]
    raise SpecError(f"unknown gpu {name!r}{did_you_mean(str(name), extra + names)}; see `trainmem gpus` for the catalog "
                    f"or add your own with load_gpus()")


# ----------------------------------------------------------------------------------------------------------
# Prices

_PRICE_FIELDS = set(Price.model_fields)


def _billing_seconds(text: str) -> tuple[int | None, int]:
    """``(granularity_s, minimum_s)`` from a provider's wording ('per second (60 s minimum)')."""
    t = text.lower()
    gran = None
    for word, seconds in (("per second", 1), ("per-second", 1), ("per minute", 60), ("per-minute", 60),
                          ("by the minute", 60), ("per hour", 3600), ("hourly", 3600)):
        if word in t:
            gran = seconds
            break
    minimum = 0
    m = re.search(r"(\d+)\s*s(?:ec(?:ond)?s?)?\s+minimum", t)
    if m:
        minimum = int(m.group(1))
    m = re.search(r"(\d+)[- ]minute minimum", t)
    if m:
        minimum = 60 * int(m.group(1))
    return gran, minimum


def price_from_row(row: Mapping[str, Any], catalog: Iterable[GPU] | None = None, strict: bool = False) -> list[Price]:
    """`Price` rows from one snapshot-style row (one per catalog GPU it names). With `strict` (your own
    prices) a ``gpu`` that names no GPU is refused with a did-you-mean; the snapshot keeps such rows."""
    data = {str(k).strip(): _plain(v) for k, v in row.items() if not _blank(v)}
    label = str(data.pop("gpu", "") or data.get("gpu_label", ""))
    data.pop("catalog_gpu", None)
    targets = row.get("catalog_gpu") if "catalog_gpu" in row else None  # blank: the source does not say which
    unknown = sorted(set(data) - _PRICE_FIELDS)
    if unknown:
        valid = sorted(_PRICE_FIELDS | {"catalog_gpu"})
        raise SpecError(f"unknown price column {unknown[0]!r}{did_you_mean(unknown[0], valid)}; valid: {', '.join(valid)}")
    if "provider" not in data:
        data["provider"] = "yours"
    for key in ("on_demand_usd_per_gpu_hour", "spot_usd_per_gpu_hour"):
        if key in data:
            data[key] = _number(data[key], key)
    for key, least in (("gpus_per_instance", 1), ("billing_granularity_s", 1), ("minimum_billed_s", 0)):
        if key in data:
            data[key] = _whole(data[key], key, least)
    if "billing_granularity_s" not in data and "billing_granularity" in data:
        gran, minimum = _billing_seconds(str(data["billing_granularity"]))
        if gran is not None:
            data["billing_granularity_s"] = gran
        data.setdefault("minimum_billed_s", minimum)
    data.setdefault("gpu_label", label)
    if targets is None:
        try:
            names = [get_gpu(label, catalog).name] if label else [""]
        except SpecError:
            if strict:  # your own prices: a GPU name that matches nothing would price nothing, silently
                raise
            names = [label]
    else:
        names = [t.strip() for t in str(targets or "").split("|")]
    from ..spec.base import _validate

    return [_validate(Price, {**data, "gpu": n}) for n in names]


@cache
def _snapshot() -> tuple[Price, ...]:
    rows = csv.DictReader(io.StringIO(_data_text("prices_snapshot.csv"), newline=""))
    return tuple(p for r in rows for p in price_from_row(r))


def load_prices(source: str | Path | Mapping[str, Any] | Iterable[Mapping[str, Any] | Price],
                catalog: Iterable[GPU] | None = None, what: str = "prices file") -> list[Price]:
    """Your own prices: a CSV/YAML/JSON path, a list of dicts (the snapshot's columns), or a plain
    ``{gpu: usd_per_gpu_hour}`` dict of on-demand prices.

    >>> p = load_prices({"H100": 2.5})[0]
    >>> p.gpu, p.on_demand_usd_per_gpu_hour, p.provider
    ('H100 SXM 80GB', 2.5, 'yours')
    """
    catalog = list(catalog or ())
    where = None
    if isinstance(source, (str, Path)):
        rows: list[Any] = _read_table(source, what)
        where = f"{what} {Path(source).name}"
    elif isinstance(source, Mapping) and source and all(isinstance(v, (int, float)) for v in source.values()):
        return _plain_prices(source, catalog)
    elif isinstance(source, Mapping):
        rows = [source]
    elif isinstance(source, Iterable):
        rows = list(source)
    else:
        raise SpecError(f"{what} must be a file path, a {{gpu: usd_per_gpu_hour}} dict or a list of rows, "
                        f"got {type(source).__name__}")
    for r in rows:
        if not isinstance(r, (Price, Mapping)):
            raise SpecError(f"{what}: each price must be a Price or a dict of its columns, got {type(r).__name__}")
    return _each_row(rows, where, lambda r: [r] if isinstance(r, Price) else price_from_row(r, catalog, strict=True))


def _plain_prices(source: Mapping[str, Any], catalog: list[GPU]) -> list[Price]:
    """``{gpu: usd_per_gpu_hour}``: every key must name a GPU (did-you-mean otherwise) and every price be a
    finite number >= 0; a key silently ignored would leave that GPU unpriced without a word."""
    out: list[Price] = []
    for key, usd in source.items():
        try:
            gpu = get_gpu(key, catalog)
        except SpecError as exc:
            raise SpecError(f"prices={{{key!r}: ...}}: {exc}") from None
        value = finite_number(usd, f"prices[{key!r}]")
        if value < 0:
            raise SpecError(f"prices[{key!r}]={usd!r} must be >= 0 (USD per GPU-hour)")
        out.extend(price_from_row({"gpu": gpu.name, "on_demand_usd_per_gpu_hour": value,
                                   "date_seen": date.today().isoformat(),
                                   "billing_granularity": "per second (assumed for a plain price)"}, catalog))
    return out


def list_prices(gpu: str | GPU | None = None) -> list[Price]:
    """The snapshot's prices (every provider), optionally for one GPU. Dated: see `snapshot_date`."""
    rows = _snapshot()
    if gpu is None:
        return list(rows)
    name = get_gpu(gpu).name
    return [p for p in rows if p.gpu == name]


def snapshot_date(prices: Iterable[Price] | None = None) -> str:
    """The latest ``date_seen`` (ISO day) among `prices` (default: the built-in snapshot); '' when undated."""
    found = (re.match(r"\d{4}-\d{2}-\d{2}(?!\d)", p.date_seen) for p in (prices if prices is not None else _snapshot()))
    return max((m.group() for m in found if m), default="")
