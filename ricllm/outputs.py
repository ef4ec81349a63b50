"""What a request gives back: its tokens and timings, or why it was refused."""

from __future__ import annotations

from dataclasses import dataclass, field

REJECTION_CODES = ("KV_BUDGET", "CONTEXT_TOO_LONG", "DEADLINE_INFEASIBLE", "QUEUE_FULL")


@dataclass(frozen=True)
class Rejection:
    """Why admission refused a request, with the numbers behind the decision."""

    code: str
    message: str
    numbers: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


@dataclass
class RequestOutput:
    """Flat result of one request; timings in seconds on the engine's monotonic clock.

    ``finish_reason``: ``stop``, ``length``, ``rejected`` (refused at arrival, see
    ``rejection``) or ``deadline`` (aborted once its deadline passed, when so configured).
    ``deadline_met`` is None when the request had no deadline or was rejected.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    num_cached_tokens: int
    finish_reason: str
    ttft_s: float | None
    e2e_s: float | None
    queue_s: float | None = None
    admitted: bool = True
    rejection: Rejection | None = None
    deadline_met: bool | None = None
    deadline_ms: float | None = None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_ids) < 2 or self.e2e_s is None or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (len(self.token_ids) - 1)
