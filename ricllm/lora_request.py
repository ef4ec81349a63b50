"""Which LoRA adapter a request is served under: ``LoRARequest`` as a caller names it (vLLM's
name and fields), and ``AdapterSlot`` as a sequence carries it once the engine holds the adapter.

It lies below the sequence, the scheduler, the KV cache manager and the runtimes, which all read
a sequence's adapter: the runtimes its ``slot``, the prefix cache its ``content_hash``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """Serve a request under the adapter ``lora_name``: the one the engine holds under that name, or,
    with ``lora_path``, the PEFT folder there (loaded once, then held under the name)."""

    lora_name: str
    lora_path: str | None = None


@dataclass(frozen=True)
class AdapterSlot:
    """A resident adapter, as its sequences carry it. ``slot`` is where the runtime holds its
    weights; ``content_hash`` (``LoraAdapter.content_hash``) roots the hash chain of the sequence's
    KV blocks, so that K/V computed under one adapter is never found for another or for none."""

    name: str
    slot: int
    content_hash: str
