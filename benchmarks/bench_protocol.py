"""Protocol overhead: the ZeroMQ path (client -> ROUTER -> engine thread -> reply) against the
same engine driven in-process, with a trivial generation (max_tokens 1).

Both paths share one engine configuration; the difference of their per-request latencies is what
the socket, msgpack, validation and the thread hand-offs add. The ZeroMQ clients run in a
separate process (as a RIC's would), so they do not compete with the server for its
interpreter; the in-process clients are threads calling the engine thread directly. Three loads:
one client at a time (the protocol's own cost per request); many concurrent clients, closed loop
(each sends again when answered: the engine saturated, so requests per second compare); and the
same clients open loop (seeded Poisson sends at ``--rate``, identical on both paths, so each
request is compared with itself; the in-process path runs it twice, and the second run against
the first gives the figure's noise floor). The paths alternate for ``--rounds`` rounds (two busy cores
make one round's difference noisy). For the ZeroMQ path the time spent outside the server (the
client's latency less the result's ``timings.e2e_s``) is given too. Target: at most 1 ms added
at p50.

With ``--engine-cpus LIST`` the engine of both paths computes on those CPUs only (one thread
each) and everything else (the in-process clients, the ZeroMQ client process, the server's
socket, HTTP and libzmq threads) runs on the remaining ones: the protocol's cost without its
competition with the engine for the same cores (``engine_cpus``, docs/serve.md).

With ``--http`` the server also serves HTTP (health, metrics, the OpenAI API) on a free port: the
ZeroMQ clients run with it idle (what the listener costs the ZeroMQ path, if anything), and then a
third path sends the same loads to the same server through the OpenAI API: ``POST /v1/completions``
(the same token ids, ``max_tokens`` 1, ``ignore_eos``) from a plain HTTP client (``http.client``, one
kept-alive connection per client thread), in another process as the ZeroMQ clients are. The table
then shows in-process, ZeroMQ and HTTP side by side, what each adds over in-process, and what HTTP
adds over ZeroMQ. A quick check that it runs (not a measurement; about a minute on two busy cores):
``--clients 2 --requests 5 --rounds 1 --http --no-append`` (the prompt's token ids need SmolLM2's vocabulary).

With ``--baseline DIR`` (another checkout of ricllm, e.g. a worktree of main) the script compares two
builds instead: each round runs one round of the measurement above in a child process per build, the
builds alternating (their order flips every round), the child importing ricllm from ``DIR`` or from
this checkout. The table gives each build's figures, median and range over the rounds: each path's
p50 and requests per second, and what the ZeroMQ and HTTP paths add over in-process. ``--json PATH``
writes one run's figures (what the comparison reads).

    python benchmarks/bench_protocol.py [--clients 16] [--requests 40] [--rate 100] [--rounds 5] [--model PATH]
                                        [--engine-cpus LIST] [--http] [--baseline DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # last: no folder of ours shadows an installed package

from ricllm.client import RicClient  # noqa: E402  (no torch: the client child stays light)

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345]  # 8 tokens: the model step stays small
TINY_PROMPT = [1, 5, 9, 13, 17, 21, 25, 29]  # 8 tokens of the tests' tiny model's vocabulary


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True)
class Load:
    """``clients`` threads, ``requests`` each. Closed loop (``rate`` None): each sends its next
    request when the last is answered. Open loop: each client's sends follow a seeded Poisson
    schedule of ``rate`` requests/s in all, the same on both paths, so requests pair up."""

    clients: int
    requests: int
    rate: float | None = None
    prompt: tuple[int, ...] = tuple(PROMPT)

    def schedule(self, client: int) -> list[float]:
        """Seconds from the start at which this client means to send each of its requests."""
        if self.rate is None:
            return [0.0] * self.requests
        draw, at, times = random.Random(client), 0.0, []
        for _ in range(self.requests):
            at += draw.expovariate(self.rate / self.clients)
            times.append(at)
        return times


def run_clients(load: Load, one_request) -> tuple[list[float], float]:
    """Latencies in (client, request) order, each from its actual send; and the wall time."""
    latencies = [0.0] * (load.clients * load.requests)

    def client(index: int, start: float) -> None:
        for i, at in enumerate(load.schedule(index)):
            time.sleep(max(0.0, start + at - time.perf_counter()))  # late: send at once
            sent = time.perf_counter()
            one_request(index, i)
            latencies[index * load.requests + i] = time.perf_counter() - sent

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c, started)) for c in range(load.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, time.perf_counter() - started


def in_process(config, loads: list[Load]) -> list[tuple[list[float], float]]:
    from ricllm.engine.async_engine import EngineThread
    from ricllm.engine.llm_engine import LLMEngine
    from ricllm.sampling_params import SamplingParams

    worker = EngineThread(lambda: LLMEngine(config))  # built on its own thread, as the server's
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    worker.submit(list(loads[0].prompt), params).result()  # warm-up
    results = [run_clients(load, lambda c, i, prompt=list(load.prompt): worker.submit(prompt, params).result())
               for load in loads]
    worker.stop()
    return results


def zeromq_clients(endpoint: str, load: Load) -> tuple[list[float], float, list[float]]:
    """The client side, run in a child process: one connection per client thread. Also returns
    each result's ``timings.e2e_s`` (the server's own time, receipt to result)."""
    connections = [RicClient(endpoint, timeout_s=60) for _ in range(load.clients)]
    prompt = list(load.prompt)
    connections[0].generate(token_ids=prompt, max_tokens=1, ignore_eos=True)  # warm-up
    inside = [0.0] * (load.clients * load.requests)

    def one_request(c: int, i: int) -> None:
        result = connections[c].generate(token_ids=prompt, max_tokens=1, ignore_eos=True)
        inside[c * load.requests + i] = result.timings.e2e_s

    latencies, wall = run_clients(load, one_request)
    for connection in connections:
        connection.close()
    return latencies, wall, inside


def http_clients(base_url: str, load: Load) -> tuple[list[float], float]:
    """The HTTP client side, run in a child process: one kept-alive connection per client thread,
    ``POST /v1/completions`` with the ZeroMQ path's request (same token ids, one token)."""
    where = urlsplit(base_url)
    connections = [http.client.HTTPConnection(where.hostname, where.port, timeout=60) for _ in range(load.clients)]
    body = json.dumps({"model": served_model(connections[0]), "prompt": list(load.prompt), "max_tokens": 1,
                       "ignore_eos": True, "temperature": 0}).encode()
    complete(connections[0], body)  # warm-up
    latencies, wall = run_clients(load, lambda c, i: complete(connections[c], body))
    for connection in connections:
        connection.close()
    return latencies, wall


def served_model(connection: http.client.HTTPConnection) -> str:
    connection.request("GET", "/v1/models")
    return json.loads(read_ok(connection))["data"][0]["id"]


def complete(connection: http.client.HTTPConnection, body: bytes) -> None:
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    read_ok(connection)


def read_ok(connection: http.client.HTTPConnection) -> bytes:
    response = connection.getresponse()
    payload = response.read()  # the whole body, so the connection can carry the next request
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {payload[:300]!r}")
    return payload


def over_server(config, loads: list[Load], http: bool = False) -> list[dict[str, tuple]]:
    """Per load, {path: (latencies, wall time, each result's ``timings.e2e_s`` or None)}: the ZeroMQ
    path and, with ``http``, the HTTP path against the same server (ZeroMQ first, the listener idle)."""
    from ricllm.engine.latency_model import LatencyModel
    from ricllm.serve.server import Server
    from ricllm.config import ServerOptions

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    server = Server(config, ServerOptions(zmq_endpoint=endpoint, http_port=0 if http else None,
                                          http_host="127.0.0.1"),
                    latency_model=LatencyModel([0.01])).start()
    server.wait_ready(timeout=120)
    results = []
    for load in loads:
        measured = {REMOTE: client_child("--client-child", endpoint, load)}
        if http:
            measured[HTTP] = client_child("--http-child", f"http://127.0.0.1:{server.http_port}", load)
        results.append(measured)
    server.stop()
    return results


def client_child(flag: str, target: str, load: Load) -> tuple[list[float], float, list[float] | None]:
    child = subprocess.run([sys.executable, __file__, flag, target, "--load", json.dumps(asdict(load))],
                           capture_output=True, text=True, check=True)
    measured = json.loads(child.stdout.strip().splitlines()[-1])
    return measured["latencies"], measured["wall_s"], measured.get("inside_s")


LOCAL, REMOTE = "in-process", "ZeroMQ (clients in another process)"
HTTP_DETAILS = ("; the ZeroMQ path ran with the HTTP listener up (idle), then the HTTP path sent the same loads to "
                "the same server through POST /v1/completions (http.client, one kept-alive connection per client)")
HTTP = "HTTP, OpenAI /v1/completions (clients in another process)"
SHORT = {LOCAL: "in-process", REMOTE: "ZeroMQ", HTTP: "HTTP"}


def table(name: str, rounds: list[dict[str, tuple]], load: Load) -> list[str]:
    """Pooled over the rounds, then the added p50 of each path over in-process (and of HTTP over
    ZeroMQ): closed loop, the median and range of the rounds' p50 differences; open loop, the
    median of the per-request differences (the same request, sent at the same moment on each path)."""
    paths = [path for path in (LOCAL, REMOTE, HTTP) if path in rounds[0]]
    lines = [f"{name}:", "", "| path | requests | req/s | p50 (ms) | p99 (ms) |", "|---|---:|---:|---:|---:|"]
    pooled = {}
    for path in paths:
        latencies = [x for r in rounds for x in r[path][0]]
        wall = sum(r[path][1] for r in rounds)
        pooled[path] = latencies
        lines.append(f"| {path} | {len(latencies)} | {len(latencies) / wall:.1f} | "
                     f"{percentile(latencies, 0.5) * 1000:.2f} | {percentile(latencies, 0.99) * 1000:.2f} |")
    outside = [(total - inside) * 1000 for r in rounds for total, inside in zip(r[REMOTE][0], r[REMOTE][2])]
    lines.append(f"\nZeroMQ path outside the server (client, libzmq and loopback, both ways: the client's latency "
                 f"less the result's `timings.e2e_s`): p50 {percentile(outside, 0.5):.2f} ms, "
                 f"p99 {percentile(outside, 0.99):.2f} ms")
    comparisons = [(path, LOCAL) for path in paths[1:]] + ([(HTTP, REMOTE)] if HTTP in paths else [])
    lines += [added(path, base, rounds, pooled, load) for path, base in comparisons]
    lines[-1] += "\n"
    return lines


def added_p50(path: str, base: str, rounds: list[dict[str, tuple]], load: Load) -> float:
    """What ``path`` adds to ``base``'s p50 (ms): closed loop, the median of the rounds' p50
    differences; open loop, the median of the per-request differences."""
    if load.rate is not None:
        pooled = {name: [x for r in rounds for x in r[name][0]] for name in (path, base)}
        return percentile([(b - a) * 1000 for a, b in zip(pooled[base], pooled[path])], 0.5)
    return statistics.median((statistics.median(r[path][0]) - statistics.median(r[base][0])) * 1000 for r in rounds)


def added(path: str, base: str, rounds: list[dict[str, tuple]], pooled: dict[str, list[float]], load: Load) -> str:
    """One line: what ``path`` adds to ``base``'s latency."""
    label = f"added by the {SHORT[path]} path" + ("" if base == LOCAL else f" over the {SHORT[base]} path")
    who = f"{load.clients} client{'s' if load.clients > 1 else ''}, max_tokens 1"
    added99 = (percentile(pooled[path], 0.99) - percentile(pooled[base], 0.99)) * 1000
    if load.rate is not None:
        paired = [(b - a) * 1000 for a, b in zip(pooled[base], pooled[path])]
        return (f"\n{label}, request by request: p50 {added_p50(path, base, rounds, load):+.2f} ms, "
                f"p90 {percentile(paired, 0.9):+.2f} ms; p99 {added99:+.2f} ms pooled ({who})")
    per_round = [(statistics.median(r[path][0]) - statistics.median(r[base][0])) * 1000 for r in rounds]
    return (f"\n{label}: p50 {statistics.median(per_round):+.2f} ms (median of {len(rounds)} rounds, range "
            f"{min(per_round):+.2f} to {max(per_round):+.2f}: {', '.join(f'{x:+.2f}' for x in per_round)}), "
            f"p99 {added99:+.2f} ms pooled ({who})")


def noise_floor(first: list[tuple], second: list[tuple], load: Load) -> str:
    """The open loop's in-process path against a second in-process run of it, request by request:
    what the ZeroMQ figure would read with no protocol at all (the machine's drift between runs)."""
    paired = [(b - a) * 1000 for one, two in zip(first, second) for a, b in zip(one[0], two[0])]
    return (f"noise floor of the open-loop figure: the in-process path against a second in-process run, request "
            f"by request: p50 {percentile(paired, 0.5):+.2f} ms ({load.clients} clients)\n")


def figures(rounds: list[dict[str, tuple]], load: Load) -> dict[str, float]:
    """One load's numbers, by name: each path's p50 (ms) and requests per second, and what each
    server path adds over in-process at p50 (ms)."""
    numbers = {}
    for path in (p for p in (LOCAL, REMOTE, HTTP) if p in rounds[0]):
        latencies = [x for r in rounds for x in r[path][0]]
        numbers[f"{SHORT[path]} p50 (ms)"] = percentile(latencies, 0.5) * 1000
        numbers[f"{SHORT[path]} req/s"] = len(latencies) / sum(r[path][1] for r in rounds)
        if path != LOCAL:
            numbers[f"added by {SHORT[path]}, p50 (ms)"] = added_p50(path, LOCAL, rounds, load)
    return numbers


def run_build(tree: Path, args: argparse.Namespace) -> list[dict[str, float]]:
    """One round of the measurement in a child process that imports ricllm from ``tree``."""
    passed = ["--clients", str(args.clients), "--requests", str(args.requests), "--rate", str(args.rate),
              "--rounds", "1", "--no-append"] + (["--http"] if args.http else [])
    passed += (["--model", args.model] if args.model else []) + (["--engine-cpus", args.engine_cpus]
                                                                 if args.engine_cpus else [])
    passed += ["--tiny"] if args.tiny else []
    env = {**os.environ, "PYTHONPATH": str(tree)}
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "figures.json"
        subprocess.run([sys.executable, __file__, *passed, "--json", str(out)], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def compare_builds(args: argparse.Namespace, loads: list[Load]) -> str:
    """Rounds alternating the builds (the order flips each round); per load and figure, each build's
    median and range over the rounds."""
    builds = {"baseline": Path(args.baseline).resolve(), "this checkout": ROOT}
    runs: dict[str, list[list[dict[str, float]]]] = {name: [] for name in builds}
    for index in range(args.rounds):
        order = list(builds) if index % 2 == 0 else list(builds)[::-1]
        for name in order:
            runs[name].append(run_build(builds[name], args))
            print(f"round {index + 1}: {name} done", file=sys.stderr)
    head = " | ".join(f"{name} ({builds[name]})" for name in builds)
    lines = []
    for index, load in enumerate(loads):
        lines += [f"{title(load)}, median [min–max] of {args.rounds} rounds:", "",
                  f"| figure | {head} |", "|---|---:|---:|"]
        for figure in runs["baseline"][0][index]:
            cells = []
            for name in builds:
                values = [run[index][figure] for run in runs[name]]
                cells.append(f"{statistics.median(values):.2f} [{min(values):.2f}–{max(values):.2f}]")
            lines.append(f"| {figure} | {' | '.join(cells)} |")
        lines.append("")
    return "\n".join(lines)


def tiny_model() -> str:
    """The tests' tiny random model (2 layers, hidden 64), written once to a temporary file."""
    from tests.helpers import write_tiny_llama_gguf

    return str(write_tiny_llama_gguf(Path(tempfile.mkdtemp(prefix="ricllm-bench-")) / "tiny.gguf", seed=0))


def model_name(args: argparse.Namespace) -> str:
    return "the tests' tiny random model" if args.tiny else f"model {args.model or 'SmolLM2 (installed)'}"


def title(load: Load) -> str:
    if load.rate is not None:
        return f"{load.clients} concurrent clients, open loop at {load.rate:g} requests/s in all"
    return "one client at a time" if load.clients == 1 else f"{load.clients} concurrent clients, closed loop"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=40, help="per client")
    parser.add_argument("--rate", type=float, default=100.0,
                        help="open-loop load: requests/s from all clients together (default 100)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds alternating the paths (with --baseline: the builds)")
    parser.add_argument("--model", default=None, help="GGUF file (default: the installed SmolLM2)")
    parser.add_argument("--tiny", action="store_true",
                        help="the tests' tiny random model instead: a step of well under a millisecond, so the "
                        "protocol's own cost is what the latencies hold")
    parser.add_argument("--engine-cpus", default=None, metavar="LIST",
                        help="CPUs for the engine (e.g. 0); clients and the server's other threads get the rest")
    parser.add_argument("--http", action="store_true",
                        help="serve HTTP (health, metrics, OpenAI API) beside ZeroMQ, and add the HTTP path: the "
                        "same loads through POST /v1/completions")
    parser.add_argument("--baseline", metavar="DIR",
                        help="another checkout of ricllm: compare its build with this one, rounds alternating")
    parser.add_argument("--json", metavar="PATH", help="also write this run's figures as JSON")
    parser.add_argument("--no-append", action="store_true")
    parser.add_argument("--client-child", metavar="ENDPOINT", help=argparse.SUPPRESS)
    parser.add_argument("--http-child", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--load", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client_child:
        latencies, wall, inside = zeromq_clients(args.client_child, Load(**json.loads(args.load)))
        print(json.dumps({"latencies": latencies, "wall_s": wall, "inside_s": inside}))
        return
    if args.http_child:
        latencies, wall = http_clients(args.http_child, Load(**json.loads(args.load)))
        print(json.dumps({"latencies": latencies, "wall_s": wall}))
        return
    import torch

    from benchmarks.results import publish
    from ricllm.affinity import format_cpu_list, other_cpus, pin_current_thread
    from ricllm.config import EngineConfig

    prompt = tuple(TINY_PROMPT if args.tiny else PROMPT)
    loads = [Load(1, args.requests * 4, prompt=prompt), Load(args.clients, args.requests, prompt=prompt),
             Load(args.clients, args.requests, args.rate, prompt=prompt)]
    if args.baseline:
        publish("Protocol overhead, two builds", f"{model_name(args)}, max_tokens 1; per round and build, in a child process of "
                f"its own: one client x {loads[0].requests} requests, then {args.clients} clients x "
                f"{args.requests} requests closed loop, then the same open loop at {args.rate:g} requests/s "
                f"(seeded Poisson sends, the same on every path); the builds alternate, their order flipping "
                f"each round{HTTP_DETAILS if args.http else ''}.", compare_builds(args, loads),
                append=not args.no_append)
        return
    torch.set_num_threads(2)
    model = tiny_model() if args.tiny else args.model
    config = EngineConfig(model=model, admission="off", max_num_seqs=64, engine_cpus=args.engine_cpus)
    placement = "engine, clients and server threads share every CPU"
    if config.engine_cpus:
        rest = other_cpus(config.engine_cpus)
        if not rest:
            parser.error(f"--engine-cpus {args.engine_cpus} leaves no CPU for the clients and the server's threads")
        pin_current_thread(rest)  # the in-process clients, the client process and the server's threads
        placement = (f"engine on CPU {format_cpu_list(config.engine_cpus)} ({len(config.engine_cpus)} thread"
                     f"{'s' if len(config.engine_cpus) > 1 else ''}), clients and the server's other threads "
                     f"on CPU {format_cpu_list(rest)}")
    rounds = []  # per round: per load, {path: (latencies, wall[, inside the server])}
    for _ in range(args.rounds):
        local, remote = in_process(config, loads), over_server(config, loads, args.http)
        rounds.append([{LOCAL: ours, **theirs} for ours, theirs in zip(local, remote)])
        rounds[-1].append(in_process(config, [loads[-1]])[0])  # the open loop again: the run's noise
    lines = []
    for index, load in enumerate(loads):
        lines += table(title(load), [r[index] for r in rounds], load)
    lines.append(noise_floor([r[-2][LOCAL] for r in rounds], [r[-1] for r in rounds], loads[-1]))
    if args.json:
        Path(args.json).write_text(json.dumps([figures([r[i] for r in rounds], load) for i, load in enumerate(loads)]))
    publish("Protocol overhead", f"{model_name(args)}, max_tokens 1; per round one client x {loads[0].requests} requests, then "
            f"{args.clients} clients x {args.requests} requests closed loop, then the same open loop at "
            f"{args.rate:g} requests/s (seeded Poisson sends, the same on both paths); {args.rounds} rounds "
            f"alternating the paths; ZeroMQ clients in a separate process; {placement}"
            f"{HTTP_DETAILS if args.http else ''}.",
            "\n".join(lines), append=not args.no_append)


if __name__ == "__main__":
    main()
