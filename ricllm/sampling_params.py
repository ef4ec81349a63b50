"""How to pick tokens and when to stop: the per-request knobs, checked when they are made."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from ricllm.errors import InvalidRequestError
from ricllm.structured.fallback import Fallback
from ricllm.structured.spec import StructuredSpec

# the scheduling classes, the one list: the wire protocol, the OpenAI API, scenarios, the CLI and the
# metrics' deadline_class label all read it
Priority = Literal["near_rt", "non_rt", "best_effort"]
PRIORITIES: tuple[str, ...] = get_args(Priority)
NEAR_RT_MAX_MS = 1000.0  # the near-RT RIC's control loop: 10 ms to 1 s


def default_priority(deadline_ms: float | None) -> str:
    """A request's class when it names none: near-RT up to 1 s of deadline, non-RT above, else best effort."""
    if deadline_ms is None:
        return "best_effort"
    return "near_rt" if deadline_ms <= NEAR_RT_MAX_MS else "non_rt"


@dataclass
class SamplingParams:
    """``temperature=0`` is greedy. ``top_k <= 0`` and ``top_p = 1`` switch those filters off.

    ``seed`` makes a sampled request reproducible whatever else shares its batch.
    ``structured`` constrains the answer (vLLM's ``structured_outputs`` keys: ``{"json": schema}``,
    ``{"choice": [...]}``, ``{"regex": ...}``, ``{"grammar": ...}``); it is kept as a ``StructuredSpec``.
    ``stop`` strings end the output before the string; ``stop_token_ids`` and the model's EOS
    end it after the token (not shown in ``text``) unless ``ignore_eos``.
    ``fallback`` (with ``structured``) answers its ``answer`` instead of a decision whose
    confidence is below its ``min_confidence`` (``ricllm.structured.fallback``).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    deadline_ms: float | None = None  # from arrival at the engine, on the engine's clock; None = best effort
    priority: str | None = None  # near_rt, non_rt or best_effort; derived from deadline_ms when None
    structured: StructuredSpec | dict[str, Any] | None = None
    kv_window: int | None = None  # keep only the last kv_window tokens' K/V; None: the engine's; 0: exact
    kv_sinks: int | None = None  # first tokens kept with a window; None: the engine's kv_sinks
    fallback: Fallback | None = None  # the answer given instead of a decision below its min_confidence

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.structured is not None:
            self.structured = StructuredSpec.parse(self.structured)
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int):
            raise InvalidRequestError(f"top_k must be an integer, got {self.top_k!r}")
        if self.fallback is not None and (not isinstance(self.fallback, Fallback) or self.structured is None):
            raise InvalidRequestError("fallback is a Fallback, and needs a structured constraint its answer satisfies")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        for name in ("kv_window", "kv_sinks"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise InvalidRequestError(f"{name} must be an integer >= 0 (or null: the engine's), got {value!r}")
        self._validate_deadline()

    def _validate_deadline(self) -> None:
        if self.deadline_ms is not None:
            if isinstance(self.deadline_ms, bool) or not isinstance(self.deadline_ms, (int, float)):
                raise InvalidRequestError(f"deadline_ms must be a number of milliseconds, got {self.deadline_ms!r}")
            if not self.deadline_ms > 0:
                raise InvalidRequestError(f"deadline_ms must be > 0, got {self.deadline_ms}")
        if self.priority is None:
            self.priority = default_priority(self.deadline_ms)
        if self.priority not in PRIORITIES:
            raise InvalidRequestError(f"unknown priority {self.priority!r}; choose one of {', '.join(PRIORITIES)}")
        if self.priority != "best_effort" and self.deadline_ms is None:
            raise InvalidRequestError(f"priority {self.priority!r} needs a deadline_ms")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
