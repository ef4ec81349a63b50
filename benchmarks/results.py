"""What every benchmark script shares: the machine line and the section appended to RESULTS.md."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


# AMD's family 25 (0x19) models by generation; a VM's model name is often just "AMD EPYC"
AMD_FAMILY_25 = ((0x00, 0x0F, "Zen 3"), (0x10, 0x1F, "Zen 4"), (0x20, 0x2F, "Zen 3"), (0x40, 0x4F, "Zen 3+"),
                 (0x50, 0x5F, "Zen 3"), (0x60, 0x7F, "Zen 4"), (0xA0, 0xAF, "Zen 4c"))


def cpu_fields() -> dict[str, str]:
    """The first processor's /proc/cpuinfo fields ({} where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    first = text.split("\n\n", 1)[0]
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}


def cpu_name(fields: dict[str, str]) -> str:
    """The model name, with the family and model, and AMD's generation where the VM hides it."""
    name = fields.get("model name") or platform.processor() or platform.machine()
    family, model = fields.get("cpu family"), fields.get("model")
    if family is None or model is None:
        return name
    generation = ""
    if fields.get("vendor_id") == "AuthenticAMD" and family == "25":
        generation = next((g + ", " for lo, hi, g in AMD_FAMILY_25 if lo <= int(model) <= hi), "")
    return f"{name} ({generation}family {family} model {model})"


def machine() -> str:
    cpu = cpu_name(cpu_fields())
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
