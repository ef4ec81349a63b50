"""What a replay records: one ``RequestRecord`` per sent request, timeline samples, and the
``report.json`` that holds them with everything needed to judge and reproduce the run.

The report keeps the raw per-request records, not only aggregates, so anyone can recompute the
numbers (``ricllm report`` re-renders from this file alone) and compare two runs. Times are
seconds: ``*_s`` offsets from the replay's start on the client's monotonic clock, ``server_*``
durations measured by the engine from its receipt of the request, ``client_*`` durations measured
by the replay from just before sending. Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ricllm.errors import RicllmError

SCHEMA_VERSION = 1
#: How a sent request ended. ``interrupted``: still outstanding when the replay was stopped (Ctrl-C);
#: ``timeout``: no answer within the drain timeout; ``error``: the engine refused it as malformed.
STATUSES = ("completed", "rejected", "error", "interrupted", "timeout")
#: The finish reasons of a request that produced an answer: it ended by itself, at its length
#: limit, or with its template's fallback in place of an unsure decision (``deadline`` and
#: ``cancelled`` are cut off by the engine, with no answer to act on).
ANSWERED_REASONS = ("stop", "length", "fallback")
#: ``answer.get(field, MISSING)`` for a field the answer lacks: ``None`` is a value an answer may hold.
MISSING = object()


def timeline_sample(kv_cache: Any, running: int, waiting: int) -> dict[str, Any]:
    """The timeline fields both backends sample: from the engine's snapshot in process, from the
    server's typed ``stats`` reply over ZeroMQ (a ``KVCacheStats`` either way)."""
    return {"kv_used_blocks": kv_cache.used_blocks, "kv_num_blocks": kv_cache.num_blocks,
            "kv_pinned_blocks": kv_cache.pinned_blocks, "running": running, "waiting": waiting,
            "preemptions": kv_cache.preemptions}


class ReportError(RicllmError, ValueError):
    """A report file that cannot be read (missing, not JSON, another schema version)."""


@dataclass
class RequestRecord:
    id: str
    entity: str
    trace_time_s: float
    trace_line: int
    trigger: str
    deadline_class: str
    template: str | None
    deadline_ms: float | None
    max_tokens: int
    scheduled_s: float
    sent_s: float | None = None
    done_s: float | None = None
    status: str = "pending"
    admitted: bool | None = None
    rejection_code: str | None = None
    rejection_message: str | None = None
    rejection_numbers: dict[str, Any] | None = None  # the refusal's numbers: for time, its bound_ms and the deadline_ms left
    finish_reason: str | None = None
    server_queue_s: float | None = None
    server_ttft_s: float | None = None
    server_e2e_s: float | None = None
    client_ttft_s: float | None = None
    client_e2e_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    granted_max_tokens: int | None = None  # set when admission's degrade policy shrank max_tokens
    met: bool | None = None
    client_met: bool | None = None
    text: str | None = None
    num_forced_tokens: int | None = None  # tokens the grammar forced (no sampling), when the engine says
    predicted_e2e_s: float | None = None  # admission's finish bound for it (promised requests): server_e2e_s's bound
    promised_e2e_s: float | None = None  # that bound as of the last admission that counted it
    expected: dict[str, Any] | None = None  # the reference policy's fields for this row (template's expect)
    valid: bool | None = None  # the answer satisfies its template's constraint; None: no constraint or no answer
    answer: Any = None  # the parsed answer object of a valid answer
    correct: bool | None = None  # every expected field equals the answer's; None: no expectation or no answer
    reaction_window: int | None = None  # the fault phase admitted before the slowdown detector reacted to it
    adapter: str | None = None  # the LoRA adapter it was served under (its template's); None: the base model
    confidence: float | None = None  # the decision's confidence (ricllm.structured.fallback); None: free text
    model_text: str | None = None  # the model's own answer, when its template's fallback replaced it
    model_correct: bool | None = None  # whether the model's own answer was correct: ``correct``, or of model_text

    @property
    def answered(self) -> bool:
        """Admitted and finished with an answer (possibly an invalid one)."""
        return self.status == "completed" and self.finish_reason in ANSWERED_REASONS

    @property
    def useful(self) -> bool | None:
        """Valid, correct and on time: a decision the RAN can act on; None without a reference policy."""
        if self.expected is None:
            return None
        return bool(self.valid and self.correct and self.met)

    def finish(self, status: str, **values: Any) -> None:
        """Set the outcome; ``met`` is false unless the engine says the deadline was met (or none was set)."""
        self.status = status
        for name, value in values.items():
            setattr(self, name, value)
        if status != "completed":
            self.met = self.client_met = False
            return
        if self.deadline_ms is None:
            self.met = self.client_met = True
            return
        if self.met is None and self.server_e2e_s is not None:
            self.met = self.server_e2e_s * 1000 <= self.deadline_ms
        if self.client_e2e_s is not None:
            self.client_met = self.client_e2e_s * 1000 <= self.deadline_ms

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def machine_info() -> dict[str, Any]:
    """CPU model, cores, OS and Python; torch and its threads when it is loaded (in-process runs)."""
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpu": _cpu_model(), "cores": os.cpu_count(), "hostname": platform.node()}
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def records_to_json(records: list[RequestRecord]) -> list[dict[str, Any]]:
    return [asdict(r) for r in records]


def write_report_json(report: dict[str, Any], directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "report.json"
    path.write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
    return path


def load_report(path: str | Path) -> tuple[dict[str, Any], Path]:
    """A report.json (or a folder holding one) -> (report, its path)."""
    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ReportError(f"cannot read report {str(path)!r}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path}: not JSON (line {exc.lineno}: {exc.msg})") from None
    version = report.get("schema_version") if isinstance(report, dict) else None
    if version != SCHEMA_VERSION:
        raise ReportError(f"{path}: schema_version {version!r} is not {SCHEMA_VERSION}, which this ricllm "
                          "reads; is this a ricllm replay report?")
    return report, path


def report_records(report: dict[str, Any]) -> list[RequestRecord]:
    return [RequestRecord.from_dict(r) for r in report.get("requests", [])]
