"""Which model is served, named once: its file, its own name, and the name clients call it by.

The engine builds one :class:`ServedModel` as it loads (``LLMEngine.served_model``); the ZeroMQ
``stats`` reply, the OpenAI API's ``model`` field and ``/v1/models``, the metrics' ``model_name``
label, replay reports, ``ricllm info`` and the planner read their names from it, so they cannot
disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ricllm.paths import file_digest


@dataclass(frozen=True)
class ServedModel:
    """``name``: the model's own (a GGUF's ``general.name``, an HF folder's name), else its file's
    stem; ``served_name``: the ``served_model_name`` setting, else ``name``."""

    path: Path
    name: str
    served_name: str

    @classmethod
    def of(cls, path: str | Path, own_name: str = "", served_model_name: str | None = None) -> ServedModel:
        path = Path(path)
        name = own_name or path.stem
        return cls(path, name, served_model_name or name)

    def answers_to(self, requested: str) -> bool:
        """Whether a request naming ``requested`` means this model: its served name, or its file's
        name with or without the suffix."""
        return requested in {self.served_name, self.path.name, self.path.stem}

    def record(self, digest: bool = True) -> dict[str, Any]:
        """The ``model`` entry of a replay report; ``digest`` False where the file is not at hand
        (a remote server's)."""
        return {"path": str(self.path), "name": self.name, "served_name": self.served_name,
                "sha256": file_digest(self.path) if digest else None}
