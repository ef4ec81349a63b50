"""``ricllm`` command line: every subcommand is a thin layer over the public API.

The engine's flags are generated from the settings model (:mod:`ricllm.cli.flags`), so a setting
added to :class:`ricllm.config.EngineSettings` is a flag of ``generate``, ``prepare`` and ``serve``.
"""

from __future__ import annotations

import argparse
import sys

from ricllm.cli.client import add_client_subparser
from ricllm.cli.model_commands import add_model_subparsers
from ricllm.cli.serve import add_serve_subparser
from ricllm.errors import RicllmError
from ricllm.plan import add_subparser as add_plan_subparser
from ricllm.replay.cli import add_replay_subparser
from ricllm.report import add_report_subparser
from ricllm.serve.keys import add_keys_subparser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ricllm", description="Deadline-aware LLM inference for the O-RAN near-RT RIC.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_model_subparsers(sub)
    add_plan_subparser(sub)
    add_replay_subparser(sub)
    add_report_subparser(sub)
    add_serve_subparser(sub)
    add_client_subparser(sub)
    add_keys_subparser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RicllmError as exc:
        print(f"ricllm: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ricllm: interrupted", file=sys.stderr)
        return 130
