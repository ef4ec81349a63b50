"""Settings of ``ricllm serve``: the xApp descriptor's ``controls`` section, flags and precedence.

:class:`Controls` is the pydantic form of ``xapp_descriptor/schema.json`` (same fields, ranges and
enums; strict types, unknown fields are errors). Unlike the schema, which the onboarder applies
to a complete descriptor, every field here has the descriptor's default, so a partial
``controls`` section is valid and fills in from lower layers.

Precedence, highest first: command-line flags the user actually gave, ``--config FILE``, the
file named by ``$CONFIG_FILE``, the defaults. Each layer is validated on its own (an error names
the field and where it came from), then the layers are merged field by field (nested sections
too) and validated once more. This module imports neither torch nor the engine, so the CLI can
build its parser without them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ricllm.errors import ConfigError
from ricllm.serve.protocol import DEFAULT_HTTP_PORT, DEFAULT_ZMQ_PORT, MAX_MESSAGE_BYTES

__all__ = ["Controls", "SettingsError", "ServerOptions", "CurveOptions", "ServeSettings", "resolve_settings",
           "load_controls_file", "add_serve_subparser"]

CONFIG_ENV = "CONFIG_FILE"
DEFAULT_BIND = f"tcp://0.0.0.0:{DEFAULT_ZMQ_PORT}"
DEFAULT_DRAIN_TIMEOUT_S = 25.0  # under Kubernetes' default 30 s termination grace period
# the same pattern as schema.json's kv_cache_budget (the descriptor tests check it against parse_bytes)
BYTE_SIZE_PATTERN = r"^\s*[0-9]+(\.[0-9]*)?\s*([bB]|[kKmMgGtT][bB]|[kKmMgGtT][iI][bB]|[kKmMgG])?\s*$"

_UNION_TAG = re.compile(r"^(int|str|float|bool|none|constrained-\w+|function-\w+\[.*\])$")  # pydantic's loc tags
NonEmpty = Annotated[str, StringConstraints(min_length=1)]


class SettingsError(ConfigError):
    """A setting is missing, of the wrong type or out of range; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class AdmissionControls(_Strict):
    """``deadline``: admit only what meets its deadline; ``fcfs``: queue all; ``off``: refuse only
    what can never fit."""

    policy: Literal["deadline", "fcfs", "off"] = "deadline"
    safety_margin: float = Field(0.1, ge=0, lt=10)
    max_queue: int = Field(256, ge=0)
    abort_late: bool = False
    pace_prefill: bool = True
    degrade: bool = False


class CurveControls(_Strict):
    """CurveZMQ: the server's ``.key_secret`` file and the folder of authorized client ``.key`` files."""

    enabled: bool = False
    server_secret_key_file: NonEmpty | None = None
    authorized_keys_dir: NonEmpty | None = None

    @model_validator(mode="after")
    def _keys_when_enabled(self, info: ValidationInfo) -> CurveControls:
        """Checked on the merged settings only: one layer may enable CURVE and another give the keys."""
        if info.context and info.context.get("partial"):
            return self
        missing = [name for name in ("server_secret_key_file", "authorized_keys_dir") if getattr(self, name) is None]
        if self.enabled and missing:
            raise ValueError(f"curve.enabled is true but {' and '.join('curve.' + m for m in missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} null")
        return self


class Controls(_Strict):
    """The ``controls`` section of ``xapp_descriptor/config-file.json`` (see schema.json)."""

    model: NonEmpty | None = None
    kv_cache_budget: int | str = "256MiB"
    block_size: int = Field(16, ge=1, le=1024)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(512, ge=1)
    max_model_len: Annotated[int, Field(ge=1)] | None = None
    dtype: Literal["auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"] = "auto"
    device: Annotated[str, StringConstraints(pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")] = "auto"
    weights: Literal["auto", "bf16", "int8", "int4"] = "auto"
    attention_backend: Literal["auto", "torch", "cpu", "triton", "cuda"] = "auto"
    enable_prefix_caching: bool = True
    weight_cache: bool = True
    seed: int = Field(0, ge=0)
    threads: Annotated[int, Field(ge=1)] | None = None
    engine_cpus: str | list[Annotated[int, Field(ge=0)]] | None = None
    runtime: Literal["auto", "native", "torch"] = "auto"
    zmq_endpoint: Annotated[str, StringConstraints(pattern=r"^(tcp|ipc)://.+$")] = DEFAULT_BIND
    http_port: int = Field(DEFAULT_HTTP_PORT, ge=1, le=65535)
    drain_timeout_s: float = Field(DEFAULT_DRAIN_TIMEOUT_S, ge=0)
    admission: AdmissionControls = Field(default_factory=AdmissionControls)
    latency_fit: NonEmpty | None = None
    curve: CurveControls = Field(default_factory=CurveControls)
    log_json: bool = True

    @field_validator("engine_cpus")
    @classmethod
    def _cpu_list(cls, value: str | list[int] | None) -> str | list[int] | None:
        from ricllm.engine.affinity import check_cpu_list_field

        return check_cpu_list_field(value)

    @field_validator("kv_cache_budget")
    @classmethod
    def _byte_size(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value >= 1 or isinstance(value, str) and re.match(BYTE_SIZE_PATTERN, value):
            return value
        raise ValueError("a byte size is an integer >= 1 or a number with a unit (B, KB, MB, GB, TB, KiB, MiB, "
                         "GiB, TiB, K, M, G), e.g. '256MiB'")


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
    ``drain_timeout_s`` to finish before they are cancelled.
    """

    zmq_endpoint: str = DEFAULT_BIND
    http_port: int | None = DEFAULT_HTTP_PORT
    http_host: str = "0.0.0.0"
    curve: CurveOptions | None = None
    max_message_bytes: int = MAX_MESSAGE_BYTES
    inbound_queue_size: int = 1024
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    drain_linger_ms: int = 1000


@dataclass
class ServeSettings:
    """The resolved settings: engine keyword arguments, server options, logging."""

    controls: Controls
    server: ServerOptions = field(default_factory=ServerOptions)

    @property
    def log_json(self) -> bool:
        return self.controls.log_json

    def engine_kwargs(self) -> dict[str, Any]:
        c = self.controls
        return dict(model=c.model, kv_cache_budget=c.kv_cache_budget, block_size=c.block_size,
                    max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
                    max_model_len=c.max_model_len, dtype=c.dtype, device=c.device,
                    attention_backend=c.attention_backend, weights=c.weights,
                    enable_prefix_caching=c.enable_prefix_caching, weight_cache=c.weight_cache,
                    admission=c.admission.policy,
                    safety_margin=c.admission.safety_margin, max_queue=c.admission.max_queue,
                    abort_late=c.admission.abort_late, pace_prefill=c.admission.pace_prefill,
                    degrade=c.admission.degrade, latency_fit=c.latency_fit, seed=c.seed, threads=c.threads,
                    engine_cpus=c.engine_cpus,
                    runtime=c.runtime)

    def engine_config(self):
        """An ``EngineConfig`` (imports torch)."""
        from ricllm.config import EngineConfig

        return EngineConfig(**self.engine_kwargs())


# ------------------------------------------------------------------------------ layers

def _describe(exc: ValidationError, source: str) -> str:
    """``--config x.json: field 'admission.policy': Input should be ... (got 'edf')``."""
    parts = []
    for error in exc.errors(include_url=False)[:3]:
        name = ".".join(str(part) for part in error["loc"] if not _UNION_TAG.match(str(part)))
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            parts.append(f"field {name!r}: unknown setting")
        elif error["type"] == "missing" or not name or isinstance(error.get("input"), dict):
            parts.append(f"field {name!r}: {message}" if name else message)
        else:
            parts.append(f"field {name!r}: {message} (got {error.get('input')!r:.60})")
    extra = exc.error_count() - len(parts)
    return f"{source}: " + "; ".join(parts) + (f"; and {extra} more" if extra > 0 else "")


def validate_layer(values: dict[str, Any], source: str) -> dict[str, Any]:
    """Check one layer's fields; return only those it sets (nested sections as dicts).

    Rules across fields wait for the merged settings."""
    try:
        return Controls.model_validate(values, context={"partial": True}).model_dump(exclude_unset=True)
    except ValidationError as exc:
        raise SettingsError(_describe(exc, source)) from None


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


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) \
            else value
    return merged


# flag dest -> path in Controls
FLAG_FIELDS: dict[str, tuple[str, ...]] = {
    "model": ("model",), "kv_cache_budget": ("kv_cache_budget",), "block_size": ("block_size",),
    "max_num_seqs": ("max_num_seqs",), "max_num_batched_tokens": ("max_num_batched_tokens",),
    "max_model_len": ("max_model_len",), "dtype": ("dtype",), "device": ("device",), "weights": ("weights",),
    "attention_backend": ("attention_backend",), "prefix_caching": ("enable_prefix_caching",),
    "weight_cache": ("weight_cache",),
    "seed": ("seed",), "threads": ("threads",), "engine_cpus": ("engine_cpus",), "runtime": ("runtime",), "zmq": ("zmq_endpoint",), "http_port": ("http_port",),
    "drain_timeout": ("drain_timeout_s",),
    "admission": ("admission", "policy"), "safety_margin": ("admission", "safety_margin"),
    "max_queue": ("admission", "max_queue"), "abort_late": ("admission", "abort_late"),
    "pace_prefill": ("admission", "pace_prefill"), "degrade": ("admission", "degrade"),
    "latency_fit": ("latency_fit",), "curve": ("curve", "enabled"),
    "curve_secret_key": ("curve", "server_secret_key_file"), "curve_authorized_dir": ("curve", "authorized_keys_dir"),
    "log_json": ("log_json",),
}


def flag_layer(args: argparse.Namespace) -> dict[str, Any]:
    """The controls the user gave as flags (absent flags are not in ``args``: default SUPPRESS).

    Giving a CURVE key flag turns CURVE on unless ``--no-curve`` says otherwise.
    """
    given = {dest: value for dest, value in vars(args).items() if dest in FLAG_FIELDS}
    if ("curve_secret_key" in given or "curve_authorized_dir" in given) and "curve" not in given:
        given["curve"] = True
    layer: dict[str, Any] = {}
    for dest, value in given.items():
        *parents, name = FLAG_FIELDS[dest]
        target = layer
        for parent in parents:
            target = target.setdefault(parent, {})
        target[name] = value
    return layer


def resolve_settings(args: argparse.Namespace | None = None, environ: dict[str, str] | None = None) -> ServeSettings:
    """Flags over ``--config`` over ``$CONFIG_FILE`` over defaults; raises :class:`SettingsError`."""
    environ = os.environ if environ is None else environ
    args = args or argparse.Namespace()
    layers: list[tuple[str, dict[str, Any]]] = []
    if environ.get(CONFIG_ENV):
        source = f"{CONFIG_ENV}={environ[CONFIG_ENV]}"
        layers.append((source, load_controls_file(environ[CONFIG_ENV], source)))
    if getattr(args, "config", None):
        source = f"--config {args.config}"
        layers.append((source, load_controls_file(args.config, source)))
    layers.append(("command-line flags", validate_layer(flag_layer(args), "command-line flags")))
    merged: dict[str, Any] = {}
    for _, layer in layers:
        merged = _merge(merged, layer)
    try:
        controls = Controls.model_validate(merged)
    except ValidationError as exc:  # a rule across layers, e.g. curve enabled in one, keys in none
        sources = ", ".join(source for source, layer in layers if layer) or "defaults"
        raise SettingsError(_describe(exc, f"settings from {sources}")) from None
    return ServeSettings(controls, server_options(controls))


def server_options(controls: Controls) -> ServerOptions:
    curve = None
    if controls.curve.enabled:
        curve = CurveOptions(controls.curve.server_secret_key_file, controls.curve.authorized_keys_dir)
    return ServerOptions(zmq_endpoint=controls.zmq_endpoint, http_port=controls.http_port, curve=curve,
                         drain_timeout_s=controls.drain_timeout_s)


# ------------------------------------------------------------------------------ the command line

def _serve_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag defaults to SUPPRESS, so only what the user typed overrides the files."""
    S = argparse.SUPPRESS
    parser.add_argument("--config", default=None, metavar="FILE",
                        help=f"xApp descriptor JSON whose 'controls' section holds the settings "
                             f"(overrides ${CONFIG_ENV}, which names a file of the same format)")
    service = parser.add_argument_group("service")
    service.add_argument("--zmq", default=S, metavar="ENDPOINT",
                         help=f"where the ROUTER socket binds: tcp://HOST:PORT or ipc://PATH (default: {DEFAULT_BIND})")
    service.add_argument("--http-port", type=int, default=S, metavar="PORT",
                         help=f"health, readiness and metrics (default: {DEFAULT_HTTP_PORT})")
    service.add_argument("--drain-timeout", type=float, default=S, metavar="SECONDS",
                         help=f"on SIGTERM, admitted requests get this long to finish before they are cancelled "
                              f"(default: {DEFAULT_DRAIN_TIMEOUT_S:g} s; keep it below the pod's termination grace period)")
    service.add_argument("--curve", action=argparse.BooleanOptionalAction, default=S,
                         help="CurveZMQ encryption and client authentication (default: off)")
    service.add_argument("--curve-secret-key", default=S, metavar="FILE",
                         help="the server's .key_secret file (from `ricllm keys`); turns --curve on")
    service.add_argument("--curve-authorized-dir", default=S, metavar="DIR",
                         help="folder of authorized client public .key files; turns --curve on")
    service.add_argument("--log-json", action=argparse.BooleanOptionalAction, default=S,
                         help="structlog JSON lines on stderr (default: on)")
    admission = parser.add_argument_group("admission")
    admission.add_argument("--admission", choices=("deadline", "fcfs", "off"), default=S,
                           help="deadline: admit only what meets its deadline (default); fcfs: queue all; "
                                "off: refuse only what can never fit")
    admission.add_argument("--safety-margin", type=float, default=S, help="inflate predictions by this fraction (0.1)")
    admission.add_argument("--max-queue", type=int, default=S, help="best-effort requests that may wait (256)")
    admission.add_argument("--abort-late", action=argparse.BooleanOptionalAction, default=S,
                           help="abort a request once its deadline has passed (default: off)")
    admission.add_argument("--pace-prefill", action=argparse.BooleanOptionalAction, default=S,
                           help="cap each step's prefill tokens so running deadline requests keep the per-token "
                                "pace their deadlines need; never at the cost of a promise (default: on)")
    admission.add_argument("--degrade", action=argparse.BooleanOptionalAction, default=S,
                           help="admit a request that cannot be served in full with max_tokens shrunk to what "
                                "fits (the reply says so) instead of rejecting it (default: off)")
    admission.add_argument("--latency-fit", default=S, metavar="FILE",
                           help="latency-model fit JSON (LatencyModel.save); default: calibrate at start, cached")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--model", default=S, help="GGUF file or HF folder (default: the installed SmolLM2 GGUF)")
    engine.add_argument("--kv-cache-budget", default=S, help="bytes for the whole KV cache, e.g. 256MiB (default)")
    engine.add_argument("--block-size", type=int, default=S, help="tokens per KV block (16)")
    engine.add_argument("--max-num-seqs", type=int, default=S, help="most sequences per step (64)")
    engine.add_argument("--max-num-batched-tokens", type=int, default=S, help="token budget per step (512)")
    engine.add_argument("--max-model-len", type=int, default=S, help="cap on prompt + output tokens")
    engine.add_argument("--dtype", default=S, help="auto, float32, bfloat16 or float16 (auto)")
    engine.add_argument("--device", default=S, help="auto, cpu or cuda[:N] (auto)")
    engine.add_argument("--attention-backend", default=S, help="auto, torch, cpu, triton or cuda (auto)")
    engine.add_argument("--weights", default=S, help="auto, bf16, int8 or int4 (auto)")
    engine.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=S,
                        help="prefix caching (default: on)")
    engine.add_argument("--weight-cache", action=argparse.BooleanOptionalAction, default=S,
                        help="reuse converted weights from $RICLLM_CACHE_DIR/weights (default: on)")
    engine.add_argument("--seed", type=int, default=S, help="engine sampling seed (0)")
    engine.add_argument("--threads", type=int, default=S,
                        help="CPU threads (one per --engine-cpus CPU, else OMP_NUM_THREADS, else all cores)")
    engine.add_argument("--engine-cpus", default=S, metavar="LIST",
                        help="CPUs the engine computes on, e.g. 0-3 (Linux); the socket, HTTP and ZeroMQ threads "
                             "then run on the other CPUs, so they never stall the engine's threads "
                             "(default: unset, every thread may run anywhere)")
    engine.add_argument("--runtime", default=S, help="auto, native (no torch in the process) or torch (auto: native "
                                                     "where it serves the model)")


def add_serve_subparser(sub: argparse._SubParsersAction) -> None:
    """``ricllm serve``: the xApp service (the engine is imported only when it runs)."""
    serve = sub.add_parser(
        "serve", help="serve requests on a ZeroMQ ROUTER socket, with health and metrics over HTTP",
        description="Load the model, calibrate (or load --latency-fit), then serve the ricllm protocol "
                    "(docs/protocol.md) on a ZeroMQ ROUTER socket and /ric/v1/health/{alive,ready} and "
                    "/ric/v1/metrics over HTTP. Settings: flags over --config over $CONFIG_FILE over "
                    "defaults (docs/serve.md). SIGTERM drains: new requests are refused, admitted ones finish.")
    _serve_flags(serve)
    serve.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from ricllm.serve.server import serve_forever

    return serve_forever(resolve_settings(args))
