"""Run a script as on the lent GPU machine: torch and Triton (with numpy, Triton's own
dependency) installed, none of ricllm's other dependencies. Usage: ``python gpu_machine_run.py
SCRIPT [ARGS...]``; importing any of them fails as if it were missing."""

from __future__ import annotations

import runpy
import sys

ABSENT = {"pydantic", "structlog", "gguf", "tokenizers", "zmq", "jinja2", "prometheus_client", "msgpack",
          "jsonschema", "tqdm", "rich", "yaml", "matplotlib", "transformers", "hypothesis"}


class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r} (absent on the GPU machine)", name=name)
        return None


if __name__ == "__main__":
    sys.meta_path.insert(0, _Absent())
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
