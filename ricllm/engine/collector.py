"""When Python's cyclic garbage collector may walk the whole heap: between bursts, not between two steps.

A full (generation 2) collection walks every tracked object that is not frozen (``freeze_heap``),
on whichever thread happened to allocate when its threshold passed. Behind the GIL the engine's
thread waits it out in the middle of a step: replaying ``overload`` with its refusal audit (four
replays' records in one process), full collections took 50-156 ms each, steps next to them ran
1.6-2.1x their fit, and one 400 ms step that ran 664 ms made 46 admitted requests miss.

While an engine loop runs, automatic full collections are off; the young generations still
collect automatically (objects of the last few thousand allocations: well under a millisecond).
The loop runs a full collection itself when it has been idle for a whole inbox wait, and, so that
an engine that is never idle does not grow its heap without bound, at a step's boundary once
``DEFERRED_LIMIT`` young collections have run since the last full one.
"""

from __future__ import annotations

import gc
import threading

DEFERRED_LIMIT = 100  # young (generation 1) collections a busy loop lets pass before a full one: 10x the default
_NEVER = 2**31 - 1  # a generation-2 threshold that automatic collection never reaches

_lock = threading.Lock()
_holders = 0
_saved_thresholds: tuple[int, int, int] | None = None


def freeze_heap() -> None:
    """Keep the objects alive now (the model, the tokenizer, every import) out of every later
    collection: collected first, so no garbage is frozen with them."""
    gc.collect()
    gc.freeze()


class FullCollections:
    """Full collections at the loop's idle rounds. Invariant: between ``hold()`` and ``release()``
    (per loop; several loops share one setting, restored when the last releases), no automatic
    full collection runs, and the young collections since the last full one (``gc.get_count()[2]``)
    stay under ``DEFERRED_LIMIT`` at every round's end."""

    def __init__(self, deferred_limit: int = DEFERRED_LIMIT) -> None:
        self.deferred_limit = deferred_limit
        self.collections = 0  # full collections this loop ran

    def hold(self) -> None:
        global _holders, _saved_thresholds
        with _lock:
            if _holders == 0:
                _saved_thresholds = gc.get_threshold()
                young, middle, _ = _saved_thresholds
                gc.set_threshold(young, middle, _NEVER)
            _holders += 1

    def release(self) -> None:
        global _holders
        with _lock:
            _holders -= 1
            if _holders == 0 and _saved_thresholds is not None:
                gc.set_threshold(*_saved_thresholds)

    def after_round(self, idle: bool) -> None:
        """``idle``: nothing ran and nothing arrived for a whole inbox wait. A full collection then
        if anything aged since the last one; while busy, only past ``deferred_limit``."""
        aged = gc.get_count()[2]
        if (idle and aged > 0) or aged >= self.deferred_limit:
            gc.collect()
            self.collections += 1
