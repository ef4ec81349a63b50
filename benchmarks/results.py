"""What every benchmark script shares: the machine line and the section appended to RESULTS.md."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def publish(title: str, details: str, body: str, append: bool) -> None:
    """Print a dated section (machine, command, details, body) and append it to RESULTS.md."""
    script = Path(sys.argv[0]).name
    text = (f"\n## {title}, {datetime.date.today()}\n\nMachine: {machine()}. {details}\n"
            f"Command: `python benchmarks/{script} {' '.join(sys.argv[1:])}`\n\n{body}")
    print(text)
    if append:
        with open(RESULTS, "a") as f:
            f.write(text + "\n")
