"""Bundled replay scenarios (``ricllm replay default|overload|templates``), shipped as package data.

The YAML files and ``prompts/`` here are mirrored at the repository's top-level ``scenarios/``;
``tests/replay/test_scenario.py`` checks that the two copies are identical.
"""
