"""Load RAN KPI traces from CSV files of any public layout into canonical E2SM-KPM rows.

Real traces are messy: placeholder strings for missing values, sentinel readings (RSRP 0,
Android's 2147483647), duplicated and out-of-order timestamps, a radio technology that changes
mid-trace. A replay must survive all of that and say what it repaired, so every repair is counted
in ``LoadStats``. Only two things stop a load, because they are mistakes in the mapping that the
user must fix: a mapped column the file does not have, and a timestamp the declared format cannot
read. Both messages name the column (and the line and value), so the fix is obvious.
"""

from __future__ import annotations

import csv
import math
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ricllm.errors import RicllmError

#: Canonical unit of each E2SM-KPM measurement (3GPP TS 28.552) the replay knows.
KPI_UNITS: dict[str, str] = {
    "DRB.UEThpDl": "kbps",
    "DRB.UEThpUl": "kbps",
    "RRU.PrbUsedDl": "PRB",
    "RRU.PrbUsedUl": "PRB",
    "RRU.PrbAvailDl": "PRB",
    "RRU.PrbAvailUl": "PRB",
    "RRU.PrbTotDl": "%",
    "RRU.PrbTotUl": "%",
    "DRB.RlcSduDelayDl": "0.1ms",
    "DRB.PdcpSduVolumeDL": "kbit",
    "DRB.PdcpSduVolumeUL": "kbit",
    "RRC.ConnMean": "UE",
    "L1M.DL-SS-RSRP": "dBm",
    "L1M.DL-SS-SINR": "dB",
}

#: A unit as a file writes it -> (canonical unit, multiplier into it); lets a mapping say
#: ``unit: bit/s`` instead of working out ``scale: 0.001`` by hand.
UNIT_SCALES: dict[str, tuple[str, float]] = {
    "bit/s": ("kbps", 0.001), "bps": ("kbps", 0.001),
    "kbit/s": ("kbps", 1.0), "kbps": ("kbps", 1.0),
    "Mbit/s": ("kbps", 1000.0), "Mbps": ("kbps", 1000.0),
    "bit": ("kbit", 0.001), "kbit": ("kbit", 1.0), "Mbit": ("kbit", 1000.0),
    "byte": ("kbit", 0.008), "bytes": ("kbit", 0.008),
    "us": ("0.1ms", 0.01), "ms": ("0.1ms", 10.0), "0.1ms": ("0.1ms", 1.0),
    "%": ("%", 1.0), "ratio": ("%", 100.0),
    "PRB": ("PRB", 1.0), "UE": ("UE", 1.0), "dBm": ("dBm", 1.0), "dB": ("dB", 1.0),
}

DEFAULT_MISSING = ["", "-", "NaN", "nan", "NA", "null"]
NAMED_FORMATS = ("epoch_ms", "epoch_s", "iso8601")
SKIP_REASONS = ("no_timestamp", "no_entity", "missing_value", "sentinel")
NO_ENTITY = "all"
_EPOCH_UNIT_S = {"epoch_s": 1.0, "epoch_ms": 1000.0}


class TraceError(RicllmError, ValueError):
    """The trace file or its mapping cannot be used; the message names the column/line/value."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TimestampSpec(_Strict):
    """Which column holds the time and how to read it."""

    column: str
    format: str = Field("iso8601", description="epoch_ms, epoch_s, iso8601 or a strptime format")

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        if value not in NAMED_FORMATS and "%" not in value:
            raise ValueError(f"timestamp format {value!r} is none of {', '.join(NAMED_FORMATS)} "
                             "and not a strptime format (e.g. '%Y.%m.%d_%H.%M.%S')")
        return value


class KpiColumn(_Strict):
    """One KPI: its column, the unit as written there, and the multiplier to the canonical unit."""

    column: str
    unit: str | None = None
    scale: float | None = Field(None, description="resolved from unit when omitted")


class SentinelSpec(_Strict):
    """Readings that mean "no measurement": listed values, or anything outside a valid range."""

    values: list[float] = []
    valid_range: tuple[float, float] | None = None

    @model_validator(mode="before")
    @classmethod
    def _list_is_values(cls, data: object) -> object:
        return {"values": data} if isinstance(data, list) else data

    @model_validator(mode="after")
    def _ordered_range(self) -> SentinelSpec:
        if self.valid_range and self.valid_range[0] > self.valid_range[1]:
            raise ValueError(f"valid_range {list(self.valid_range)} has min > max")
        return self

    def matches(self, raw: float) -> bool:
        """Compared on the raw file value, before scaling, as the file's writer meant it."""
        if raw in self.values:
            return True
        return self.valid_range is not None and not self.valid_range[0] <= raw <= self.valid_range[1]


class TraceSpec(_Strict):
    """The ``trace`` section of a scenario file: where the CSV is and how its columns map."""

    path: str
    timestamp: TimestampSpec
    entity: str | None = Field(None, description="cell/UE/base-station id column; none: one entity")
    kpis: dict[str, KpiColumn] = Field(min_length=1)
    missing_values: list[str] = Field(default_factory=lambda: list(DEFAULT_MISSING))
    sentinels: dict[str, SentinelSpec] = {}
    policy: Literal["skip", "fill", "keep"] = "keep"
    duplicates: Literal["keep_first", "keep_last", "keep_all"] = "keep_first"
    passthrough: list[str] = []
    delimiter: str = Field(",", min_length=1, max_length=1)

    @field_validator("kpis", mode="before")
    @classmethod
    def _column_shorthand(cls, value: object) -> object:
        if isinstance(value, dict):
            return {k: {"column": v} if isinstance(v, str) else v for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _resolve(self) -> TraceSpec:
        for name, kpi in self.kpis.items():
            kpi.scale = _resolve_scale(name, kpi)
        mapped = {kpi.column for kpi in self.kpis.values()}
        for column in self.sentinels:
            if column not in mapped:
                raise ValueError(f"sentinels name column {column!r}, which no KPI maps "
                                 f"(mapped: {', '.join(sorted(mapped))})")
        return self

    def columns(self) -> list[str]:
        """Every column the mapping reads, so a load can check them all against the header."""
        named = [self.timestamp.column, *([self.entity] if self.entity else [])]
        return list(dict.fromkeys([*named, *(k.column for k in self.kpis.values()), *self.passthrough]))


def _resolve_scale(name: str, kpi: KpiColumn) -> float:
    """An explicit scale wins; otherwise the unit must convert to the KPI's canonical unit."""
    if kpi.scale is not None:
        return kpi.scale
    canonical = KPI_UNITS.get(name)
    if kpi.unit is None or canonical is None:
        return 1.0
    target, factor = UNIT_SCALES.get(kpi.unit, (kpi.unit, 1.0))
    if target != canonical:
        raise ValueError(f"KPI {name!r}: unit {kpi.unit!r} does not convert to {canonical!r}; "
                         "give 'scale' (the multiplier to the canonical unit)")
    return factor


@dataclass
class KpiRow:
    """One measurement report: an entity's KPIs at one instant, canonical names and units."""

    time_s: float
    timestamp: datetime | float
    entity: str
    kpis: dict[str, float | None]
    extras: dict[str, str] = field(default_factory=dict)
    line: int = 0


@dataclass
class LoadStats:
    """What the loader saw and repaired; all counts, for the scenario report.

    ``rows_read == rows_kept + sum(skipped.values()) + duplicates_dropped`` always holds.
    Per-column counts cover every data row read, including rows later dropped.
    """

    rows_read: int = 0
    rows_kept: int = 0
    blank_lines: int = 0
    ragged_rows: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))
    duplicates_dropped: int = 0
    reordered: int = 0
    filled: int = 0
    unfilled: int = 0
    missing: dict[str, int] = field(default_factory=dict)
    invalid: dict[str, int] = field(default_factory=dict)
    sentinels: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class LoadedTrace:
    """Rows in time order (stable for equal times) and the load statistics."""

    path: Path
    rows: list[KpiRow]
    stats: LoadStats

    def entities(self) -> list[str]:
        """Entity ids in order of first appearance."""
        return list(dict.fromkeys(row.entity for row in self.rows))


@dataclass
class _Parsed:
    line: int
    key: datetime | float
    entity: str
    kpis: dict[str, float | None]
    flags: set[str]
    extras: dict[str, str]


@dataclass
class _Context:
    spec: TraceSpec
    path: Path
    index: dict[str, int]
    missing: frozenset[str]
    stats: LoadStats


def load_trace(spec: TraceSpec, base_dir: str | Path = ".") -> LoadedTrace:
    """Read ``spec.path`` (relative to ``base_dir``, the scenario file's folder) into rows."""
    path = Path(base_dir) / spec.path
    header, records = _read_csv(path, spec.delimiter)
    stats = LoadStats()
    ctx = _Context(spec, path, _column_index(spec, header, path), frozenset(spec.missing_values), stats)
    for column in dict.fromkeys(k.column for k in spec.kpis.values()):
        stats.missing[column] = stats.invalid[column] = stats.sentinels[column] = 0
    parsed = [p for line, fields in records if (p := _parse_record(line, fields, len(header), ctx))]
    stats.reordered = _count_reordered(parsed)
    parsed.sort(key=lambda p: p.key)
    deduped = _dedupe(parsed, spec.duplicates)
    stats.duplicates_dropped = len(parsed) - len(deduped)
    kept = _apply_policy(deduped, spec.policy, stats)
    stats.rows_kept = len(kept)
    return LoadedTrace(path, _to_rows(kept, spec.timestamp.format), stats)


def _read_csv(path: Path, delimiter: str) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """Header and (line number, fields) records; undecodable bytes become U+FFFD, not a crash."""
    try:
        with path.open(newline="", encoding="utf-8-sig", errors="replace") as handle:
            reader = csv.reader(handle, delimiter=delimiter)
            header = next(reader, None)
            if header is None:
                raise TraceError(f"trace {path} is empty: expected a header line")
            try:
                return header, [(reader.line_num, fields) for fields in reader]
            except csv.Error as exc:
                raise TraceError(f"{path.name}: line {reader.line_num}: unreadable CSV: {exc}") from None
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None


def _column_index(spec: TraceSpec, header: list[str], path: Path) -> dict[str, int]:
    """Column name -> position (names stripped; the first of duplicated names wins)."""
    names = [name.strip() for name in header]
    index: dict[str, int] = {}
    for position, name in enumerate(names):
        index.setdefault(name, position)
    for column in spec.columns():
        if column.strip() not in index:
            raise TraceError(f"{path.name}: column {column!r} from the trace mapping is not in the "
                             f"header; the header has: {', '.join(repr(n) for n in names)}")
    return index


def _cell(fields: list[str], ctx: _Context, column: str) -> str:
    position = ctx.index[column.strip()]
    return fields[position].strip() if position < len(fields) else ""


def _parse_record(line: int, fields: list[str], width: int, ctx: _Context) -> _Parsed | None:
    """One CSV record -> a parsed row, or None (blank line, or skipped with its reason counted)."""
    if not any(f.strip() for f in fields):
        ctx.stats.blank_lines += 1
        return None
    ctx.stats.rows_read += 1
    ctx.stats.ragged_rows += len(fields) != width
    spec = ctx.spec
    stamp = _cell(fields, ctx, spec.timestamp.column)
    entity = _cell(fields, ctx, spec.entity) if spec.entity else NO_ENTITY
    if stamp in ctx.missing or entity in ctx.missing:
        ctx.stats.skipped["no_timestamp" if stamp in ctx.missing else "no_entity"] += 1
        return None
    key = _parse_time(stamp, line, ctx)
    raw = {column: _read_value(_cell(fields, ctx, column), column, ctx)
           for column in dict.fromkeys(k.column for k in spec.kpis.values())}
    kpis = {name: None if raw[k.column][0] is None else raw[k.column][0] * k.scale
            for name, k in spec.kpis.items()}
    flags = {flag for _, flag in raw.values() if flag}
    extras = {column: _cell(fields, ctx, column) for column in spec.passthrough}
    return _Parsed(line, key, entity, kpis, flags, extras)


def _parse_time(text: str, line: int, ctx: _Context) -> datetime | float:
    """Epoch formats stay numbers in their own unit; datetimes without a zone are taken as UTC."""
    fmt = ctx.spec.timestamp.format
    try:
        if fmt in _EPOCH_UNIT_S:
            value = float(text)
            if not math.isfinite(value):
                raise ValueError(text)
            return value
        if fmt == "iso8601":
            moment = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)
        else:
            moment = datetime.strptime(text, fmt)
    except ValueError:
        raise TraceError(f"{ctx.path.name}: line {line}: timestamp column "
                         f"{ctx.spec.timestamp.column!r} has value {text!r}, which format "
                         f"{fmt!r} cannot parse") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def _read_value(text: str, column: str, ctx: _Context) -> tuple[float | None, str | None]:
    """Raw number and no flag, or None and why: 'missing' (placeholder or garbage) or 'sentinel'."""
    if text in ctx.missing:
        ctx.stats.missing[column] += 1
        return None, "missing"
    try:
        raw = float(text)
    except ValueError:
        raw = math.nan
    if not math.isfinite(raw):
        ctx.stats.invalid[column] += 1
        return None, "missing"
    sentinel = ctx.spec.sentinels.get(column)
    if sentinel is not None and sentinel.matches(raw):
        ctx.stats.sentinels[column] += 1
        return None, "sentinel"
    return raw, None


def _count_reordered(rows: list[_Parsed]) -> int:
    """Rows earlier than a row the same entity already reported (in file order)."""
    latest: dict[str, datetime | float] = {}
    count = 0
    for row in rows:
        if row.entity in latest and row.key < latest[row.entity]:
            count += 1
        else:
            latest[row.entity] = row.key
    return count


def _dedupe(rows: list[_Parsed], mode: str) -> list[_Parsed]:
    """Same entity and same timestamp: keep the first or last in file order, or all."""
    if mode == "keep_all":
        return rows
    ordered = rows if mode == "keep_first" else rows[::-1]
    seen: set[tuple[str, datetime | float]] = set()
    kept = []
    for row in ordered:
        if (row.entity, row.key) not in seen:
            seen.add((row.entity, row.key))
            kept.append(row)
    return kept if mode == "keep_first" else kept[::-1]


def _apply_policy(rows: list[_Parsed], policy: str, stats: LoadStats) -> list[_Parsed]:
    """skip drops flagged rows; fill carries each entity's last good value; keep leaves None."""
    last: dict[str, dict[str, float]] = {}
    kept = []
    for row in rows:
        if row.flags and policy == "skip":
            stats.skipped["missing_value" if "missing" in row.flags else "sentinel"] += 1
            continue
        if policy == "fill":
            _fill(row, last.setdefault(row.entity, {}), stats)
        kept.append(row)
    return kept


def _fill(row: _Parsed, memory: dict[str, float], stats: LoadStats) -> None:
    for name, value in row.kpis.items():
        if value is not None:
            memory[name] = value
        elif name in memory:
            row.kpis[name] = memory[name]
            stats.filled += 1
        else:
            stats.unfilled += 1


def _to_rows(rows: list[_Parsed], fmt: str) -> list[KpiRow]:
    """time_s counts from the earliest kept row."""
    if not rows:
        return []
    first = rows[0].key

    def elapsed(key: datetime | float) -> float:
        if isinstance(key, datetime):
            return (key - first).total_seconds()
        return (key - first) / _EPOCH_UNIT_S[fmt]

    return [KpiRow(elapsed(r.key), r.key, r.entity, r.kpis, r.extras, r.line) for r in rows]
