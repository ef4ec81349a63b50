"""Where ricllm keeps what it derives once and reuses: latency fits, built kernels, file digests."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path


PACKAGE_ROOT = Path(__file__).resolve().parent
# where the wheel puts each data folder that a checkout keeps at its top level (pyproject.toml's package-dir)
_IN_THE_WHEEL = {"kernels": ("kernels", "csrc"), "scenarios": ("scenarios",)}


def shipped_folder(name: str) -> Path:
    """``kernels`` (the C and CUDA sources) or ``scenarios`` (the bundled replay scenarios).

    A checkout keeps them at its top level as plain folders, not packages: no ``import kernels``
    run from the repository root may find ours instead of the registry's. The wheel ships them
    inside ``ricllm/``."""
    packaged = PACKAGE_ROOT.joinpath(*_IN_THE_WHEEL[name])
    return packaged if packaged.is_dir() else PACKAGE_ROOT.parent / name


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
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            memo.write_text(json.dumps(known))
        except OSError:  # a read-only cache: the file is read again at the next start, nothing worse
            pass
    return known[memo_key]


def touch_used(path: Path) -> None:
    """Mark a cache entry as just used. The time is given explicitly: the file system's own clock
    ticks coarsely (milliseconds), so two uses in one tick would tie and evict the wrong entry.
    A read-only cache (an image's, under a read-only root file system) is used all the same."""
    now = time.time_ns()
    try:
        os.utime(path, ns=(now, now))
    except OSError:
        pass


def evict_least_recent(folder: Path, pattern: str, keep: int) -> list[Path]:
    """Delete all but the ``keep`` most recently used files matching ``pattern``; the deleted."""
    entries = sorted(folder.glob(pattern), key=lambda p: p.stat().st_mtime, reverse=True)
    for stale in entries[keep:]:
        stale.unlink(missing_ok=True)
    return entries[keep:]
