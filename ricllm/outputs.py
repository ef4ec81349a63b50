"""What a finished request gives back."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestOutput:
    """Flat result of one request; timings in seconds on the engine's monotonic clock."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    num_cached_tokens: int
    finish_reason: str  # "stop" or "length"
    ttft_s: float
    e2e_s: float

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_ids) < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (len(self.token_ids) - 1)
