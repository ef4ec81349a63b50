"""ricllm's optional parts (pip extras), and which one brings a package that this install lacks.

``pip install ricllm`` is the client alone (pyzmq, msgpack, pydantic, structlog): ``ricllm client``,
``ricllm keys`` and :mod:`ricllm.client` talk to a running server without torch. ``ricllm[engine]``
adds what loads and serves a model (torch, numpy, gguf, tokenizers, llguidance, the HTTP stack, ...);
``ricllm[onnx]`` is the same engine with ONNX Runtime in torch's place, serving ``runtime="onnx"`` only
(``ricllm[onnx-gpu]``: its CUDA build, the same module, so the two exclude each other; a missing
``onnxruntime`` is named as ``[onnx]``'s); both share ``ricllm[engine-base]``, which pyproject.toml names
and a message never does (numpy and the rest are named as ``[engine]``'s). ``ricllm[report]`` adds the
report's plots (matplotlib); ``ricllm[adapt]`` what trains an adapter (transformers, peft).
A command run without the extra it needs ends with an error that names the extra, not a traceback
(:func:`missing_extra`).
"""

from __future__ import annotations

from ricllm.errors import RicllmError

# top-level import name -> the extra that installs it (tests/test_packaging.py keeps this in step with
# pyproject.toml). rich is in both extras; it is named as report's because an engine command without
# the engine fails on numpy or torch first.
EXTRA_OF_MODULE = {
    "torch": "engine", "numpy": "engine", "gguf": "engine", "tokenizers": "engine", "jinja2": "engine",
    "safetensors": "engine", "tqdm": "engine", "yaml": "engine", "prometheus_client": "engine",
    "llguidance": "engine", "jsonschema": "engine", "starlette": "engine", "uvicorn": "engine",
    "watchfiles": "engine", "matplotlib": "report", "rich": "report",
    "transformers": "adapt", "accelerate": "adapt", "peft": "adapt",
    "onnxruntime": "onnx", "onnx": "onnx",
}


class MissingExtraError(RicllmError):
    """A command needs a package of an extra that is not installed (the message says which)."""


def install_hint(extra: str) -> str:
    return f"pip install 'ricllm[{extra}]' (in a source checkout: bash scripts/setup.sh)"


def missing_extra(exc: ImportError) -> str | None:
    """The extra that brings the module ``exc`` could not import; None when no extra does (a bug, then)."""
    name = getattr(exc, "name", None) or ""
    return EXTRA_OF_MODULE.get(name.split(".")[0])


def missing_extra_message(what: str, exc: ImportError) -> str:
    """E.g. ``ricllm serve needs torch, which this install lacks (a client-only install): pip install ...``."""
    extra = missing_extra(exc)
    module = (exc.name or "").split(".")[0]
    return f"{what} needs {module}, which this install lacks (the ricllm[{extra}] extra): {install_hint(extra)}"
