"""ricllm's settings: two pairs, each an input model and what it resolves to.

- **engine** (:mod:`ricllm.config.engine`): :class:`EngineSettings` -> :class:`EngineConfig`.
  ``EngineSettings`` holds every engine field with its one default and rule (its ``admission``
  section is :class:`AdmissionSettings`); ``EngineConfig`` is the same fields checked once, with the
  byte size parsed and the CPU list resolved on this host. ``LLM``, the engine, the CLI's
  ``generate`` and ``prepare`` and a scenario's ``engine`` section use this pair.
- **serve** (:mod:`ricllm.config.serve`): :class:`ServeSettings` -> :class:`ServeConfig`.
  ``ServeSettings`` is the xApp descriptor's ``controls``: the engine's fields plus the service's,
  its ``curve`` section (:class:`CurveSettings`) among them; :func:`resolve_settings` merges its
  layers (flags, ``--config``, ``$CONFIG_FILE``, the serve profile) into a ``ServeConfig``: the
  controls, their engine part as an ``EngineConfig``, how the service listens
  (:class:`ServerOptions`) and where each setting came from.

Everything else is derived from these models: the CLI flags (:mod:`ricllm.cli.flags`), the
descriptor's ``schema.json`` (:mod:`ricllm.serve.descriptor`), ``GET /ric/v1/config`` and the
live reload of ``$CONFIG_FILE`` (:mod:`ricllm.serve.reload`). :mod:`ricllm.config.fields` holds
what the models are made of.
"""

from ricllm.config.engine import (
    DTYPES,
    LIVE_ADMISSION_CONTROLS,
    RUNTIMES,
    AdmissionSettings,
    EngineConfig,
    EngineSettings,
)
from ricllm.config.fields import (
    BYTE_SIZE_PATTERN,
    CPU_LIST_PATTERN,
    NonEmpty,
    SettingsError,
    StrictModel,
    describe_errors,
    flatten_settings,
    merge_layers,
    setting,
)
from ricllm.config.serve import (
    CONFIG_ENV,
    DEFAULT_HTTP_PORT,
    DEFAULT_ZMQ_PORT,
    LIVE_CONTROLS,
    MAX_MESSAGE_BYTES,
    SERVE_PROFILE,
    CurveOptions,
    CurveSettings,
    ServeConfig,
    ServerOptions,
    ServeSettings,
    effective_log_level,
    load_controls_file,
    lora_module_paths,
    resolve_settings,
)

__all__ = [
    "BYTE_SIZE_PATTERN",
    "CONFIG_ENV",
    "CPU_LIST_PATTERN",
    "DEFAULT_HTTP_PORT",
    "DEFAULT_ZMQ_PORT",
    "DTYPES",
    "LIVE_ADMISSION_CONTROLS",
    "LIVE_CONTROLS",
    "MAX_MESSAGE_BYTES",
    "RUNTIMES",
    "SERVE_PROFILE",
    "AdmissionSettings",
    "CurveOptions",
    "CurveSettings",
    "EngineConfig",
    "EngineSettings",
    "NonEmpty",
    "ServeConfig",
    "ServeSettings",
    "ServerOptions",
    "SettingsError",
    "StrictModel",
    "describe_errors",
    "effective_log_level",
    "flatten_settings",
    "load_controls_file",
    "lora_module_paths",
    "merge_layers",
    "resolve_settings",
    "setting",
]
