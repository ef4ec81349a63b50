"""The refusal audit (``ricllm replay SCENARIO --audit``): was each refusal right?

Admission is a promise in both directions: refusing a request that would have been served in
time breaks it as surely as admitting one that misses. The audit replays the same trace under
other policies on the same engine settings, and pairs the requests by id:

- ``admit_all``: earliest deadline first with no refusal for time and no drop (``policy: edf``,
  an unbounded queue, ``on_late: finish``): what each request would have got had all been served;
- ``fcfs`` and ``edf``: the baselines a careful operator runs, with a bounded queue and late
  requests dropped (``on_late: abort``), as ``benchmarks/bench_admission.py`` runs them.

A **false refusal** is a deadline request that deadline admission refused and that met its
deadline in the admit-all run. Goodput is deadline requests that met their deadline; useful
answers add the template's validity and correctness (as the report counts them).
"""

from __future__ import annotations

import statistics
from typing import Any

from ricllm.report.records import RequestRecord

#: admission settings of each audit run (the scenario's own run is the deadline one)
AUDIT_POLICIES: dict[str, dict[str, Any]] = {
    "admit_all": {"policy": "edf", "max_queue": 1_000_000, "on_late": "finish"},
    "fcfs": {"policy": "fcfs", "on_late": "abort"},
    "edf": {"policy": "edf", "on_late": "abort"},
}


def policy_overrides(name: str) -> list[str]:
    """``--set`` strings that turn a scenario's admission into the audit policy ``name``."""
    return [f"engine.admission.{field}={value}" for field, value in AUDIT_POLICIES[name].items()]


def refusal_audit(deadline_run: list[RequestRecord], others: dict[str, list[RequestRecord]]) -> dict[str, Any]:
    """The audit's figures: false refusals against ``others["admit_all"]``, and each run's goodput."""
    served_alone = {r.id: r for r in others["admit_all"]}
    promised = [r for r in deadline_run if r.deadline_ms is not None]
    refused = [r for r in promised if r.status == "rejected"]
    wrongly = [r for r in refused if _met(served_alone.get(r.id))]
    runs = {"deadline": deadline_run, **others}
    goodput = {name: _goodput(records) for name, records in runs.items()}
    return {
        "sent": len(promised), "refused": len(refused), "false_refusals": len(wrongly),
        "false_refusal_rate": len(wrongly) / len(promised) if promised else 0.0,
        "false_refusal_ids": [r.id for r in wrongly],
        "refusals": [_refusal(r, served_alone.get(r.id)) for r in refused],
        "refused_would_have_missed": len(refused) - len(wrongly),
        "met_of_admitted": {name: _met_of_admitted(records) for name, records in runs.items()},
        "goodput": goodput,
        "goodput_vs": {name: _ratio(goodput["deadline"]["met"], figures["met"])
                       for name, figures in goodput.items() if name != "deadline"},
        "admitted_e2e_p95_ms": {name: _e2e_p95_ms(records) for name, records in runs.items()},
        "every_deadline_met_when_all_served": all(_met(r) for r in others["admit_all"] if r.deadline_ms is not None),
    }


def _refusal(refused: RequestRecord, served: RequestRecord | None) -> dict[str, Any]:
    """One refusal beside what became of the same request when everything was served."""
    numbers = refused.rejection_numbers or {}
    bound, left = numbers.get("bound_ms"), numbers.get("deadline_ms")
    return {"id": refused.id, "deadline_class": refused.deadline_class, "code": refused.rejection_code,
            "bound_ms": bound, "slack_lacked_ms": bound - left if bound is not None and left is not None else None,
            "met_when_all_served": _met(served),
            "e2e_ms_when_all_served": served.server_e2e_s * 1000 if served and served.server_e2e_s else None}


def _met(record: RequestRecord | None) -> bool:
    return record is not None and record.status == "completed" and bool(record.met)


def _goodput(records: list[RequestRecord]) -> dict[str, int]:
    with_deadline = [r for r in records if r.deadline_ms is not None]
    return {"met": sum(map(_met, with_deadline)), "useful": sum(bool(r.useful) for r in records)}


def _met_of_admitted(records: list[RequestRecord]) -> float | None:
    admitted = [r for r in records if r.deadline_ms is not None and r.status != "rejected"]
    return sum(map(_met, admitted)) / len(admitted) if admitted else None


def _e2e_p95_ms(records: list[RequestRecord]) -> float | None:
    times = sorted(r.server_e2e_s * 1000 for r in records
                   if r.deadline_ms is not None and r.status == "completed" and r.server_e2e_s is not None)
    if len(times) < 2:
        return times[0] if times else None
    return statistics.quantiles(times, n=20, method="inclusive")[-1]


def _ratio(ours: int, theirs: int) -> float | None:
    return ours / theirs if theirs else None
