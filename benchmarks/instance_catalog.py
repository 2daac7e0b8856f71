"""Cloud instance types and their prices, as data: the catalog shipped in
benchmarks/catalog/instances.csv, extended or overridden by a user's own files.

A user's file holds full rows (an instance type the catalog lacks: a cluster's own nodes, say)
or only some columns beside `name` (negotiated or internal prices: `name,on_demand_usd_per_h`),
which replace those columns of the named rows; a price so replaced names that file as its source,
and the file's date as its date, unless the file gives price_source and price_date itself. Prices change: every row says where its price
comes from and when it was read, and the table printed from it says so too.

A file that does not parse is one line naming the file, the row and the column.
"""
from __future__ import annotations

import csv
import dataclasses
import time
from pathlib import Path

CATALOG = Path(__file__).resolve().parent / "catalog" / "instances.csv"


class CatalogError(ValueError):
    """A catalog or price file that cannot be used; the message names the file and row."""


@dataclasses.dataclass(frozen=True)
class Instance:
    name: str
    cloud: str
    region: str
    gpu_model: str              # short and canonical: A100-40GB, H100-80GB, L40S, ...
    gpu_count: int
    gpu_memory_gib: float
    vcpus: int                  # logical CPUs, hyperthreads counted, as clouds sell them
    cpu: str                    # e.g. "AMD EPYC 7R13"
    cpu_isa: str                # avx512 or avx2: which measured CPUs it is kin to
    memory_gib: float
    local_nvme_gb: float | None
    network_gbps: float | None
    on_demand_usd_per_h: float
    spot_usd_per_h: float | None
    price_source: str
    price_date: str
    spec_source: str

    @property
    def vcpus_per_gpu(self) -> float:
        return self.vcpus / self.gpu_count


FIELDS = {field.name: field for field in dataclasses.fields(Instance)}
OPTIONAL = {"local_nvme_gb", "network_gbps", "spot_usd_per_h"}       # blank: not published
PRICES = {"on_demand_usd_per_h", "spot_usd_per_h"}


def _value(name: str, text: str, where: str):
    kind = FIELDS[name].type
    text = text.strip()
    if not text:
        if name in OPTIONAL:
            return None
        raise CatalogError(f"{where}: column {name!r} is empty")
    if kind == "str":
        return text
    try:
        number = int(text) if kind == "int" else float(text)
    except ValueError:
        raise CatalogError(f"{where}: column {name!r} is {text!r}, not a number") from None
    if number < 0 or (number == 0 and name in ("gpu_count", "vcpus", "on_demand_usd_per_h")):
        raise CatalogError(f"{where}: column {name!r} is {text!r}; it must be above 0")
    return number


def read_rows(path: Path) -> list[tuple[str, dict]]:
    """(where, {column: value}) per row of one file, `where` naming the file and row."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(line for line in f if not line.startswith("#"))
            header = reader.fieldnames or []
            unknown = [column for column in header if column not in FIELDS]
            if "name" not in header or unknown:
                raise CatalogError(f"{path}: " + (f"unknown column {unknown[0]!r}" if unknown else "no 'name' column")
                                   + f"; the columns are {', '.join(FIELDS)}")
            rows = []
            for number, row in enumerate(reader, start=2):
                where = f"{path} row {number}"
                if None in row or any(value is None for value in row.values()):
                    raise CatalogError(f"{where}: {len(header)} columns expected")
                rows.append((where, {column: _value(column, text, where) for column, text in row.items()}))
            return rows
    except OSError as error:
        raise CatalogError(f"{path}: cannot read it ({error.strerror})") from None
    except (csv.Error, UnicodeDecodeError) as error:
        raise CatalogError(f"{path}: not a CSV file ({error})") from None


def load_catalog(extra: list[Path] = (), base: Path = CATALOG) -> dict[str, Instance]:
    """name -> Instance: the shipped catalog, then each file in `extra`, later files winning."""
    columns: dict[str, dict] = {}
    for path in [base, *extra]:
        for where, row in read_rows(path):
            if row["name"] in columns:
                if path != base and PRICES & set(row) and "price_source" not in row:
                    row = {**row, "price_source": str(path),
                           "price_date": time.strftime("%Y-%m-%d", time.localtime(path.stat().st_mtime))}
                columns[row["name"]] = {**columns[row["name"]], **row}
            elif set(row) != set(FIELDS):
                missing = sorted(set(FIELDS) - set(row))
                raise CatalogError(f"{where}: {row['name']!r} is not in the catalog, so it needs every column "
                                   f"(missing {', '.join(missing)})")
            else:
                columns[row["name"]] = row
    return {name: Instance(**row) for name, row in columns.items()}
