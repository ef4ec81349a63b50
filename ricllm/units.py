"""Byte sizes with explicit units: GB/MB/KB are powers of 10, GiB/MiB/KiB powers of 2."""

from __future__ import annotations

import re

from ricllm.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """``"256MiB"`` -> 268435456; ``"1.5GB"`` -> 1500000000; ints pass through."""
    if isinstance(value, bool):
        raise ConfigError(f"expected a byte size, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"a byte size cannot be negative: {value}")
        return int(value)
    match = _SIZE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"cannot parse byte size {value!r}: use a number with an optional unit "
            "(B, KB, MB, GB, KiB, MiB, GiB), e.g. '256MiB'")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(num_bytes: float) -> str:
    """Binary units, as memory is allocated: ``268435456`` -> ``'256.0 MiB'``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{int(num_bytes)} B"
