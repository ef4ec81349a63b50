"""From sampled tokens to what a request answers: its text, why it ends, and its ``RequestOutput``.

Each step hands ``OutputProcessor.append`` the tokens it sampled; the processor appends them (and
what a grammar then forces), detokenizes, applies stop tokens, stop strings and length, and names
the requests that end. The engine ends them (the scheduler frees their blocks, admission releases
their reservation) and the processor builds their outputs and keeps the deadline tally. A whole
constrained answer whose confidence is below its ``fallback``'s ``min_confidence`` ends as
``fallback``: its text is the fallback's answer, the model's own is kept beside it.
"""

from __future__ import annotations

from collections import deque

from ricllm.engine.constrained import ConstrainedDecoding
from ricllm.logging import get_logger
from ricllm.model.tokenizer import IncrementalDetokenizer, Tokenizer
from ricllm.outputs import Rejection, RequestOutput
from ricllm.sequence import Sequence, SequenceStatus

log = get_logger("ricllm.engine")
SLACK_KEPT = 4096  # finished deadline requests whose slack the snapshot reports


class OutputProcessor:
    """Owns each request's detokenized text, the outputs of refused requests until the next step
    returns them, and the deadline tally: ``deadline_counts`` (met, missed, ended_early by
    ``on_late``) and ``slack_ms`` (deadline − finish of the latest finished deadline requests).

    Invariant: a request's ``output_text`` is the detokenized text of its output tokens, less a
    stop token and anything from a stop string on.
    """

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, constraints: ConstrainedDecoding) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.constraints = constraints
        self.deadline_counts = {"met": 0, "missed": 0, "ended_early": 0}
        self.slack_ms: deque[float] = deque(maxlen=SLACK_KEPT)
        self.refused: list[RequestOutput] = []  # returned by the next step

    def start(self, seq: Sequence) -> None:
        """Begin the text of an admitted request (its forced start already in it)."""
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.token_ids[:seq.num_prompt_tokens],
                                                 seq.params.skip_special_tokens)
        for token in seq.output_token_ids:
            seq.detokenizer.add(token)
        seq.output_text = seq.detokenizer.text

    def append(self, ready: list[Sequence], tokens: list[int], now: float) -> list[tuple[Sequence, str]]:
        """Add each request's sampled token; the requests that end now, with their finish reasons."""
        ended = []
        for seq, token in zip(ready, tokens):
            reason = self._append_token(seq, token, now)
            if reason == "stop" and seq.params.fallback is not None and seq.params.fallback.replaces(seq.confidence):
                reason = _fall_back(seq)
            if reason is not None:
                ended.append((seq, reason))
        return ended

    def _append_token(self, seq: Sequence, token: int, now: float) -> str | None:
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        params = seq.params
        if (not params.ignore_eos and token in self.tokenizer.eos_token_ids) or token in params.stop_token_ids:
            reason = "stop"  # the stop token ends the output but is not part of its text
        else:
            seq.detokenizer.add(token)
            reason = self._follow_grammar(seq, token) if seq.guide is not None else None
            out_of_room = seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len
            reason = reason or ("length" if out_of_room else None)
        if reason is not None:
            seq.detokenizer.finish()  # flush text held back for an unfinished UTF-8 character
        seq.output_text = seq.detokenizer.text
        if params.stop and _truncate_at_stop(seq):
            return "stop"
        return reason

    def _follow_grammar(self, seq: Sequence, token: int) -> str | None:
        """What the grammar forces after ``token`` joins the text; "stop" once the answer is whole
        (its end is not sampled: the grammar allows nothing else)."""
        for forced in self.constraints.advance(seq, token):
            seq.detokenizer.add(forced)
        return "stop" if seq.guide.is_complete else None

    def finish(self, seq: Sequence, aborted: bool = False) -> RequestOutput:
        """The output of a request the engine has ended. A deadline request left to finish counts
        as met, missed or ended early; an aborted one (cancelled) counts as none, and its text so
        far is flushed."""
        if aborted and seq.detokenizer is not None:
            seq.detokenizer.finish()
            seq.output_text = seq.detokenizer.text
        if seq.deadline is not None and not aborted:
            late = seq.finish_time > seq.deadline
            self.deadline_counts["missed" if late else "ended_early" if seq.finish_reason == "deadline" else "met"] += 1
            self.slack_ms.append((seq.deadline - seq.finish_time) * 1000)
        return self.output(seq)

    def refuse(self, seq: Sequence, rejection: Rejection, now: float) -> None:
        """Finish a request refused at arrival; its output waits in ``refused`` for the next step."""
        del seq.token_ids[seq.num_prompt_tokens:]  # a refused request answers nothing, forced start included
        seq.num_forced_tokens = seq.num_forced_at_arrival = 0
        seq.confidence = None  # it decided nothing
        seq.rejection = rejection
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "rejected"
        seq.finish_time = now
        self.refused.append(self.output(seq))
        log.info("request_rejected", request_id=seq.request_id, code=rejection.code, **rejection.numbers)

    def take_refused(self) -> list[RequestOutput]:
        refused, self.refused = self.refused, []
        return refused

    @staticmethod
    def output(seq: Sequence) -> RequestOutput:
        def since_arrival(t: float | None) -> float | None:
            return None if t is None else t - seq.arrival_time

        rejected = seq.finish_reason == "rejected"
        met = None if seq.deadline is None or rejected else (
            seq.finish_time <= seq.deadline and seq.finish_reason != "deadline")  # an answer ended early is not met
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt,
            prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens], text=seq.output_text,
            token_ids=seq.output_token_ids, num_cached_tokens=max(seq.num_cached_tokens, 0),
            finish_reason=seq.finish_reason, ttft_s=since_arrival(seq.first_token_time),
            e2e_s=since_arrival(seq.finish_time), queue_s=since_arrival(seq.first_scheduled_time),
            admitted=not rejected, rejection=seq.rejection, deadline_met=met, confidence=seq.confidence,
            model_text=seq.model_text,
            deadline_ms=seq.params.deadline_ms, degradation=seq.degradation, num_forced_tokens=seq.num_forced_tokens,
            predicted_e2e_s=since_arrival(seq.predicted_finish), promised_e2e_s=since_arrival(seq.promised_finish))


def _fall_back(seq: Sequence) -> str:
    """Answer the fallback instead of the model's unsure decision, which is kept as ``model_text``."""
    fallback = seq.params.fallback
    seq.model_text, seq.output_text = seq.output_text, fallback.answer
    log.info("decision_fell_back", request_id=seq.request_id, confidence=seq.confidence,
             min_confidence=fallback.min_confidence)
    return "fallback"


def _truncate_at_stop(seq: Sequence) -> bool:
    hits = [i for i in (seq.output_text.find(s) for s in seq.params.stop) if i >= 0]
    if not hits:
        return False
    seq.output_text = seq.output_text[:min(hits)]
    return True
