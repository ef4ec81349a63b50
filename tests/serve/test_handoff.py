"""The engine thread hands a batch holding a final reply to the socket thread before going on."""

from __future__ import annotations

import threading

import pytest
import zmq

from ricllm import protocol as p
from ricllm.serve.handoff import Outbox


@pytest.fixture
def outbox(monkeypatch):
    """An outbox whose wake-ups arrive on ``outbox.socket_side``; the hand-over waits up to 10 s."""
    monkeypatch.setattr(Outbox, "HANDOFF_TIMEOUT_S", 10.0)
    context = zmq.Context()
    socket_side = context.socket(zmq.PAIR)
    socket_side.bind("inproc://handoff-test")
    box = Outbox(context, "inproc://handoff-test")
    box.socket_side = socket_side
    yield box
    box.close()
    socket_side.close(linger=0)
    context.term()


def _wake_in_thread(outbox: Outbox) -> threading.Thread:
    thread = threading.Thread(target=outbox.wake, daemon=True)
    thread.start()
    return thread


def _result(request_id: str) -> p.Result:
    return p.Result(id=request_id, text="x", token_ids=[5], num_prompt_tokens=3, num_cached_tokens=0,
                    finish_reason="length", timings=p.Timings(queue_s=0.0, e2e_s=0.01), deadline_met=None)


def test_a_result_is_handed_over_the_engine_thread_waits_until_it_is_sent(outbox):
    outbox.put(b"client", _result("r1"))
    waking = _wake_in_thread(outbox)
    assert outbox.socket_side.poll(5000), "the socket thread was not woken"
    waking.join(0.2)
    assert waking.is_alive(), "the engine thread went on before the result was sent"
    identity, request_id, frame, final = outbox.items.get_nowait()  # what the socket thread does
    assert (identity, request_id, final, p.decode_reply(frame)) == (b"client", "r1", True, _result("r1"))
    outbox.sent.set()
    waking.join(5)
    assert not waking.is_alive()


def test_accepted_and_tokens_are_not_waited_for(outbox):
    outbox.put(b"client", p.Accepted(id="r2"))
    outbox.put(b"client", p.Token(id="r2", index=0, token_id=5, text="x"))
    waking = _wake_in_thread(outbox)
    waking.join(5)
    assert not waking.is_alive(), "the engine thread waited for replies that are not final"
    assert outbox.socket_side.poll(5000)
    assert outbox.items.qsize() == 2


def test_a_socket_thread_that_never_sends_costs_the_engine_thread_the_timeout_only(outbox, monkeypatch):
    monkeypatch.setattr(Outbox, "HANDOFF_TIMEOUT_S", 0.05)
    outbox.put(b"client", _result("r3"))
    waking = _wake_in_thread(outbox)
    waking.join(5)
    assert not waking.is_alive()
