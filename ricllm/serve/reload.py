"""Live reconfiguration of ``ricllm serve``: ``$CONFIG_FILE`` watched, and the configuration it runs with.

The OSC xApp frameworks watch the file the platform mounts at ``$CONFIG_FILE`` (a config map) and
let an xApp take a new one without a restart. Here the ``ricllm-config`` thread watches it
(``watchfiles``) and, when it changes, resolves the settings again, every layer in its place (a
flag the user gave still wins over the file), then compares them with the running ones:

- a changed control in :data:`ricllm.config.LIVE_CONTROLS` (read afresh at each admission decision, step or log
  event) is handed to the engine thread, which applies it between two steps
  (:func:`apply_live_changes`): the watcher never touches the engine;
- a changed ``lora_modules`` is handed over the same way, and the engine thread makes the adapters it
  holds those the list names (the server's ``adapters`` hook: add, replace, remove; requests in flight
  finish on the adapter they started under). What it could not do (a removal a registered template
  refuses, an adapter that does not load) leaves the running adapter and its entry: the
  configuration published names what is served, and the watcher compares the file with that;
- any other changed control shaped what was built at start (the model, the KV cache, the sockets):
  it is refused with a ``config_reload_refused`` event naming it, and the running value stays;
- a file that cannot be read, parsed or validated changes nothing: ``config_reload_failed`` says why.

:class:`ricllm.config.ServeConfig` is what ``GET /ric/v1/config`` shows (:func:`config_body`): the
controls running now and where each came from. The engine thread publishes a new one whole once a
change applies; the HTTP thread reads it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from ricllm.config import (
    LIVE_CONTROLS,
    ServeConfig,
    ServeSettings,
    effective_log_level,
    flatten_settings,
    lora_module_paths,
)
from ricllm.errors import ConfigError
from ricllm.logging import get_logger, set_log_level

if TYPE_CHECKING:
    from watchfiles import Change

    from ricllm.engine.llm_engine import LLMEngine

log = get_logger("ricllm.serve.config")

WATCH_STEP_MS = 50  # a change is taken once the file has been quiet this long (an editor's several writes)
WATCH_TIMEOUT_MS = 500  # the watcher reports it is watching after at most this long
STOP_TIMEOUT_S = 5.0


def config_body(config: ServeConfig, watching: bool) -> dict[str, Any]:
    """The JSON of ``GET /ric/v1/config``; ``watching``: whether changes to the file are being seen."""
    return {"controls": config.controls.model_dump(mode="json"), "sources": config.sources,
            "live_controls": list(LIVE_CONTROLS), "config_file": config.watched_file, "watching": watching,
            "reloads": config.reloads}


@dataclass(frozen=True)
class LiveChange:
    """New values of live controls (dotted names), from the watcher thread to the engine thread,
    with the configuration to publish once they apply."""

    values: dict[str, Any]
    config: ServeConfig

    def admission(self) -> dict[str, Any]:
        """``{"admission.max_queue": 4, "log_level": "DEBUG"}`` -> ``{"max_queue": 4}``."""
        return {name.removeprefix("admission."): value for name, value in self.values.items()
                if name.startswith("admission.")}


@dataclass(frozen=True)
class ReloadPlan:
    """What a new file asks for, against the running controls."""

    live: dict[str, Any] = field(default_factory=dict)  # changed live controls -> new value
    refused: dict[str, Any] = field(default_factory=dict)  # changed controls that need a restart -> asked value


def plan_reload(running: ServeSettings, candidate: ServeSettings) -> ReloadPlan:
    """Sort the controls that differ into live ones (taken) and the rest (refused)."""
    before, after = flatten_settings(running.model_dump()), flatten_settings(candidate.model_dump())
    changed = {name: value for name, value in after.items() if before.get(name) != value}
    live = {name: value for name, value in changed.items() if name in LIVE_CONTROLS}
    refused = {name: value for name, value in changed.items() if name not in LIVE_CONTROLS}
    return ReloadPlan(live, refused)


# ------------------------------------------------------------------------------ the engine thread's side

AdapterHook = Callable[[dict[str, str]], dict[str, str]]  # adapters wanted (name -> folder) -> those held after


def apply_live_changes(engine: LLMEngine, changes: queue.SimpleQueue[LiveChange],
                       publish: Callable[[ServeConfig], None], adapters: AdapterHook) -> None:
    """Every change the watcher handed over, in order; called on the engine thread between steps.
    ``adapters`` makes the adapters held those a changed ``lora_modules`` names."""
    while True:
        try:
            change = changes.get_nowait()
        except queue.Empty:
            return
        publish(_apply(engine, change, adapters))


def _apply(engine: LLMEngine, change: LiveChange, adapters: AdapterHook) -> ServeConfig:
    """Apply one change; the configuration to publish (``lora_modules`` as served)."""
    admission = change.admission()
    if admission:
        engine.set_admission_controls(**admission)
    if "log_level" in change.values:
        set_log_level(effective_log_level(change.values["log_level"]))
    config = change.config
    if "lora_modules" in change.values:
        held = adapters(lora_module_paths(change.values["lora_modules"]))
        served = [f"{name}={path}" for name, path in held.items()]
        config = replace(config, controls=config.controls.model_copy(update={"lora_modules": served}))
    log.info("config_applied", changed=change.values, reloads=change.config.reloads)
    return config


# ------------------------------------------------------------------------------ the watcher thread

class ConfigWatcher:
    """Watches ``$CONFIG_FILE`` on its own thread; decides, never applies: live changes go to
    ``hand_over`` (the engine thread's queue). It watches the file's folder, so a file replaced by a
    rename (editors, ``kubectl`` updating a mounted config map through its ``..data`` link) is seen."""

    def __init__(self, config: ServeConfig, hand_over: Callable[[LiveChange], None],
                 published: Callable[[], ServeConfig | None] | None = None) -> None:
        """``published``: the configuration the engine thread last published (its ``lora_modules`` are
        the adapters served, which may differ from what was handed over)."""
        self.path = Path(config.watched_file)
        self._running = config  # live changes included, once handed over
        self._hand_over = hand_over
        self._published = published
        self._stop = threading.Event()
        self.watching = threading.Event()  # set while changes to the file are seen
        self._thread = threading.Thread(target=self._run, name="ricllm-config", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(STOP_TIMEOUT_S)

    def _run(self) -> None:
        from watchfiles import watch  # here: the server's start does not wait for its import

        try:
            for changes in watch(self.path.parent, watch_filter=self._concerns_the_file, step=WATCH_STEP_MS,
                                 stop_event=self._stop, rust_timeout=WATCH_TIMEOUT_MS, yield_on_timeout=True,
                                 recursive=False, raise_interrupt=False):
                first = not self.watching.is_set()
                if first:
                    self.watching.set()
                    log.info("config_watching", file=str(self.path), live_controls=list(LIVE_CONTROLS))
                if changes or first:  # first: a change made before the watch began is not missed
                    self.reload()
        except Exception:  # the server carries on with the configuration it has
            log.exception("config_watch_fault", file=str(self.path))
        finally:
            self.watching.clear()

    def _concerns_the_file(self, change: Change, path: str) -> bool:
        """The file itself, or a config map's ``..data`` link and folders being swapped."""
        name = Path(path).name
        return name == self.path.name or name.startswith("..")

    def _served_controls(self) -> ServeSettings:
        """The running controls, ``lora_modules`` as served: an adapter kept against the file (a refused
        removal, a failed load) is asked for again at the next change of the file."""
        published = self._published() if self._published is not None else None
        if published is None:
            return self._running.controls
        return self._running.controls.model_copy(update={"lora_modules": published.controls.lora_modules})

    def reload(self) -> ReloadPlan | None:
        """Resolve the settings again; refuse what needs a restart, hand over what can change live."""
        try:
            candidate = self._running.resolve_again()
        except (ConfigError, ValidationError) as exc:
            log.warning("config_reload_failed", file=str(self.path), error=str(exc), kept="running configuration")
            return None
        plan = plan_reload(self._served_controls(), candidate.controls)
        if plan.refused:
            log.warning("config_reload_refused", file=str(self.path), restart_required=sorted(plan.refused),
                        asked=plan.refused, reason="these controls take effect only at start; restart to apply")
        if plan.live:
            self._running = self._running.with_live(plan.live, candidate.sources)
            self._hand_over(LiveChange(plan.live, self._running))
            log.info("config_reload_accepted", file=str(self.path), changed=plan.live)
        return plan
