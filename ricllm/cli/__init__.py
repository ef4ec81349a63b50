"""``ricllm`` command line: every subcommand is a thin layer over the public API.

The engine's flags are generated from the settings model (:mod:`ricllm.cli.flags`), so a setting
added to :class:`ricllm.config.EngineSettings` is a flag of ``generate``, ``prepare`` and ``serve``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ricllm.errors import RicllmError
from ricllm.extras import MissingExtraError, missing_extra, missing_extra_message

# (module, its function that registers the commands, those commands), in --help's order. Imported one
# by one: on a client-only install (no ricllm[engine]) a module that needs numpy or torch cannot be
# imported, and its commands are then listed all the same and say what to install when run.
COMMAND_GROUPS = (
    ("ricllm.cli.model_commands", "add_model_subparsers", ("generate", "info", "prepare", "export-onnx")),
    ("ricllm.plan", "add_subparser", ("plan",)),
    ("ricllm.replay.cli", "add_replay_subparser", ("replay",)),
    ("ricllm.cli.adapt", "add_adapt_subparser", ("adapt",)),
    ("ricllm.report", "add_report_subparser", ("report",)),
    ("ricllm.cli.serve", "add_serve_subparser", ("serve",)),
    ("ricllm.cli.client", "add_client_subparser", ("client",)),
    ("ricllm.serve.keys", "add_keys_subparser", ("keys",)),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ricllm", description="Deadline-aware LLM inference for the O-RAN near-RT RIC.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module, register, commands in COMMAND_GROUPS:
        try:
            add_commands = getattr(importlib.import_module(module), register)
        except ModuleNotFoundError as exc:
            if missing_extra(exc) is None:
                raise  # not a package an extra brings: a bug, keep its traceback
            for command in commands:
                _add_unavailable_command(sub, command, exc)
            continue
        add_commands(sub)
    return parser


def _add_unavailable_command(sub: argparse._SubParsersAction, command: str, exc: ModuleNotFoundError) -> None:
    """``command`` as this install has it: any arguments (even --help) end in the message naming the extra."""
    message = missing_extra_message(f"`ricllm {command}`", exc)
    # no prefix character that an argument can start with: every argument, --help too, is taken as given
    unavailable = sub.add_parser(command, help=f"(needs ricllm[{missing_extra(exc)}], not installed here)",
                                 add_help=False, prefix_chars="\0")
    unavailable.add_argument("given", nargs="*")

    def refuse(_args: argparse.Namespace) -> int:
        raise MissingExtraError(message)

    unavailable.set_defaults(func=refuse)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RicllmError as exc:
        print(f"ricllm: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:  # a command whose extra is not installed imports it when it runs
        if missing_extra(exc) is None:
            raise
        print(f"ricllm: error: {missing_extra_message(f'`ricllm {args.command}`', exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ricllm: interrupted", file=sys.stderr)
        return 130
