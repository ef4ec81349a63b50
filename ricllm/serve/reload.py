"""Live reconfiguration of ``ricllm serve``: ``$CONFIG_FILE`` watched, and the effective configuration.

The OSC xApp frameworks watch the file the platform mounts at ``$CONFIG_FILE`` (a config map) and
let an xApp take a new one without a restart. Here the ``ricllm-config`` thread watches it
(``watchfiles``) and, when it changes, resolves the settings again, every layer in its place (a
flag the user gave still wins over the file), then compares them with the running ones:

- a changed control in :data:`LIVE_CONTROLS` (read afresh at each admission decision, step or log
  event) is handed to the engine thread, which applies it between two steps
  (:func:`apply_live_changes`): the watcher never touches the engine;
- any other changed control shaped what was built at start (the model, the KV cache, the sockets):
  it is refused with a ``config_reload_refused`` event naming it, and the running value stays;
- a file that cannot be read, parsed or validated changes nothing: ``config_reload_failed`` says why.

:class:`EffectiveConfig` is what ``GET /ric/v1/config`` shows: the controls running now and where
each came from. The engine thread replaces it whole once a change applies; the HTTP thread reads it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from ricllm.config import LIVE_ADMISSION_CONTROLS
from ricllm.errors import ConfigError
from ricllm.logging import get_logger, set_log_level
from ricllm.serve.settings import Controls, ServeSettings, effective_log_level, flatten_controls

if TYPE_CHECKING:
    from watchfiles import Change

    from ricllm.config import EngineConfig
    from ricllm.engine.llm_engine import LLMEngine
    from ricllm.serve.settings import ServerOptions

log = get_logger("ricllm.serve.config")

LIVE_CONTROLS: tuple[str, ...] = (*(f"admission.{name}" for name in LIVE_ADMISSION_CONTROLS), "log_level")
WATCH_STEP_MS = 50  # a change is taken once the file has been quiet this long (an editor's several writes)
WATCH_TIMEOUT_MS = 500  # the watcher reports it is watching after at most this long
STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class EffectiveConfig:
    """The controls the server runs with now (JSON values), where each came from, and the watched file."""

    controls: dict[str, Any]
    sources: dict[str, str]  # dotted control name -> the settings layer that set it, or "default"
    config_file: str | None = None
    reloads: int = 0  # live changes applied since start

    @classmethod
    def of(cls, settings: ServeSettings) -> EffectiveConfig:
        return cls(settings.controls.model_dump(mode="json"), dict(settings.sources), settings.inputs.watched_file)

    @classmethod
    def of_arguments(cls, config: EngineConfig, options: ServerOptions) -> EffectiveConfig:
        """A server built from an engine config and options (the Python API): those values, no file."""
        service = {"zmq_endpoint": options.zmq_endpoint, "http_port": options.http_port,
                   "openai_api": options.openai_api, "drain_timeout_s": options.drain_timeout_s}
        cpus = list(config.engine_cpus) if config.engine_cpus is not None else None  # resolved: a tuple
        controls = {**config.model_dump(mode="json", exclude={"engine_cpus"}), "engine_cpus": cpus, **service}
        return cls(controls, dict.fromkeys(flatten_controls(controls), "Server arguments"))

    def with_changes(self, controls: Controls, sources: dict[str, str], names: list[str]) -> EffectiveConfig:
        """After live changes: the accepted controls, the changed ones credited to their new source."""
        moved = {name: sources.get(name, "default") for name in names}
        return replace(self, controls=controls.model_dump(mode="json"), sources={**self.sources, **moved},
                       reloads=self.reloads + 1)

    def body(self, watching: bool) -> dict[str, Any]:
        """The JSON of ``GET /ric/v1/config``; ``watching``: whether changes to the file are being seen."""
        return {"controls": self.controls, "sources": self.sources, "live_controls": list(LIVE_CONTROLS),
                "config_file": self.config_file, "watching": watching, "reloads": self.reloads}


@dataclass(frozen=True)
class LiveChange:
    """New values of live controls (dotted names), from the watcher thread to the engine thread,
    with the effective configuration to publish once they apply."""

    values: dict[str, Any]
    effective: EffectiveConfig

    def admission(self) -> dict[str, Any]:
        return _admission_part(self.values)


def _admission_part(values: dict[str, Any]) -> dict[str, Any]:
    """``{"admission.max_queue": 4, "log_level": "DEBUG"}`` -> ``{"max_queue": 4}``."""
    return {name.removeprefix("admission."): value for name, value in values.items() if name.startswith("admission.")}


@dataclass(frozen=True)
class ReloadPlan:
    """What a new file asks for, against the running controls."""

    live: dict[str, Any] = field(default_factory=dict)  # changed live controls -> new value
    refused: dict[str, Any] = field(default_factory=dict)  # changed controls that need a restart -> asked value
    accepted: Controls | None = None  # the running controls with the live changes


def plan_reload(running: Controls, candidate: Controls) -> ReloadPlan:
    """Sort the controls that differ into live ones (taken) and the rest (refused)."""
    before, after = flatten_controls(running.model_dump()), flatten_controls(candidate.model_dump())
    changed = {name: value for name, value in after.items() if before.get(name) != value}
    live = {name: value for name, value in changed.items() if name in LIVE_CONTROLS}
    refused = {name: value for name, value in changed.items() if name not in LIVE_CONTROLS}
    return ReloadPlan(live, refused, _with_live(running, live))


def _with_live(running: Controls, live: dict[str, Any]) -> Controls:
    """The running controls with the live values (already validated, as part of the candidate)."""
    admission = running.admission.model_copy(update=_admission_part(live))
    top = {name: value for name, value in live.items() if "." not in name}
    return running.model_copy(update={**top, "admission": admission})


# ------------------------------------------------------------------------------ the engine thread's side

def apply_live_changes(engine: LLMEngine, changes: queue.SimpleQueue[LiveChange],
                       publish: Callable[[EffectiveConfig], None]) -> None:
    """Every change the watcher handed over, in order; called on the engine thread between steps."""
    while True:
        try:
            change = changes.get_nowait()
        except queue.Empty:
            return
        _apply(engine, change)
        publish(change.effective)


def _apply(engine: LLMEngine, change: LiveChange) -> None:
    admission = change.admission()
    if admission:
        engine.set_admission_controls(**admission)
    if "log_level" in change.values:
        set_log_level(effective_log_level(change.values["log_level"]))
    log.info("config_applied", changed=change.values, reloads=change.effective.reloads)


# ------------------------------------------------------------------------------ the watcher thread

class ConfigWatcher:
    """Watches ``$CONFIG_FILE`` on its own thread; decides, never applies: live changes go to
    ``hand_over`` (the engine thread's queue). It watches the file's folder, so a file replaced by a
    rename (editors, ``kubectl`` updating a mounted config map through its ``..data`` link) is seen."""

    def __init__(self, settings: ServeSettings, hand_over: Callable[[LiveChange], None]) -> None:
        self.path = Path(settings.inputs.watched_file)
        self._inputs = settings.inputs
        self._running = settings.controls  # live changes included, once handed over
        self._effective = EffectiveConfig.of(settings)
        self._hand_over = hand_over
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

    def reload(self) -> ReloadPlan | None:
        """Resolve the settings again; refuse what needs a restart, hand over what can change live."""
        try:
            candidate = self._inputs.resolve()
        except (ConfigError, ValidationError) as exc:
            log.warning("config_reload_failed", file=str(self.path), error=str(exc), kept="running configuration")
            return None
        plan = plan_reload(self._running, candidate.controls)
        if plan.refused:
            log.warning("config_reload_refused", file=str(self.path), restart_required=sorted(plan.refused),
                        asked=plan.refused, reason="these controls take effect only at start; restart to apply")
        if plan.live:
            self._running = plan.accepted
            self._effective = self._effective.with_changes(plan.accepted, candidate.sources, list(plan.live))
            self._hand_over(LiveChange(plan.live, self._effective))
            log.info("config_reload_accepted", file=str(self.path), changed=plan.live)
        return plan
