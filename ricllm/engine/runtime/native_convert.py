"""The native runtime's weights on disk: found in the cache, else converted from the model file
with the torch runtime's code, in a child process (``python -m ricllm.engine.runtime.native_convert
MODEL WEIGHTS OUT``) so that torch never enters the serving process. The child prints one JSON
line: ``{"written": OUT}``, or ``{"unsupported": reason}`` for a model the C decoder stack
cannot serve (remembered beside the entry, so later starts skip converting)."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ricllm.config import EngineConfig
from ricllm.errors import ModelLoadError
from ricllm.extras import MissingExtraError, install_hint
from ricllm.logging import get_logger
from ricllm.model import native_weights
from ricllm.model.native_weights import NativeWeights
from ricllm.paths import cache_dir, evict_least_recent, file_digest, touch_used
from ricllm.version import __version__

log = get_logger("ricllm.native")
MAX_ENTRIES = 4  # native weights files kept (most recently used), as the torch runtime's entries


class NativeUnsupported(Exception):
    """The converted model cannot run natively (the message says why): use the torch runtime."""


def entry_path(model_path: Path, weights: str) -> Path:
    """Where the native weights for this file and weight format live in the cache: keyed like the
    torch runtime's entries by the file's sha256, the format and the conversion code."""
    key = {"sha256": file_digest(model_path), "weights": weights, "format": native_weights.FORMAT_VERSION,
           "ricllm": __version__, "code": conversion_code_digest()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "weights" / f"{digest}.native"


@functools.lru_cache(maxsize=1)
def conversion_code_digest() -> str:
    """The sources that turn a file into packed arrays: an edit there invalidates older files
    (read once per process: a start asks for its entry's path twice)."""
    import ricllm.kernels

    model_dir, kernels_dir = Path(native_weights.__file__).parent, Path(ricllm.kernels.__file__).parent
    runtime_dir = Path(__file__).parent  # the torch model the conversion runs, and its loading
    digest = hashlib.sha256()
    model_files = ("loader.py", "formats.py", "packed_linear.py", "native_weights.py")
    for path in [model_dir / name for name in model_files] + [
            runtime_dir / "llama.py", runtime_dir / "llama_weights.py", runtime_dir / "gemma3.py",
            runtime_dir / "gemma3_weights.py", kernels_dir / "cpu_quant.py", Path(__file__)]:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _convert(model_path: Path, weights: str, out: Path) -> str | None:
    """Write the native weights of ``model_path`` to ``out``; the reason when they cannot be.

    Converting needs torch: a process that already imported it converts in place, any other in a
    child process, so that torch's memory never enters the serving one."""
    if "torch" in sys.modules:
        from ricllm.model.heap import release_free_heap

        reason = convert(model_path, weights, out)
        release_free_heap()  # the torch model it packed from is garbage now
        return reason
    if not _torch_installed():
        raise MissingExtraError(
            f"the native runtime converts {model_path.name} with torch once, and this install has no torch (its "
            f"converted weights are not in the cache): {install_hint('engine')}; or serve through ONNX Runtime, "
            "which needs no torch: --runtime onnx (the ricllm[onnx] extra)")
    model_path, out = model_path.resolve(), out.resolve()
    command = [sys.executable, "-m", "ricllm.engine.runtime.native_convert", str(model_path), weights, str(out)]
    log.info("native_weights_converting", model=str(model_path), weights=weights, out=str(out))
    # run from the cache folder: ``-m`` puts the working directory first on the import path, and a
    # ricllm checkout there would convert with its code instead of this process's
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=None, text=True,  # stderr: progress bars
                            cwd=out.parent, check=False)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        raise ModelLoadError(f"converting {str(model_path)!r} for the native runtime failed "
                             f"(exit code {result.returncode}); see the messages above")
    return json.loads(lines[-1]).get("unsupported")


def load_weights(config: EngineConfig, model_path: Path) -> tuple[NativeWeights, str, Path | None]:
    """(weights, where they came from, the cache entry). ``NativeUnsupported`` for a model the
    stack cannot serve (remembered in the cache beside the entry, so later starts skip converting)."""
    if not config.weight_cache:
        return _convert_privately(model_path, config.weights), f"file {model_path}", None
    entry = entry_path(model_path, config.weights)
    refusal = entry.with_suffix(".unsupported")
    if refusal.is_file():
        raise NativeUnsupported(refusal.read_text().strip())
    if entry.is_file():
        try:
            touch_used(entry)
            return native_weights.read(entry), f"cache {entry}", entry
        except (ValueError, OSError) as exc:  # torn, stale or unreadable: converted again
            log.warning("native_weights_unreadable", path=str(entry), error=str(exc))
    if not _writable(entry.parent):  # a read-only cache costs this start time, nothing else
        log.warning("weight_cache_not_written", path=str(entry), error="the folder is not writable")
        return _convert_privately(model_path, config.weights), f"file {model_path}", None
    reason = _convert(model_path, config.weights, entry)
    if reason is not None:
        refusal.write_text(reason + "\n")
        raise NativeUnsupported(reason)
    for stale in evict_least_recent(entry.parent, "*.native", MAX_ENTRIES):
        log.info("weight_cache_evicted", path=str(stale))
    return native_weights.read(entry), f"file {model_path}", entry


def _convert_privately(model_path: Path, weights: str) -> NativeWeights:
    """Convert into a temporary file, map it and unlink it at once: the mapping keeps its pages."""
    with tempfile.TemporaryDirectory(prefix="ricllm-native-") as folder:
        out = Path(folder) / "model.native"
        reason = _convert(model_path, weights, out)
        if reason is not None:
            raise NativeUnsupported(reason)
        return native_weights.read(out)


def _torch_installed() -> bool:
    """Whether the child that converts can import torch (asked without importing it here)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except ImportError:  # a finder that refuses the name: as good as absent
        return False


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK)


def convert(model_path: Path, weights: str, out: Path) -> str | None:
    """Write ``out``; the reason instead when the converted model is not servable natively."""
    import torch

    from ricllm.engine.runtime.torch_runtime import LoadedModel

    config = EngineConfig(model=str(model_path), dtype="bfloat16", device="cpu", attention_backend="cpu",
                          weights=weights, weight_cache=False, runtime="torch")
    loaded = LoadedModel(config, model_path, torch.device("cpu"), torch.bfloat16)
    reason = native_weights.unsupported_reason(loaded.model)
    if reason is None:
        native_weights.write(out, loaded.spec, loaded.tokenizer, loaded.model, loaded.weight_formats)
    return reason


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m ricllm.engine.runtime.native_convert MODEL WEIGHTS OUT", file=sys.stderr)
        return 2
    from ricllm.errors import RicllmError

    model, weights, out = argv
    try:
        reason = convert(Path(model), weights, Path(out))
    except RicllmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"unsupported": reason} if reason else {"written": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
