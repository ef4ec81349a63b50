"""The default scenario four ways: prefix caching on / off, and admission on / first-come-first-served.

Runs `ricllm replay` once per variant (each in its own process, one after another, on the same
seeded trace) and prints hit rate, TTFT and compliance side by side; `ricllm report A B`
comparison pages are written for caching on vs off and admission vs FCFS.

    python benchmarks/bench_replay.py [--scenario default] [--out reports/bench-replay]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # last: no folder of ours shadows an installed package

from benchmarks.results import publish  # noqa: E402

VARIANTS = {
    "caching on, admission": [],
    "caching off, admission": ["--set", "engine.enable_prefix_caching=false"],
    "caching on, FCFS": ["--set", "engine.admission=fcfs"],
    "caching off, FCFS": ["--set", "engine.enable_prefix_caching=false", "--set", "engine.admission=fcfs"],
}
COLUMNS = [("sent", "{:.0f}"), ("admitted", "{:.0f}"), ("met_of_admitted", "{:.1%}"), ("met_of_sent", "{:.1%}"),
           ("goodput_rps", "{:.3f}"), ("prefix_cache_hit_rate", "{:.1%}"), ("p50_ttft_s", "{:.3f}"),
           ("p95_ttft_s", "{:.3f}"), ("p95_e2e_s", "{:.3f}")]


def run_variant(scenario: str, out: Path, extra: list[str]) -> dict:
    command = [sys.executable, "-m", "ricllm.cli", "replay", scenario, "--out", str(out), "--no-progress", *extra]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode not in (0, 1):  # 1: targets missed, still a report
        raise SystemExit(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-2000:]}")
    return json.loads((out / "report.json").read_text())["aggregates"]["overall"]


def cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="default")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "bench-replay")
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    folders = {name: args.out / name.replace(", ", "-").replace(" ", "_") for name in VARIANTS}
    results = {name: run_variant(args.scenario, folders[name], extra) for name, extra in VARIANTS.items()}
    lines = ["| variant | " + " | ".join(c for c, _ in COLUMNS) + " |", "|---|" + "---:|" * len(COLUMNS)]
    for name, overall in results.items():
        lines.append(f"| {name} | " + " | ".join(cell(overall.get(c), f) for c, f in COLUMNS) + " |")
    for a, b in (("caching on, admission", "caching off, admission"), ("caching on, admission", "caching on, FCFS")):
        subprocess.run([sys.executable, "-m", "ricllm.cli", "report", str(folders[a]), str(folders[b])],
                       capture_output=True, text=True)
    publish(f"Replay comparison ({args.scenario})", f"Latencies in seconds; comparison pages under `{args.out}`.",
            "\n".join(lines), append=not args.no_append)

if __name__ == "__main__":
    main()
