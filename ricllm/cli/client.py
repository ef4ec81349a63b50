"""``ricllm client ACTION``: one request to a running ``ricllm serve``.

It imports neither torch nor the engine: it needs only pyzmq, pydantic and msgpack (through
:mod:`ricllm.client`, imported when the command runs), so it works from any box that can reach
the server.

Exit codes: 0 done; 2 a server error (``error`` reply) or a bad argument; 3 the request was
rejected (``rejected``: code and message printed); 4 no reply in time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ricllm.cli.flags import add_structured_flags, structured_from_args  # pydantic only: no torch, no engine
from ricllm.sampling_params import PRIORITIES

EXIT_SERVER_ERROR, EXIT_REJECTED, EXIT_TIMEOUT = 2, 3, 4


def _connection_args() -> argparse.ArgumentParser:
    from ricllm.protocol import DEFAULT_ENDPOINT

    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("connection")
    group.add_argument("--endpoint", default=DEFAULT_ENDPOINT, help="the server (default: %(default)s)")
    group.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for a reply (default: %(default)s)")
    group.add_argument("--curve-server-key", default=None, metavar="KEY",
                       help="the server's public key: a .key file or the 40-character z85 string (turns CURVE on)")
    group.add_argument("--curve-client-keys", default=None, metavar="FILE", help="this client's .key_secret file")
    group.add_argument("--json", action="store_true", help="print the reply as JSON")
    return common


def add_client_subparser(sub: argparse._SubParsersAction) -> None:
    """``ricllm client ACTION``: one request to a running ``ricllm serve``."""
    common = _connection_args()
    client = sub.add_parser("client", help="send one request to a running `ricllm serve`",
                            description="Talk to a running `ricllm serve` (docs/protocol.md). Exit status: "
                                        "0 done, 2 server error, 3 rejected, 4 timeout.")
    actions = client.add_subparsers(dest="action", required=True, metavar="ACTION")
    gen = actions.add_parser("generate", parents=[common], help="generate and print the text and timings")
    gen.add_argument("prompt", help="prompt text (the user message with --chat)")
    gen.add_argument("--chat", action="store_true", help="send it as a chat user message")
    gen.add_argument("--system", default=None, help="system message for --chat")
    gen.add_argument("--max-tokens", type=int, default=64, help="most new tokens (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    gen.add_argument("--deadline-ms", type=float, default=None, help="end-to-end latency budget in ms")
    gen.add_argument("--priority", choices=PRIORITIES, default=None,
                     help="scheduling class (default: near_rt up to 1 s of deadline, non_rt above, else best_effort)")
    gen.add_argument("--template-id", default=None,
                     help="a registered template to start from (its constraint applies unless one is given here)")
    gen.add_argument("--adapter", default=None, metavar="NAME",
                     help="the LoRA adapter (of the server's lora_modules) to serve it under (default: its template's, "
                          "else the base model)")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    gen.add_argument("--request-id", default=None, help="request id (default: a fresh uuid4)")
    add_structured_flags(gen)
    reg = actions.add_parser("register-template", parents=[common],
                             help="pin a template (a system prompt, or a conversation with worked examples)")
    reg.add_argument("system_prompt", nargs="?", default=None,
                     help="the system message text ('-' reads it from stdin); or give --messages")
    reg.add_argument("--messages", default=None, metavar="FILE",
                     help="a JSON file holding the conversation: a list of {role, content}, the system prompt "
                          "then worked-example user/assistant turns")
    reg.add_argument("--template-id", default=None, help="its name (default: the server picks one)")
    reg.add_argument("--adapter", default=None, metavar="NAME",
                     help="the LoRA adapter (of the server's lora_modules) its K/V is pinned under and its requests "
                          "are served under")
    add_structured_flags(reg)  # the constraint of every request that names the template and gives none
    reg.add_argument("--min-confidence", type=float, default=None, metavar="P",
                     help="with --fallback: a decision less confident than P (in (0, 1]) answers the fallback")
    reg.add_argument("--fallback", default=None, metavar="ANSWER",
                     help="with --min-confidence: the answer given instead of an unsure decision (it must satisfy "
                          "the constraint)")
    unreg = actions.add_parser("unregister-template", parents=[common], help="unpin a registered system prompt")
    unreg.add_argument("template_id")
    cancel = actions.add_parser("cancel", parents=[common], help="cancel an in-flight generate of this client")
    cancel.add_argument("target_id")
    actions.add_parser("stats", parents=[common], help="print the server's KV-cache and scheduler counters")
    actions.add_parser("ping", parents=[common], help="check that the server answers")
    client.set_defaults(func=_cmd_client)


def _cmd_client(args: argparse.Namespace) -> int:
    from ricllm.client import RejectedError, RicClient, ServerError

    try:
        with RicClient(args.endpoint, timeout_s=args.timeout, curve_server_key=args.curve_server_key,
                       curve_client_keys=args.curve_client_keys) as client:
            return _ACTIONS[args.action](client, args)
    except RejectedError as exc:
        print(f"ricllm: rejected: {exc.code}: {exc.message}", file=sys.stderr)
        if exc.numbers:
            print("ricllm: " + ", ".join(f"{k}={v}" for k, v in exc.numbers.items()), file=sys.stderr)
        return EXIT_REJECTED
    except ServerError as exc:
        print(f"ricllm: error: {exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_SERVER_ERROR
    except TimeoutError as exc:
        print(f"ricllm: timeout: {exc}; is `ricllm serve` running there (and, with CURVE, is this client's "
              "key authorized)?", file=sys.stderr)
        return EXIT_TIMEOUT
    except (ValueError, OSError) as exc:  # a bad option caught before sending, or an unreadable key file
        print(f"ricllm: error: {exc}", file=sys.stderr)
        return EXIT_SERVER_ERROR


def _generate_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = dict(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                                   stop=args.stop, ignore_eos=args.ignore_eos, deadline_ms=args.deadline_ms,
                                   template_id=args.template_id, request_id=args.request_id,
                                   structured=structured_from_args(args), adapter=args.adapter)
    if args.priority is not None:  # else the server derives it from the deadline
        options["priority"] = args.priority
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        options["messages"] = messages + [{"role": "user", "content": args.prompt}]
    else:
        options["prompt"] = args.prompt
    return options


def _generate(client: Any, args: argparse.Namespace) -> int:
    options = _generate_options(args)
    prompt = options.pop("prompt", None)
    if not args.stream:
        result = client.generate(prompt, **options)
        print(json.dumps(result.model_dump()) if args.json else result.text)
    else:
        result = None
        for reply in client.stream(prompt, **options):
            if reply.type == "token":
                if not args.json:
                    print(reply.text, end="", flush=True)
            else:
                result = reply
        print(json.dumps(result.model_dump()) if args.json else "")
    print(_timing_line(result), file=sys.stderr)
    return 0


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def _timing_line(result: Any) -> str:
    t = result.timings
    deadline = "" if result.deadline_met is None else f"; deadline {'met' if result.deadline_met else 'MISSED'}"
    d = result.degraded
    degraded = "" if d is None else (f"; degraded: max_tokens {d.requested_max_tokens} -> {d.granted_max_tokens} "
                                     f"({d.code})")
    forced = f" ({result.num_forced_tokens} forced)" if result.num_forced_tokens else ""
    if result.confidence is not None:
        forced += f", confidence {result.confidence:.3f}"
    if result.model_text is not None:
        forced += f" (the model answered {result.model_text!r})"
    return (f"[{result.num_prompt_tokens} prompt tokens ({result.num_cached_tokens} cached), "
            f"{len(result.token_ids)} generated{forced}, finish: {result.finish_reason}; queue {_ms(t.queue_s)}, "
            f"TTFT {_ms(t.ttft_s)}, TPOT {_ms(t.tpot_s)}, total {_ms(t.e2e_s)}{deadline}{degraded}]")


def _register(client: Any, args: argparse.Namespace) -> int:
    if (args.system_prompt is None) == (args.messages is None):
        raise ValueError("register-template needs a system prompt or --messages FILE (exactly one)")
    text = sys.stdin.read() if args.system_prompt == "-" else args.system_prompt
    messages = _read_messages(args.messages) if args.messages is not None else None
    reply = client.register_template(text, messages=messages, structured=structured_from_args(args),
                                     template_id=args.template_id, adapter=args.adapter,
                                     min_confidence=args.min_confidence, fallback=args.fallback)
    examples = f", {reply.num_examples} worked examples" if reply.num_examples else ""
    print(json.dumps(reply.model_dump()) if args.json else
          f"{reply.template_id}  ({reply.num_tokens} tokens, {reply.num_pinned_tokens} pinned{examples})")
    return 0


def _read_messages(path: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--messages {path} is not JSON: {exc}") from None


def _unregister(client: Any, args: argparse.Namespace) -> int:
    reply = client.unregister_template(args.template_id)
    print(json.dumps(reply.model_dump()) if args.json else f"unregistered {reply.template_id}")
    return 0


def _cancel(client: Any, args: argparse.Namespace) -> int:
    reply = client.cancel(args.target_id)
    print(json.dumps(reply.model_dump()) if args.json else f"cancelled {reply.target_id}")
    return 0


def _stats(client: Any, args: argparse.Namespace) -> int:
    print(json.dumps(client.stats().model_dump(mode="json"), indent=None if args.json else 2))
    return 0


def _ping(client: Any, args: argparse.Namespace) -> int:
    import time

    started = time.perf_counter()
    pong = client.ping()
    rtt_ms = (time.perf_counter() - started) * 1000
    print(json.dumps({**pong.model_dump(), "rtt_ms": rtt_ms}) if args.json else
          f"pong from {args.endpoint}: ricllm {pong.version}, round trip {rtt_ms:.1f} ms")
    return 0


_ACTIONS = {"generate": _generate, "register-template": _register, "unregister-template": _unregister,
            "cancel": _cancel, "stats": _stats, "ping": _ping}
