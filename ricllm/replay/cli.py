"""``ricllm replay SCENARIO``: the command line: arguments, the backend they choose, the report
folder, the exit status. The work is elsewhere: loading and planning the scenario
(``loading``, ``planning``), running it (``runner`` with a backend), building its report
(``reporting``) and rendering that (``ricllm.report``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from ricllm.config import merge_layers
from ricllm.errors import RicllmError
from ricllm.replay.engine_backend import InProcessBackend
from ricllm.replay.reporting import build_report
from ricllm.replay.runner import Replayer
from ricllm.replay.schema import SCENARIO_PROFILE
from ricllm.replay.zmq_backend import ZmqBackend

EXIT_TARGETS_MISSED = 1
EXIT_INTERRUPTED = 130


def add_replay_subparser(sub: argparse._SubParsersAction) -> None:
    """``ricllm replay``: registered by ``ricllm.cli.build_parser``."""
    parser = sub.add_parser(
        "replay", help="replay a RAN KPI trace scenario against the engine and write a report",
        description="Replay a scenario (a YAML file, or a bundled name: default, overload, stress, templates): send its "
                    "requests on the trace's schedule, open loop, in-process or to a running `ricllm serve`, then "
                    "write report.json, report.html and plots. Exit status 1 when the scenario's compliance "
                    "targets are missed, 2 for a mistake in the scenario, 130 when interrupted.")
    parser.add_argument("scenario", help="scenario file, or the name of a bundled scenario")
    parser.add_argument("--endpoint", default=None,
                        help="replay against `ricllm serve` at this ZeroMQ endpoint (e.g. tcp://127.0.0.1:5555) "
                             "instead of an engine in this process")
    parser.add_argument("--out", default=None, help="report folder (default: reports/<scenario>-<YYYYmmdd-HHMMSS>)")
    parser.add_argument("--speed", type=float, default=None, help="replay speed over the trace's timestamps "
                        "(default: the scenario's pacing.speed)")
    parser.add_argument("--latency-fit", default=None, help="stored latency-model fit (JSON) for admission, "
                        "instead of calibrating (in-process only)")
    parser.add_argument("--model", default=None, help="model file, overriding the scenario's engine.model "
                        "(in-process only)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a scenario field, e.g. --set engine.enable_prefix_caching=false (repeatable)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-adapters", action="store_true",
                        help="serve every template as it is written, on the base model, ignoring the LoRA adapters "
                             "templates name (to compare decisions with and without them)")
    parser.add_argument("--audit", action="store_true",
                        help="audit the refusals: first replay the same trace with every request admitted (EDF, none "
                             "refused or dropped) and under the fcfs and edf baselines (drop-late), then as the "
                             "scenario says; report.json's `audit` says which refusals would have met their "
                             "deadline, and each run's goodput (four replays; in-process only)")
    parser.set_defaults(func=cmd_replay)


def cmd_replay(args: argparse.Namespace) -> int:
    from ricllm.replay.loading import ScenarioError

    if args.speed is not None and not args.speed > 0:
        raise ScenarioError(f"--speed must be > 0, got {args.speed}")
    if args.audit and args.endpoint:
        raise RicllmError("--audit replays under other admission policies, in-process only: drop --endpoint")
    audited = _audit_runs(args) if args.audit else None
    scenario, trace, plan, result, mode = _replay(args, args.overrides)
    report = build_report(scenario, list(args.overrides), trace, plan, result, mode, args.endpoint, args.speed
                          or scenario.pacing.speed)
    if audited is not None:
        from ricllm.replay.audit import refusal_audit

        report["audit"] = refusal_audit(result.records, audited)
    directory = Path(args.out) if args.out else _default_out(scenario.name, report["created_at"])
    from ricllm.report import print_summary, write_report

    paths = write_report(report, directory)
    print_summary(report)
    print(f"report: {paths['html']}", file=sys.stderr)
    if result.interrupted:
        return EXIT_INTERRUPTED
    return 0 if report["compliant"] else EXIT_TARGETS_MISSED


def _replay(args: argparse.Namespace, overrides: list[str]):
    """One replay of the scenario with ``overrides``: (scenario, trace, plan, result, backend mode)."""
    from ricllm.replay.loading import ScenarioError, load_scenario, load_scenario_trace
    from ricllm.replay.planning import plan_requests

    scenario = load_scenario(args.scenario, overrides)
    speed = args.speed or scenario.pacing.speed
    trace = load_scenario_trace(scenario)
    plan = plan_requests(scenario, trace, speed)
    if not plan:
        raise ScenarioError(f"{scenario.path.name}: no trigger fires on the {len(trace.rows)} rows of the trace "
                            "(in the pacing window): nothing to replay")
    backend = _backend(args, scenario, plan)
    adapters = {} if args.no_adapters or args.endpoint else _adapters(args, scenario)
    replayer = Replayer(scenario, plan, backend, progress=False if args.no_progress else None, speed=speed,
                        adapters=adapters)
    return scenario, trace, plan, asyncio.run(replayer.run()), backend.mode


def _adapters(args: argparse.Namespace, scenario) -> dict:
    """The templates' adapters (``ricllm.replay.adapters``), trained now where a recipe's is not cached."""
    from ricllm.model.loader import resolve_model_path
    from ricllm.replay.adapters import scenario_adapters

    model = engine_kwargs(scenario, args.model).get("model")
    return scenario_adapters(scenario, resolve_model_path(model), progress=not args.no_progress)


def _audit_runs(args: argparse.Namespace) -> dict[str, list]:
    """The audit's replays, each policy over the scenario's own overrides: records by policy."""
    from ricllm.replay.audit import AUDIT_POLICIES, policy_overrides

    runs = {}
    for name in AUDIT_POLICIES:
        print(f"audit: replaying under {name}", file=sys.stderr)
        runs[name] = _replay(args, [*args.overrides, *policy_overrides(name)])[3].records
    return runs


def _backend(args: argparse.Namespace, scenario, plan: list):
    if args.endpoint:
        if not args.endpoint.startswith(("tcp://", "ipc://")):
            raise RicllmError(f"--endpoint {args.endpoint!r}: expected tcp://HOST:PORT or ipc://PATH")
        for flag, value in (("--latency-fit", args.latency_fit), ("--model", args.model)):
            if value:
                raise RicllmError(f"{flag} applies to in-process replays; over ZeroMQ the server's own setting holds")
        return ZmqBackend(args.endpoint, timeout_s=scenario.pacing.drain_timeout_s)
    return InProcessBackend(engine_kwargs(scenario, args.model, args.latency_fit))


def engine_kwargs(scenario, model: str | None = None, latency_fit: str | None = None) -> dict[str, Any]:
    """``EngineConfig`` arguments: the scenario's engine section over the scenario profile, its paths
    resolved, CLI flags over it.

    The tightest deadline class sets ``admission.tightest_deadline_ms``/``_tokens`` unless the scenario does.
    """
    kwargs = merge_layers(SCENARIO_PROFILE, scenario.engine.model_dump(exclude_unset=True))
    for name in ("model", "latency_fit"):
        if name in kwargs:
            kwargs[name] = scenario.resolve_path(kwargs[name])
    if model:
        kwargs["model"] = model
    if latency_fit:
        kwargs["latency_fit"] = latency_fit
    with_deadline = [c for c in scenario.classes.values() if c.deadline_ms is not None]
    if with_deadline:
        tightest = min(with_deadline, key=lambda c: c.deadline_ms)
        kwargs["admission"].setdefault("tightest_deadline_ms", tightest.deadline_ms)
        kwargs["admission"].setdefault("tightest_deadline_tokens", tightest.max_tokens)
    return kwargs


def _default_out(name: str, created_at: str) -> Path:
    import re

    stamp = datetime.fromisoformat(created_at).astimezone().strftime("%Y%m%d-%H%M%S")
    base = Path("reports") / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}-{stamp}"
    candidate, n = base, 2
    while candidate.exists():
        candidate, n = Path(f"{base}-{n}"), n + 1
    return candidate
