"""Seeded synthetic RAN KPI traces: per-cell E2SM-KPM reports with a daily load curve, bursts and outages.

Tests and demos need traces that are small, reproducible and still show what an operator cares
about: load that rises and falls over a day (compressible with ``day_length_s`` so a 2-minute
replay sweeps a whole day), short random load spikes, and cells that go dark. Every random draw
comes from one ``numpy.random.Generator`` seeded by ``seed``, in a fixed order, so a seed names a
trace. The row's ``extras["event"]`` says which rows are bursts or outages, as ground truth for
judging what the xApp noticed.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Literal

import numpy as np

from ricllm.replay.traces import KPI_UNITS, KpiRow, TraceError, TraceSpec

#: The KPIs a generated trace reports, in column order.
GENERATED_PASSTHROUGH = ("event",)  # the columns a generated trace passes to prompts as extras[COLUMN]
GENERATED_KPIS = ("DRB.UEThpDl", "DRB.UEThpUl", "RRU.PrbUsedDl", "RRU.PrbAvailDl", "RRU.PrbTotDl",
                  "DRB.RlcSduDelayDl", "RRC.ConnMean", "L1M.DL-SS-RSRP", "L1M.DL-SS-SINR")
#: Radio KPIs a dark cell cannot measure: None during a "zero" outage, the rest report 0.
_RADIO_KPIS = ("L1M.DL-SS-RSRP", "L1M.DL-SS-SINR")
DEFAULT_START = datetime(2024, 1, 1, tzinfo=timezone.utc)
ENTITY_COLUMN = "cell_id"
TIME_COLUMN = "timestamp"
_PRB_KHZ = 360.0  # 12 subcarriers x 30 kHz
_OUTAGE_SHARE = (0.05, 0.15)  # an outage lasts this share of the trace
_BURST_S = (2.0, 10.0)


def generate_trace(cells: int, duration_s: float, interval_s: float, seed: int,
                   start: datetime | None = None, *, day_length_s: float = 86400.0,
                   bursts_per_min: float = 1.0, outages: int = 1,
                   outage_mode: Literal["zero", "absent"] = "zero",
                   prb_avail: Sequence[int] = (106, 273)) -> list[KpiRow]:
    """Rows in time order, cells in order within an instant; one row per cell per interval.

    ``day_length_s`` is how many trace seconds make one simulated day; ``start`` (UTC when naive)
    fixes the timestamps and the time of day the curve starts at. Cell ``i`` has
    ``prb_avail[i % len(prb_avail)]`` PRBs. An outage either reports zeros (radio KPIs None) or
    drops the cell's rows (``outage_mode="absent"``).
    """
    _check_args(cells, duration_s, interval_s, day_length_s, outages)
    start = _normalise_start(start)
    times = np.round(np.arange(int(duration_s / interval_s + 1e-9)) * interval_s, 3)
    rng = np.random.default_rng(seed)
    load = _daily_load(times, start, day_length_s, cells, rng)
    burst = _bursts(rng, cells, times.size, interval_s, bursts_per_min * duration_s / 60.0)
    load = np.clip(load + burst * rng.uniform(0.3, 0.6, size=(cells, 1)), 0.0, 1.0)
    outage = _outages(rng, cells, times.size, outages)
    avail = np.array([prb_avail[c % len(prb_avail)] for c in range(cells)], dtype=float)[:, None]
    kpis = _kpis(load, avail, rng)
    return _rows(times, start, kpis, burst, outage, outage_mode)


def write_trace_csv(rows: Sequence[KpiRow], path: str | Path) -> Path:
    """ISO-8601 timestamps, cell id, KPI columns under their E2SM-KPM names, then the extras."""
    kpi_names = list(dict.fromkeys(name for row in rows for name in row.kpis))
    extra_names = list(dict.fromkeys(name for row in rows for name in row.extras))
    path = Path(path)
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow([TIME_COLUMN, ENTITY_COLUMN, *kpi_names, *extra_names])
        for row in rows:
            writer.writerow([_format_time(row.timestamp), row.entity,
                             *(_format_value(row.kpis.get(k)) for k in kpi_names),
                             *(row.extras.get(e, "") for e in extra_names)])
    return path


def generated_trace_spec(path: str, *, policy: Literal["skip", "fill", "keep"] = "keep") -> TraceSpec:
    """The mapping that reads a file ``write_trace_csv`` wrote: names and units already canonical."""
    return TraceSpec(path=path, timestamp={"column": TIME_COLUMN, "format": "iso8601"},
                     entity=ENTITY_COLUMN, policy=policy, passthrough=list(GENERATED_PASSTHROUGH),
                     kpis={k: {"column": k, "unit": KPI_UNITS[k]} for k in GENERATED_KPIS})


def _check_args(cells: int, duration_s: float, interval_s: float, day_length_s: float,
                outages: int) -> None:
    if cells < 1 or interval_s <= 0 or duration_s < interval_s or day_length_s <= 0 or outages < 0:
        raise TraceError(f"cannot generate a trace with cells={cells}, duration_s={duration_s}, "
                         f"interval_s={interval_s}, day_length_s={day_length_s}, outages={outages}: "
                         "need cells >= 1, 0 < interval_s <= duration_s, day_length_s > 0, outages >= 0")


def _normalise_start(start: datetime | None) -> datetime:
    """UTC, whole milliseconds, so timestamps survive a CSV round trip exactly."""
    start = DEFAULT_START if start is None else start
    start = start if start.tzinfo else start.replace(tzinfo=timezone.utc)
    return start.replace(microsecond=start.microsecond // 1000 * 1000)


def _daily_load(times: np.ndarray, start: datetime, day_length_s: float, cells: int,
                rng: np.random.Generator) -> np.ndarray:
    """Share of PRBs in use, (cells, n): lowest at 04:00, highest at 16:00, per-cell level and noise."""
    start_s = start.hour * 3600 + start.minute * 60 + start.second
    hours = ((start_s + times * 86400.0 / day_length_s) / 3600.0) % 24.0
    curve = 0.5 - 0.35 * np.cos(2 * np.pi * (hours - 4.0) / 24.0)
    level = rng.uniform(0.8, 1.1, size=(cells, 1))
    noise = rng.normal(0.0, 0.03, size=(cells, times.size))
    return np.clip(curve[None, :] * level + noise, 0.0, 1.0)


def _bursts(rng: np.random.Generator, cells: int, n: int, interval_s: float,
            expected: float) -> np.ndarray:
    """Boolean (cells, n): Poisson-many spikes per cell, each 2-10 s long."""
    mask = np.zeros((cells, n), dtype=bool)
    for cell in range(cells):
        for _ in range(rng.poisson(expected)):
            first = int(rng.integers(0, n))
            length = max(1, round(rng.uniform(*_BURST_S) / interval_s))
            mask[cell, first:first + length] = True
    return mask


def _outages(rng: np.random.Generator, cells: int, n: int, count: int) -> np.ndarray:
    """Boolean (cells, n): ``count`` windows on random cells, each 5-15 % of the trace."""
    mask = np.zeros((cells, n), dtype=bool)
    for _ in range(count):
        cell = int(rng.integers(0, cells))
        first = int(rng.integers(n // 10, max(n // 10 + 1, n * 8 // 10)))
        length = max(1, round(n * rng.uniform(*_OUTAGE_SHARE)))
        mask[cell, first:first + length] = True
    return mask


def _kpis(load: np.ndarray, avail: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """KPIs from load: PRBs follow load, SINR falls with it, delay queues up as it nears 1."""
    shape = load.shape
    used = np.round(load * avail)
    ues = 1.0 + rng.poisson(load * avail * 0.12)
    sinr = rng.uniform(10.0, 22.0, size=(shape[0], 1)) - 6.0 * load + rng.normal(0.0, 1.5, size=shape)
    rsrp = rng.uniform(-105.0, -80.0, size=(shape[0], 1)) + rng.normal(0.0, 2.0, size=shape)
    efficiency = np.minimum(0.75 * np.log2(1.0 + 10.0 ** (sinr / 10.0)), 7.4)
    per_ue_dl = used * _PRB_KHZ * efficiency / ues
    delay = 20.0 + 25.0 * load / (1.0 - np.minimum(load, 0.95)) + np.abs(rng.normal(0.0, 3.0, size=shape))
    return {
        "DRB.UEThpDl": np.round(per_ue_dl, 1),
        "DRB.UEThpUl": np.round(per_ue_dl * rng.uniform(0.1, 0.2, size=shape), 1),
        "RRU.PrbUsedDl": used,
        "RRU.PrbAvailDl": np.broadcast_to(avail, shape),
        "RRU.PrbTotDl": np.round(100.0 * used / avail, 1),
        "DRB.RlcSduDelayDl": np.round(delay, 1),
        "RRC.ConnMean": ues,
        "L1M.DL-SS-RSRP": np.round(rsrp, 1),
        "L1M.DL-SS-SINR": np.round(sinr, 1),
    }


def _rows(times: np.ndarray, start: datetime, kpis: dict[str, np.ndarray], burst: np.ndarray,
          outage: np.ndarray, outage_mode: str) -> list[KpiRow]:
    rows = []
    for k, time_s in enumerate(times.tolist()):
        stamp = start + timedelta(milliseconds=round(time_s * 1000))
        for cell in range(burst.shape[0]):
            if outage[cell, k] and outage_mode == "absent":
                continue
            values = {name: float(kpis[name][cell, k]) for name in GENERATED_KPIS}
            event = "outage" if outage[cell, k] else "burst" if burst[cell, k] else ""
            if event == "outage":
                values = _dark(values)
            rows.append(KpiRow(time_s, stamp, f"cell{cell}", values, {"event": event}, len(rows) + 2))
    return rows


def _dark(values: dict[str, float]) -> dict[str, float | None]:
    """A dark cell still reports its capacity, serves nobody and measures no radio."""
    dark: dict[str, float | None] = {k: 0.0 for k in values}
    dark["RRU.PrbAvailDl"] = values["RRU.PrbAvailDl"]
    dark.update(dict.fromkeys(_RADIO_KPIS))
    return dark


def _format_time(stamp: datetime | float) -> str:
    return stamp.isoformat(timespec="milliseconds") if isinstance(stamp, datetime) else repr(stamp)


def _format_value(value: float | None) -> str:
    """Shortest repr, so the CSV reads back to the identical float; None is an empty cell."""
    if value is None:
        return ""
    return str(int(value)) if value.is_integer() else repr(value)
