"""The serve pair: :class:`ServeSettings` (input) and :class:`ServeConfig` (resolved).

- :class:`ServeSettings` is the xApp descriptor's ``controls`` section: every engine setting
  (:class:`ricllm.config.EngineSettings`) plus the service's own, its ``curve`` section
  (:class:`CurveSettings`) among them. ``xapp_descriptor/schema.json`` is generated from it
  (:mod:`ricllm.serve.descriptor`). Every field has its default, so a partial ``controls`` section
  is valid and fills in from lower layers.
- :class:`ServeConfig` is what ``ricllm serve`` runs with: the merged settings, the engine's part
  resolved on this host (:meth:`ServeConfig.engine_config`), how the service listens
  (:class:`ServerOptions`), where each setting came from, and what was read, so that it can be
  resolved again when ``$CONFIG_FILE`` changes.

Precedence, highest first: command-line flags the user actually gave, ``--config FILE``, the
file named by ``$CONFIG_FILE``, the serve profile (:data:`SERVE_PROFILE`: deadline admission), the
model's defaults. Each layer is validated on its own (an error names the field and where it came
from), then the layers are merged field by field (nested sections too) and validated once more.
This module imports neither torch nor the engine nor the server, so the CLI can build its parser
without them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, Field, StringConstraints, ValidationError, WithJsonSchema, model_validator

from ricllm.config.engine import LIVE_ADMISSION_CONTROLS, EngineConfig, EngineSettings
from ricllm.config.fields import (
    NonEmpty,
    SettingsError,
    StrictModel,
    describe_errors,
    flatten_settings,
    merge_layers,
    setting,
)
from ricllm.logging import LogFormat, LogLevel

CONFIG_ENV = "CONFIG_FILE"
DEFAULT_ZMQ_PORT = 5555
DEFAULT_HTTP_PORT = 8080
MAX_MESSAGE_BYTES = 1 << 20  # default bound on one request frame; the server may configure its own
DEFAULT_BIND = f"tcp://0.0.0.0:{DEFAULT_ZMQ_PORT}"
DEFAULT_DRAIN_TIMEOUT_S = 25.0  # under Kubernetes' default 30 s termination grace period
# A service promises deadlines: the engine's own default (off) only refuses what can never fit.
SERVE_PROFILE: dict[str, Any] = {"admission": {"policy": "deadline"}}
# read afresh at each admission decision, step or log event (lora_modules: reconciled between steps), so a
# changed $CONFIG_FILE applies them live
LIVE_CONTROLS: tuple[str, ...] = (*(f"admission.{name}" for name in LIVE_ADMISSION_CONTROLS), "log_level",
                                  "lora_modules")
ARGUMENTS_SOURCE = "Server arguments"  # the source of every setting of a server built in Python


def lora_module_paths(entries: list[str]) -> dict[str, str]:
    """``["a=/x", "b=/y"]`` (vLLM's ``--lora-modules`` spelling) -> ``{"a": "/x", "b": "/y"}``; raises
    ``ValueError`` naming the entry that has no ``=``, an empty name or path, or a name given twice."""
    paths: dict[str, str] = {}
    for entry in entries:
        name, equals, path = entry.partition("=")
        name, path = name.strip(), path.strip()
        if not equals:
            raise ValueError(f"lora_modules: {entry!r} is not NAME=PATH (no '=')")
        if not name:
            raise ValueError(f"lora_modules: {entry!r} has an empty adapter name")
        if not path:
            raise ValueError(f"lora_modules: {entry!r} has an empty path")
        if name in paths:
            raise ValueError(f"lora_modules: adapter name {name!r} is given twice ({paths[name]!r} and {path!r})")
        paths[name] = path
    return paths


def _checked_lora_modules(entries: list[str]) -> list[str]:
    """Each entry well formed and naming a folder on this host (a PEFT adapter is a folder)."""
    for name, path in lora_module_paths(entries).items():
        if not os.path.isdir(path):
            what = "is not a folder" if os.path.exists(path) else "does not exist"
            raise ValueError(f"lora_modules: adapter {name!r}: {path!r} {what} (a PEFT adapter folder: "
                             "adapter_config.json and adapter_model.safetensors)")
    return entries


LORA_MODULE_PATTERN = r"^\s*[^=\s][^=]*=\s*\S.*$"
LoraModules = Annotated[list[str], AfterValidator(_checked_lora_modules), WithJsonSchema(
    {"type": "array", "items": {"type": "string", "pattern": LORA_MODULE_PATTERN}})]


class CurveSettings(StrictModel):
    """CurveZMQ: the server's ``.key_secret`` file and the folder of authorized client ``.key`` files."""

    model_config = {"json_schema_extra": {  # the rule the merged settings check, for the onboarder too
        "if": {"properties": {"enabled": {"const": True}}},
        "then": {"properties": {"server_secret_key_file": {"type": "string"},
                                "authorized_keys_dir": {"type": "string"}}}}}

    enabled: bool = setting(False, "CurveZMQ encryption and client authentication", flag="curve")
    server_secret_key_file: NonEmpty | None = setting(
        None, "the server's .key_secret file (from `ricllm keys`); turns curve on", flag="curve-secret-key",
        metavar="FILE")
    authorized_keys_dir: NonEmpty | None = setting(
        None, "folder of authorized client public .key files; turns curve on", flag="curve-authorized-dir",
        metavar="DIR")

    def missing_keys(self) -> list[str]:
        if not self.enabled:
            return []
        return [name for name in ("server_secret_key_file", "authorized_keys_dir") if getattr(self, name) is None]


class ServeSettings(EngineSettings):
    """The ``controls`` section of ``xapp_descriptor/config-file.json``: engine settings and the service's."""

    zmq_endpoint: Annotated[str, StringConstraints(pattern=r"^(tcp|ipc)://.+$")] = setting(
        DEFAULT_BIND, "where the ROUTER socket binds: tcp://HOST:PORT or ipc://PATH", flag="zmq",
        metavar="ENDPOINT")
    http_port: int = setting(DEFAULT_HTTP_PORT, "health, readiness, metrics and the OpenAI API over HTTP", ge=1,
                             le=65535, metavar="PORT")
    openai_api: bool = setting(True, "serve the OpenAI-compatible API (/v1/models, /v1/completions, "
                                     "/v1/chat/completions) on http_port; it has no authentication, CURVE or not",
                               flag="openai-api")
    drain_timeout_s: float = setting(
        DEFAULT_DRAIN_TIMEOUT_S, "on SIGTERM, seconds admitted requests get to finish before they are cancelled "
                                 "(keep it below the pod's termination grace period)", ge=0, flag="drain-timeout",
        metavar="SECONDS")
    curve: CurveSettings = Field(default_factory=CurveSettings)
    lora_modules: LoraModules = setting(
        [], "LoRA adapters to serve, each NAME=PATH (a PEFT folder), loaded at start: a request names one as its "
            "'adapter' (ZeroMQ) or its 'model' (OpenAI API); at most max_loras; changes live when $CONFIG_FILE "
            "changes (added, replaced, removed)", flag="lora-modules", metavar="NAME=PATH")
    log_format: LogFormat = setting(
        "json", "structlog on stderr: json (JSON lines), osc (the O-RAN SC MDC JSON layout: ts, crit, id, mdc, msg) "
                "or console (key-value lines)")
    log_level: LogLevel | None = setting(
        None, "DEBUG, INFO, WARNING, ERROR or CRITICAL; changes live when $CONFIG_FILE changes; null: "
              "$RICLLM_LOG_LEVEL, else INFO")

    @model_validator(mode="before")
    @classmethod
    def _read_log_json(cls, data: Any) -> Any:
        """``log_json`` (before ``log_format`` existed) still reads: true is json, false is console."""
        if not isinstance(data, dict) or "log_json" not in data:
            return data
        data = dict(data)
        as_json = data.pop("log_json")
        if not isinstance(as_json, bool):
            # a ValueError, not a TypeError: pydantic reports only the former as the field's error
            raise ValueError(f"log_json must be true or false (it is now log_format: json or console), "  # noqa: TRY004
                             f"got {as_json!r}")
        implied = "json" if as_json else "console"
        if data.setdefault("log_format", implied) != implied:
            raise ValueError(f"log_json: {str(as_json).lower()} contradicts log_format: {data['log_format']}; "
                             "keep log_format only")
        return data

    @classmethod
    def service_fields(cls) -> frozenset[str]:
        """The fields the service adds to the engine's."""
        return frozenset(cls.model_fields) - frozenset(EngineSettings.model_fields)


# ------------------------------------------------------------------------------ resolved

@dataclass(frozen=True)
class CurveOptions:
    """The ``curve`` section resolved: CURVE is on, with both key locations."""

    server_secret_key_file: str
    authorized_keys_dir: str


@dataclass
class ServerOptions:
    """How the service listens, the service's part of :class:`ServeConfig` (and what a ``Server``
    embedded in Python is given). ``http_port`` 0 binds any free port; None runs no HTTP listener.

    Frames up to ``max_message_bytes`` are parsed; larger ones that still arrive (up to twice
    that, libzmq's ``ZMQ_MAXMSGSIZE``, beyond which it drops the connection) get ``TOO_LARGE``.
    ``inbound_queue_size`` bounds the commands waiting for the engine thread (a generate that
    finds it full is rejected ``QUEUE_FULL``). On SIGTERM admitted requests get
    ``drain_timeout_s`` to finish before they are cancelled. ``openai_api`` adds the OpenAI API's
    routes to the HTTP port. ``lora_modules`` (adapter name -> PEFT folder) are loaded as the
    engine is built; a bad one fails the start.
    """

    zmq_endpoint: str = DEFAULT_BIND
    http_port: int | None = DEFAULT_HTTP_PORT
    http_host: str = "0.0.0.0"
    openai_api: bool = True  # the OpenAI-compatible API beside health and metrics on http_port
    curve: CurveOptions | None = None
    max_message_bytes: int = MAX_MESSAGE_BYTES
    inbound_queue_size: int = 1024
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    drain_linger_ms: int = 1000
    lora_modules: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, controls: ServeSettings) -> ServerOptions:
        curve = None
        if controls.curve.enabled:
            curve = CurveOptions(controls.curve.server_secret_key_file, controls.curve.authorized_keys_dir)
        return cls(zmq_endpoint=controls.zmq_endpoint, http_port=controls.http_port, curve=curve,
                   drain_timeout_s=controls.drain_timeout_s, openai_api=controls.openai_api,
                   lora_modules=lora_module_paths(controls.lora_modules))


@dataclass(frozen=True)
class ServeConfig:
    """The serve settings resolved: the merged ``controls``, how the service listens, where each
    setting came from, and what was read to resolve them (``flags``, ``config_file``,
    ``watched_file``: ``$CONFIG_FILE``), so that :meth:`resolve_again` puts every layer back in its
    place (a flag the user gave still wins over the file). ``reloads`` counts the live changes
    applied since start."""

    controls: ServeSettings
    server: ServerOptions = field(default_factory=ServerOptions)
    sources: dict[str, str] = field(default_factory=dict)  # dotted setting name -> the layer that set it
    flags: dict[str, Any] = field(default_factory=dict)  # the settings the user typed, as nested sections
    config_file: str | None = None
    watched_file: str | None = None
    reloads: int = 0

    @property
    def log_format(self) -> str:
        return self.controls.log_format

    @property
    def log_level(self) -> str:
        return effective_log_level(self.controls.log_level)

    def engine_config(self) -> EngineConfig:
        """The engine's part of the controls, checked on this host (e.g. ``engine_cpus`` available)."""
        return EngineConfig(**self.controls.model_dump(include=set(EngineSettings.model_fields)))

    def resolve_again(self) -> ServeConfig:
        """The same layers read afresh; raises :class:`SettingsError` when one no longer validates."""
        return resolve_settings(self.flags, self.config_file,
                                {CONFIG_ENV: self.watched_file} if self.watched_file else {})

    def with_live(self, values: dict[str, Any], sources: dict[str, str]) -> ServeConfig:
        """Live changes applied: ``values`` (dotted names in :data:`LIVE_CONTROLS`, already validated)
        over the running controls, each credited to its layer in ``sources``; one more reload."""
        admission = {name.removeprefix("admission."): value for name, value in values.items()
                     if name.startswith("admission.")}
        top = {name: value for name, value in values.items() if "." not in name}
        controls = self.controls.model_copy(
            update={**top, "admission": self.controls.admission.model_copy(update=admission)})
        moved = {name: sources.get(name, "default") for name in values}
        return replace(self, controls=controls, sources={**self.sources, **moved}, reloads=self.reloads + 1)

    @classmethod
    def of_arguments(cls, engine: EngineConfig, server: ServerOptions) -> ServeConfig:
        """A server built in Python from an engine config and options: those values, no file.

        The controls are taken as given, unchecked: a Python caller may ask what no descriptor
        may (``http_port`` 0 for any free port, or None for none)."""
        curve = server.curve
        engine_values = {name: getattr(engine, name) for name in EngineSettings.model_fields}
        if engine.engine_cpus is not None:  # resolved: a tuple of CPU numbers
            engine_values["engine_cpus"] = list(engine.engine_cpus)
        controls = ServeSettings.model_construct(
            **engine_values, zmq_endpoint=server.zmq_endpoint, http_port=server.http_port, openai_api=server.openai_api,
            drain_timeout_s=server.drain_timeout_s,
            lora_modules=[f"{name}={path}" for name, path in server.lora_modules.items()],
            curve=CurveSettings(enabled=curve is not None,
                                server_secret_key_file=curve.server_secret_key_file if curve else None,
                                authorized_keys_dir=curve.authorized_keys_dir if curve else None))
        sources = dict.fromkeys(flatten_settings(controls.model_dump()), ARGUMENTS_SOURCE)
        return cls(controls, server, sources)


def effective_log_level(control: str | None) -> str:
    """The ``log_level`` control, else ``$RICLLM_LOG_LEVEL`` (the environment of the process), else INFO."""
    return (control or os.environ.get("RICLLM_LOG_LEVEL") or "INFO").upper()


# ------------------------------------------------------------------------------ layers

def validate_layer(values: dict[str, Any], source: str) -> dict[str, Any]:
    """Check one layer's fields; return only those it sets (nested sections as dicts).

    Rules across fields wait for the merged settings."""
    try:
        return ServeSettings.model_validate(values).model_dump(exclude_unset=True)
    except ValidationError as exc:
        raise SettingsError(describe_errors(exc, source)) from None


def load_controls_file(path: str | os.PathLike[str], source: str) -> dict[str, Any]:
    """The ``controls`` section of a descriptor file, validated; only the fields it sets."""
    try:
        document = json.loads(Path(path).read_text())
    except OSError as exc:
        raise SettingsError(f"{source}: cannot read {os.fspath(path)!r}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise SettingsError(f"{source}: {os.fspath(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("controls"), dict):
        raise SettingsError(f"{source}: {os.fspath(path)!r} has no 'controls' object (expected an xApp descriptor)")
    return validate_layer(document["controls"], source)


def resolve_settings(flags: dict[str, Any] | None = None, config_file: str | None = None,
                     environ: dict[str, str] | None = None) -> ServeConfig:
    """Flags over ``--config`` over ``$CONFIG_FILE`` over the serve profile over the defaults.

    ``flags`` holds only the settings the user typed, as nested sections; raises :class:`SettingsError`.
    """
    environ = os.environ if environ is None else environ
    layers: list[tuple[str, dict[str, Any]]] = [("the serve profile", SERVE_PROFILE)]
    if environ.get(CONFIG_ENV):
        source = f"{CONFIG_ENV}={environ[CONFIG_ENV]}"
        layers.append((source, load_controls_file(environ[CONFIG_ENV], source)))
    if config_file:
        layers.append((f"--config {config_file}", load_controls_file(config_file, f"--config {config_file}")))
    layers.append(("command-line flags", validate_layer(_keys_turn_curve_on(flags or {}), "command-line flags")))
    merged: dict[str, Any] = {}
    for _, layer in layers:
        merged = merge_layers(merged, layer)
    controls = ServeSettings.model_validate(merged)  # each layer is valid, and so is any merge of valid layers
    missing = controls.curve.missing_keys()
    if missing:
        sources = ", ".join(source for source, layer in layers[1:] if layer) or "defaults"
        names, verb = " and ".join("curve." + m for m in missing), "is" if len(missing) == 1 else "are"
        raise SettingsError(f"settings from {sources}: curve.enabled is true but {names} {verb} null")
    if len(controls.lora_modules) > controls.max_loras:
        raise SettingsError(f"lora_modules names {len(controls.lora_modules)} adapters but max_loras is "
                            f"{controls.max_loras} (the adapters the engine holds at once); raise max_loras")
    return ServeConfig(controls, ServerOptions.of(controls), control_sources(layers), dict(flags or {}),
                       config_file, environ.get(CONFIG_ENV) or None)


def control_sources(layers: list[tuple[str, dict[str, Any]]]) -> dict[str, str]:
    """Each control's dotted name and the highest-precedence layer that set it (``default`` if none did)."""
    sources = dict.fromkeys(flatten_settings(ServeSettings().model_dump()), "default")
    for source, layer in layers:
        sources.update(dict.fromkeys(flatten_settings(layer), source))
    return sources


def _keys_turn_curve_on(flags: dict[str, Any]) -> dict[str, Any]:
    """Giving a CURVE key flag turns CURVE on unless ``--no-curve`` says otherwise."""
    curve = flags.get("curve", {})
    if ({"server_secret_key_file", "authorized_keys_dir"} & set(curve)) and "enabled" not in curve:
        return {**flags, "curve": {**curve, "enabled": True}}
    return flags
