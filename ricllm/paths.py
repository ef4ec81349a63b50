"""Where ricllm keeps what it derives once and reuses: latency fits, built kernels, file digests."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$RICLLM_CACHE_DIR``, else ``~/.cache/ricllm``."""
    return Path(os.environ.get("RICLLM_CACHE_DIR", Path.home() / ".cache" / "ricllm"))
