"""Protocol overhead: the ZeroMQ path (client -> ROUTER -> engine thread -> reply) against the
same engine driven in-process, with a trivial generation (max_tokens 1) and many concurrent clients.

Both paths share one engine configuration; the difference of their per-request latencies is what
the socket, msgpack, validation and the thread hand-offs add. Requests per second are reported for
both, side by side. Target: at most 1 ms added at p50.

    python benchmarks/bench_protocol.py [--clients 16] [--requests 40] [--model PATH]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results import publish  # noqa: E402
from ricllm.client import RicClient  # noqa: E402
from ricllm.config import EngineConfig  # noqa: E402
from ricllm.engine.async_engine import EngineThread  # noqa: E402
from ricllm.engine.latency_model import LatencyModel  # noqa: E402
from ricllm.engine.llm_engine import LLMEngine  # noqa: E402
from ricllm.sampling_params import SamplingParams  # noqa: E402
from ricllm.serve.server import Server  # noqa: E402
from ricllm.serve.settings import ServerOptions  # noqa: E402

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


def in_process(config: EngineConfig, clients: int, requests: int) -> tuple[list[float], float]:
    worker = EngineThread(LLMEngine(config))
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    worker.submit(PROMPT, params).result()  # warm-up
    result = run_clients(clients, requests, lambda c, i: worker.submit(PROMPT, params).result())
    worker.stop()
    return result


def over_zeromq(config: EngineConfig, clients: int, requests: int) -> tuple[list[float], float]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = Server(config, ServerOptions(zmq_endpoint=f"tcp://127.0.0.1:{port}", http_port=None),
                    latency_model=LatencyModel([0.01, 0.0, 0.0, 0.0, 0.0])).start()
    server.wait_ready(timeout=120)
    connections = [RicClient(f"tcp://127.0.0.1:{port}", timeout_s=60) for _ in range(clients)]
    connections[0].generate(token_ids=PROMPT, max_tokens=1, ignore_eos=True)  # warm-up
    result = run_clients(clients, requests, lambda c, i: connections[c].generate(
        token_ids=PROMPT, max_tokens=1, ignore_eos=True))
    for connection in connections:
        connection.close()
    server.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=40, help="per client")
    parser.add_argument("--model", default=None, help="GGUF file (default: the installed SmolLM2)")
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(2)
    config = EngineConfig(model=args.model, admission="off", max_num_seqs=64)
    rows = {"in-process": in_process(config, args.clients, args.requests),
            "ZeroMQ": over_zeromq(config, args.clients, args.requests)}
    lines = ["| path | requests | req/s | p50 (ms) | p99 (ms) |", "|---|---:|---:|---:|---:|"]
    for name, (latencies, wall) in rows.items():
        lines.append(f"| {name} | {len(latencies)} | {len(latencies) / wall:.1f} | "
                     f"{percentile(latencies, 0.5) * 1000:.2f} | {percentile(latencies, 0.99) * 1000:.2f} |")
    (base, _), (zmq_lat, _) = rows["in-process"], rows["ZeroMQ"]
    added50 = (statistics.median(zmq_lat) - statistics.median(base)) * 1000
    added99 = (percentile(zmq_lat, 0.99) - percentile(base, 0.99)) * 1000
    lines.append(f"\nadded by the ZeroMQ path: p50 {added50:+.2f} ms, p99 {added99:+.2f} ms "
                 f"({args.clients} concurrent clients, max_tokens 1)")
    publish("Protocol overhead", f"{args.clients} client threads x {args.requests} requests, max_tokens 1.",
            "\n".join(lines), append=not args.no_append)

if __name__ == "__main__":
    main()
