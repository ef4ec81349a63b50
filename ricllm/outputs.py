"""What a request gives back: its tokens and timings, or why it was refused."""

from __future__ import annotations

from dataclasses import dataclass, field

REJECTION_CODES = ("KV_BUDGET", "KV_RESERVED", "CONTEXT_TOO_LONG", "DEADLINE_INFEASIBLE", "QUEUE_FULL",
                   "OUTPUT_TOO_SHORT")


@dataclass(frozen=True)
class Rejection:
    """Why admission refused a request, with the numbers behind the decision."""

    code: str
    message: str
    numbers: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


@dataclass(frozen=True)
class Degradation:
    """Admission's opt-in ``degrade`` policy admitted the request with fewer tokens than asked.

    ``code`` is the refusal it avoided, ``numbers`` the refusal's numbers at the requested length.
    """

    code: str
    requested_max_tokens: int
    granted_max_tokens: int
    message: str
    numbers: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return f"degraded ({self.code}): {self.message}"


@dataclass
class RequestOutput:
    """Flat result of one request; timings in seconds on the engine's monotonic clock.

    ``finish_reason``: ``stop``, ``length``, ``rejected`` (refused at arrival, see
    ``rejection``), ``deadline`` (aborted once its deadline passed, when so configured) or
    ``fallback`` (a whole constrained answer below its ``min_confidence``: ``text`` is the
    fallback's answer, ``model_text`` the model's own, ``token_ids`` the model's tokens).
    ``confidence`` is a constrained answer's decision confidence (``ricllm.structured.fallback``),
    None for unconstrained text.
    ``deadline_met`` is None when the request had no deadline or was rejected. ``degradation``
    is set when the ``degrade`` policy admitted it with a smaller ``max_tokens`` than asked.
    A constrained answer that ends by ``length`` is incomplete (it does not parse): never hidden.
    ``predicted_e2e_s`` is the bound admission promised it against (safety margin not included),
    for the work known at its arrival: ``predicted_e2e_s / e2e_s`` is how tight the bound was.
    ``promised_e2e_s`` is its bound as of the last admission that counted it: a request admitted
    later may share its steps, and was admitted only if this one stayed on time beside it.
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
    degradation: Degradation | None = None  # set when admission shrank max_tokens (degrade policy)
    num_forced_tokens: int = 0  # output tokens the answer's grammar forced (appended without sampling)
    predicted_e2e_s: float | None = None  # admission's finish bound for it, from arrival (promised requests)
    promised_e2e_s: float | None = None  # the same, as of the last admission that counted it
    confidence: float | None = None  # a constrained answer's decision confidence; None: unconstrained
    model_text: str | None = None  # the model's own answer, when the fallback replaced it

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_ids) < 2 or self.e2e_s is None or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (len(self.token_ids) - 1)
