"""Settings of ``ricllm serve``: the xApp descriptor's ``controls`` section, its layers and precedence.

:class:`Controls` is the engine's settings model (:class:`ricllm.config.EngineSettings`) plus the
service's own options; ``xapp_descriptor/schema.json`` is generated from it
(:mod:`ricllm.serve.descriptor`). Every field has its default, so a partial ``controls`` section
is valid and fills in from lower layers.

Precedence, highest first: command-line flags the user actually gave, ``--config FILE``, the
file named by ``$CONFIG_FILE``, the serve profile (:data:`SERVE_PROFILE`: deadline admission), the
model's defaults. Each layer is validated on its own (an error names the field and where it came
from), then the layers are merged field by field (nested sections too) and validated once more.
This module imports neither torch nor the engine, so the CLI can build its parser without them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, StringConstraints, ValidationError, model_validator

from ricllm.config import EngineConfig, EngineSettings, NonEmpty, StrictModel, describe_errors, merge_layers, setting
from ricllm.errors import ConfigError
from ricllm.logging import LogFormat, LogLevel
from ricllm.protocol import DEFAULT_HTTP_PORT, DEFAULT_ZMQ_PORT, MAX_MESSAGE_BYTES

__all__ = [
    "CONFIG_ENV",
    "SERVE_PROFILE",
    "Controls",
    "CurveOptions",
    "ServeSettings",
    "ServerOptions",
    "SettingsError",
    "SettingsInputs",
    "effective_log_level",
    "flatten_controls",
    "load_controls_file",
    "resolve_settings",
]

CONFIG_ENV = "CONFIG_FILE"
DEFAULT_BIND = f"tcp://0.0.0.0:{DEFAULT_ZMQ_PORT}"
DEFAULT_DRAIN_TIMEOUT_S = 25.0  # under Kubernetes' default 30 s termination grace period
# A service promises deadlines: the engine's own default (off) only refuses what can never fit.
SERVE_PROFILE: dict[str, Any] = {"admission": {"policy": "deadline"}}


class SettingsError(ConfigError):
    """A setting is missing, of the wrong type or out of range; the message names the field."""


class CurveControls(StrictModel):
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


class Controls(EngineSettings):
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
    curve: CurveControls = Field(default_factory=CurveControls)
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

    def engine_config(self) -> EngineConfig:
        """The engine's part of the controls, checked on this host (e.g. ``engine_cpus`` available)."""
        return EngineConfig(**self.model_dump(include=set(EngineSettings.model_fields)))


# ------------------------------------------------------------------------------ what comes out

@dataclass(frozen=True)
class CurveOptions:
    server_secret_key_file: str
    authorized_keys_dir: str


@dataclass
class ServerOptions:
    """How the service listens. ``http_port`` 0 binds any free port; None runs no HTTP listener.

    Frames up to ``max_message_bytes`` are parsed; larger ones that still arrive (up to twice
    that, libzmq's ``ZMQ_MAXMSGSIZE``, beyond which it drops the connection) get ``TOO_LARGE``.
    ``inbound_queue_size`` bounds the commands waiting for the engine thread (a generate that
    finds it full is rejected ``QUEUE_FULL``). On SIGTERM admitted requests get
    ``drain_timeout_s`` to finish before they are cancelled. ``openai_api`` adds the OpenAI API's
    routes to the HTTP port.
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


@dataclass(frozen=True)
class SettingsInputs:
    """What :func:`resolve_settings` read, kept so that the settings can be resolved again, every layer
    in its place, when ``$CONFIG_FILE`` changes (a flag the user gave still wins over the file)."""

    flags: dict[str, Any] = field(default_factory=dict)
    config_file: str | None = None
    environ: dict[str, str] = field(default_factory=dict)  # only what resolve_settings reads: $CONFIG_FILE

    @property
    def watched_file(self) -> str | None:
        return self.environ.get(CONFIG_ENV) or None

    def resolve(self) -> ServeSettings:
        return resolve_settings(self.flags, self.config_file, self.environ)


@dataclass
class ServeSettings:
    """The resolved settings: the controls, where each came from, and the server options derived from them."""

    controls: Controls
    server: ServerOptions = field(default_factory=ServerOptions)
    sources: dict[str, str] = field(default_factory=dict)  # dotted control name -> the layer that set it
    inputs: SettingsInputs = field(default_factory=SettingsInputs)

    @property
    def log_format(self) -> str:
        return self.controls.log_format

    @property
    def log_level(self) -> str:
        return effective_log_level(self.controls.log_level)

    def engine_config(self) -> EngineConfig:
        return self.controls.engine_config()


def effective_log_level(control: str | None) -> str:
    """The ``log_level`` control, else ``$RICLLM_LOG_LEVEL`` (the environment of the process), else INFO."""
    return (control or os.environ.get("RICLLM_LOG_LEVEL") or "INFO").upper()


def flatten_controls(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"admission": {"max_queue": 4}}`` -> ``{"admission.max_queue": 4}``: one entry per control."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flatten_controls(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


# ------------------------------------------------------------------------------ layers

def validate_layer(values: dict[str, Any], source: str) -> dict[str, Any]:
    """Check one layer's fields; return only those it sets (nested sections as dicts).

    Rules across fields wait for the merged settings."""
    try:
        return Controls.model_validate(values).model_dump(exclude_unset=True)
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
                     environ: dict[str, str] | None = None) -> ServeSettings:
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
    controls = Controls.model_validate(merged)  # each layer is valid, and so is any merge of valid layers
    missing = controls.curve.missing_keys()
    if missing:
        sources = ", ".join(source for source, layer in layers[1:] if layer) or "defaults"
        names, verb = " and ".join("curve." + m for m in missing), "is" if len(missing) == 1 else "are"
        raise SettingsError(f"settings from {sources}: curve.enabled is true but {names} {verb} null")
    inputs = SettingsInputs(dict(flags or {}), config_file,
                            {CONFIG_ENV: environ[CONFIG_ENV]} if environ.get(CONFIG_ENV) else {})
    return ServeSettings(controls, server_options(controls), control_sources(layers), inputs)


def control_sources(layers: list[tuple[str, dict[str, Any]]]) -> dict[str, str]:
    """Each control's dotted name and the highest-precedence layer that set it (``default`` if none did)."""
    sources = dict.fromkeys(flatten_controls(Controls().model_dump()), "default")
    for source, layer in layers:
        sources.update(dict.fromkeys(flatten_controls(layer), source))
    return sources


def _keys_turn_curve_on(flags: dict[str, Any]) -> dict[str, Any]:
    """Giving a CURVE key flag turns CURVE on unless ``--no-curve`` says otherwise."""
    curve = flags.get("curve", {})
    if ({"server_secret_key_file", "authorized_keys_dir"} & set(curve)) and "enabled" not in curve:
        return {**flags, "curve": {**curve, "enabled": True}}
    return flags


def server_options(controls: Controls) -> ServerOptions:
    curve = None
    if controls.curve.enabled:
        curve = CurveOptions(controls.curve.server_secret_key_file, controls.curve.authorized_keys_dir)
    return ServerOptions(zmq_endpoint=controls.zmq_endpoint, http_port=controls.http_port, curve=curve,
                         drain_timeout_s=controls.drain_timeout_s, openai_api=controls.openai_api)
