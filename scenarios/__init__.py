"""Bundled replay scenarios (``ricllm replay default|overload|templates``), shipped as package data.

This top-level folder is the only copy: ``pyproject.toml`` installs it as ``ricllm.scenarios``
(``package-dir``, as ``kernels/`` becomes ``ricllm.kernels``), and ``ricllm.replay.loading`` finds
the files through ``importlib.resources``. A template's ``file:`` is relative to its scenario, so
``prompts/`` travels with the YAML files.
"""
