"""Converts a model file to native weights with the torch runtime's code (``python -m
ricllm.engine.native_convert MODEL WEIGHTS OUT``): the native runtime runs this in a child
process, so torch never enters the serving process. Prints one JSON line: ``{"written": OUT}``,
or ``{"unsupported": reason}`` for a model the C decoder stack cannot serve."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def convert(model_path: Path, weights: str, out: Path) -> str | None:
    """Write ``out``; the reason instead when the converted model is not servable natively."""
    import torch

    from ricllm.config import EngineConfig
    from ricllm.engine.torch_runtime import LoadedModel
    from ricllm.model import native_weights

    config = EngineConfig(model=str(model_path), dtype="bfloat16", device="cpu", attention_backend="cpu",
                          weights=weights, weight_cache=False, runtime="torch")
    loaded = LoadedModel(config, model_path, torch.device("cpu"), torch.bfloat16)
    reason = native_weights.unsupported_reason(loaded.model)
    if reason is None:
        native_weights.write(out, loaded.spec, loaded.tokenizer, loaded.model, loaded.weight_formats)
    return reason


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m ricllm.engine.native_convert MODEL WEIGHTS OUT", file=sys.stderr)
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
