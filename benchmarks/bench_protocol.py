"""Protocol overhead: the ZeroMQ path (client -> ROUTER -> engine thread -> reply) against the
same engine driven in-process, with a trivial generation (max_tokens 1).

Both paths share one engine configuration; the difference of their per-request latencies is what
the socket, msgpack, validation and the thread hand-offs add. The ZeroMQ clients run in a
separate process (as a RIC's would), so they do not compete with the server for its
interpreter; the in-process clients are threads calling the engine thread directly. Two loads:
one client at a time (the protocol's own cost per request) and many concurrent clients.
Requests per second are reported for both paths, side by side. The two paths alternate for
``--rounds`` rounds (two busy cores make one round's difference noisy): the tables pool every
round, and the added p50 is given per round and as the median of the rounds. Target: at most
1 ms added at p50.

    python benchmarks/bench_protocol.py [--clients 16] [--requests 40] [--rounds 5] [--model PATH]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import json
import subprocess

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ricllm.client import RicClient  # noqa: E402  (no torch: the client child stays light)

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345]  # 8 tokens: the model step stays small


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_clients(clients: int, requests: int, one_request) -> tuple[list[float], float]:
    """Each client thread sends ``requests`` back to back; returns latencies and wall time."""
    latencies: list[float] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        mine = []
        for i in range(requests):
            started = time.perf_counter()
            one_request(index, i)
            mine.append(time.perf_counter() - started)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, time.perf_counter() - started


def in_process(config, loads: list[tuple[int, int]]) -> list[tuple[list[float], float]]:
    from ricllm.engine.async_engine import EngineThread
    from ricllm.engine.llm_engine import LLMEngine
    from ricllm.sampling_params import SamplingParams

    worker = EngineThread(lambda: LLMEngine(config))  # built on its own thread, as the server's
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    worker.submit(PROMPT, params).result()  # warm-up
    results = [run_clients(clients, requests, lambda c, i: worker.submit(PROMPT, params).result())
               for clients, requests in loads]
    worker.stop()
    return results


def zeromq_clients(endpoint: str, clients: int, requests: int) -> tuple[list[float], float]:
    """The client side, run in a child process: one connection per client thread."""
    connections = [RicClient(endpoint, timeout_s=60) for _ in range(clients)]
    connections[0].generate(token_ids=PROMPT, max_tokens=1, ignore_eos=True)  # warm-up
    result = run_clients(clients, requests, lambda c, i: connections[c].generate(
        token_ids=PROMPT, max_tokens=1, ignore_eos=True))
    for connection in connections:
        connection.close()
    return result


def over_zeromq(config, loads: list[tuple[int, int]]) -> list[tuple[list[float], float]]:
    from ricllm.engine.latency_model import LatencyModel
    from ricllm.serve.server import Server
    from ricllm.serve.settings import ServerOptions

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    server = Server(config, ServerOptions(zmq_endpoint=endpoint, http_port=None),
                    latency_model=LatencyModel([0.01])).start()
    server.wait_ready(timeout=120)
    results = []
    for clients, requests in loads:
        child = subprocess.run([sys.executable, __file__, "--client-child", endpoint, "--clients", str(clients),
                                "--requests", str(requests)], capture_output=True, text=True, check=True)
        measured = json.loads(child.stdout.strip().splitlines()[-1])
        results.append((measured["latencies"], measured["wall_s"]))
    server.stop()
    return results


LOCAL, REMOTE = "in-process", "ZeroMQ (clients in another process)"


def table(name: str, rounds: list[dict[str, tuple[list[float], float]]], clients: int) -> list[str]:
    """Pooled over the rounds, then the added p50 of each round and their median."""
    lines = [f"{name}:", "", "| path | requests | req/s | p50 (ms) | p99 (ms) |", "|---|---:|---:|---:|---:|"]
    pooled = {}
    for path in (LOCAL, REMOTE):
        latencies = [x for r in rounds for x in r[path][0]]
        wall = sum(r[path][1] for r in rounds)
        pooled[path] = latencies
        lines.append(f"| {path} | {len(latencies)} | {len(latencies) / wall:.1f} | "
                     f"{percentile(latencies, 0.5) * 1000:.2f} | {percentile(latencies, 0.99) * 1000:.2f} |")
    per_round = [(statistics.median(r[REMOTE][0]) - statistics.median(r[LOCAL][0])) * 1000 for r in rounds]
    added99 = (percentile(pooled[REMOTE], 0.99) - percentile(pooled[LOCAL], 0.99)) * 1000
    lines.append(f"\nadded by the ZeroMQ path: p50 {statistics.median(per_round):+.2f} ms (median of {len(rounds)} "
                 f"rounds: {', '.join(f'{x:+.2f}' for x in per_round)}), p99 {added99:+.2f} ms pooled "
                 f"({clients} client{'s' if clients > 1 else ''}, max_tokens 1)\n")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=40, help="per client")
    parser.add_argument("--rounds", type=int, default=5, help="alternating in-process / ZeroMQ rounds")
    parser.add_argument("--model", default=None, help="GGUF file (default: the installed SmolLM2)")
    parser.add_argument("--no-append", action="store_true")
    parser.add_argument("--client-child", metavar="ENDPOINT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client_child:
        latencies, wall = zeromq_clients(args.client_child, args.clients, args.requests)
        print(json.dumps({"latencies": latencies, "wall_s": wall}))
        return
    import torch

    from benchmarks.results import publish
    from ricllm.config import EngineConfig

    torch.set_num_threads(2)
    config = EngineConfig(model=args.model, admission="off", max_num_seqs=64)
    loads = [(1, args.requests * 4), (args.clients, args.requests)]
    rounds = []  # per round: per load, {path: (latencies, wall)}
    for _ in range(args.rounds):
        local, remote = in_process(config, loads), over_zeromq(config, loads)
        rounds.append([{LOCAL: ours, REMOTE: theirs} for ours, theirs in zip(local, remote)])
    lines = []
    for index, (clients, _) in enumerate(loads):
        name = "one client at a time" if clients == 1 else f"{clients} concurrent clients"
        lines += table(name, [r[index] for r in rounds], clients)
    publish("Protocol overhead", f"max_tokens 1; per round one client x {loads[0][1]} requests, then "
            f"{args.clients} clients x {args.requests} requests; {args.rounds} rounds alternating the paths; "
            f"ZeroMQ clients in a separate process.",
            "\n".join(lines), append=not args.no_append)


if __name__ == "__main__":
    main()
