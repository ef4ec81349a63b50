"""Kernel tests run on CPU through the Triton interpreter; make ``ricllm.kernels`` importable.

``TRITON_INTERPRET=1`` must be set before any ``@triton.jit`` function is defined, so it is
set here, before the test modules import the kernels. Without ``pip install -e .`` the
``ricllm.kernels -> kernels/`` mapping of pyproject.toml does not exist; it is mirrored here.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parents[2]


def _ensure_ricllm_kernels() -> None:
    """Import ``ricllm.kernels``; from a plain checkout, load ``kernels/`` under that name."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        importlib.import_module("ricllm.kernels")
        return
    except ModuleNotFoundError as exc:
        if exc.name != "ricllm.kernels":
            raise
    spec = importlib.util.spec_from_file_location(
        "ricllm.kernels", ROOT / "kernels" / "__init__.py",
        submodule_search_locations=[str(ROOT / "kernels")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["ricllm.kernels"] = module
    spec.loader.exec_module(module)
    setattr(importlib.import_module("ricllm"), "kernels", module)


_ensure_ricllm_kernels()
