"""Where ricllm keeps what it derives once and reuses: latency fits, built kernels, file digests."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def cache_dir() -> Path:
    """``$RICLLM_CACHE_DIR``, else ``~/.cache/ricllm``."""
    return Path(os.environ.get("RICLLM_CACHE_DIR", Path.home() / ".cache" / "ricllm"))


def file_digest(path: Path) -> str:
    """sha256 of a model file (or an HF folder's weights and JSON files), memoized by
    (path, size, mtime) so each file is read once."""
    stat = path.stat()
    memo = cache_dir() / "digests.json"
    memo_key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    known = json.loads(memo.read_text()) if memo.is_file() else {}
    if memo_key not in known:
        digest = hashlib.sha256()
        # a folder's config and tokenizer JSON count too: they change the model as much as its weights
        files = sorted([*path.glob("*.safetensors"), *path.glob("*.json")]) if path.is_dir() else [path]
        for file in files:
            with open(file, "rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 22), b""):
                    digest.update(chunk)
        known[memo_key] = digest.hexdigest()
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text(json.dumps(known))
    return known[memo_key]
