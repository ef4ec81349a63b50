"""``ricllm serve``: the xApp service. Its flags are generated from the serve settings model
(:class:`ricllm.config.ServeSettings`); the engine is imported only when it runs."""

from __future__ import annotations

import argparse

from ricllm.cli.flags import add_settings_flags, given_settings
from ricllm.config import CONFIG_ENV, SERVE_PROFILE, EngineSettings, ServeConfig, ServeSettings, resolve_settings


def add_serve_subparser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser(
        "serve", help="serve requests on a ZeroMQ ROUTER socket, with health and metrics over HTTP",
        description="Load the model, calibrate (or load --latency-fit), then serve the ricllm protocol "
                    "(docs/protocol.md) on a ZeroMQ ROUTER socket and /ric/v1/health/{alive,ready} and "
                    "/ric/v1/metrics over HTTP. Settings: flags over --config over $CONFIG_FILE over "
                    "the serve profile (deadline admission) over defaults (docs/serve.md). SIGTERM drains: new "
                    "requests are refused, admitted ones finish.")
    serve.add_argument("--config", default=None, metavar="FILE",
                       help=f"xApp descriptor JSON whose 'controls' section holds the settings "
                            f"(overrides ${CONFIG_ENV}, which names a file of the same format)")
    add_settings_flags(serve, EngineSettings, "engine", shown_defaults=SERVE_PROFILE)
    add_settings_flags(serve, ServeSettings, "service", only=ServeSettings.service_fields())
    serve.set_defaults(func=_cmd_serve)


def settings_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServeConfig:
    """The service's resolved settings from parsed ``serve`` arguments, the files they name and the environment."""
    return resolve_settings(given_settings(args), args.config, environ)


def _cmd_serve(args: argparse.Namespace) -> int:
    from ricllm.serve.server import serve_forever

    return serve_forever(settings_from_args(args))
