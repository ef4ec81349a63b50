"""The LoRA adapters the engine serves: each loaded once into one of the runtime's slots, known by name.

Invariants, between calls:
- a name maps to one resident adapter (its ``AdapterSlot``); a slot holds at most one adapter;
- a slot is reused only when no unfinished sequence (request or pin) holds it: replacing an
  adapter under its name (a hot reload) loads the new one into a free slot and maps the name to
  it at once, while requests already under the old one finish on the old slot, which is freed
  when the last of them ends;
- the adapters resident are at most the runtime's slots (``max_loras``).

An ``AdapterSlot`` carries the adapter's content hash, which roots its sequences' prefix-cache
chains (``ricllm.cache.kv_cache_manager.chain_root``), so K/V of one adapter is never served to
another, nor across a replacement that changed its numbers.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ricllm.engine.stats import AdapterStats
from ricllm.errors import CapacityError, InvalidRequestError
from ricllm.logging import get_logger
from ricllm.lora_request import AdapterSlot, LoRARequest
from ricllm.model.lora import LoraAdapter, load_lora_adapter
from ricllm.model.spec import ModelSpec
from ricllm.units import format_bytes

log = get_logger("ricllm.engine.lora")


@dataclass(frozen=True)
class ResidentAdapter:
    """An adapter as the engine holds it: where, what it is, and what it costs."""

    slot: AdapterSlot
    path: Path
    rank: int
    nbytes: int  # fp32 arrays as read; the runtime's layout is in ``LoraRegistry.runtime_nbytes``


class UnknownAdapterError(InvalidRequestError):
    """A request names an adapter the engine does not hold."""

    code = "UNKNOWN_ADAPTER"


class LoraRegistry:
    """``runtime_slots`` is the runtime's ``lora`` (``load(slot, adapter)``, ``unload(slot)``,
    ``capacity``, ``nbytes``); ``spec`` the model every adapter must fit; ``base_name`` the name
    clients call the base model by, which no adapter may take."""

    def __init__(self, runtime_slots, spec: ModelSpec, base_name: str | None = None):
        self.slots, self.spec, self.base_name = runtime_slots, spec, base_name
        self.latency = None  # admission's LatencyModel, priced anew as adapters come and go (the engine sets it)
        self.by_name: dict[str, ResidentAdapter] = {}
        self._holders: Counter[int] = Counter()  # slot -> unfinished sequences under it
        self._retiring: set[int] = set()  # slots whose name moved on: freed when their last holder ends

    @property
    def capacity(self) -> int:
        return self.slots.capacity if self.slots is not None else 0

    def add(self, name: str, path: str | Path) -> ResidentAdapter:
        """Load the adapter at ``path`` under ``name``; the same content under the same name is a no-op.
        New content under a held name replaces it for requests that arrive from now on."""
        if not name:
            raise InvalidRequestError("an adapter needs a name")
        if name == self.base_name:
            raise InvalidRequestError(f"adapter name {name!r} is the base model's served name: a request for it "
                                      "could not say which it means; pick another name")
        adapter = load_lora_adapter(path, self.spec)
        held = self.by_name.get(name)
        if held is not None and held.slot.content_hash == adapter.content_hash:
            return held
        if held is not None and self._holders[held.slot.slot] == 0:
            self._drop(name)  # nothing runs under it: its slot may take the new content
        resident = self._load(name, adapter)
        if name in self.by_name:
            self._drop(name)  # its requests finish on it; the name serves the new content from now on
        self.by_name[name] = resident
        self._price()
        log.info("lora_adapter_loaded", name=name, path=str(resident.path), slot=resident.slot.slot,
                 rank=resident.rank, bytes=format_bytes(resident.nbytes), replaced=held is not None,
                 content_hash=adapter.content_hash[:12])
        return resident

    def _load(self, name: str, adapter: LoraAdapter) -> ResidentAdapter:
        slot = self._free_slot(name)
        self.slots.load(slot, adapter)
        return ResidentAdapter(AdapterSlot(name, slot, adapter.content_hash), adapter.path, adapter.max_rank,
                               adapter.nbytes)

    def _free_slot(self, name: str) -> int:
        if self.capacity == 0:
            raise CapacityError(f"cannot load adapter {name!r}: this engine has no adapter slots "
                                "(max_loras is 0, or its runtime serves no adapters)")
        used = {r.slot.slot for r in self.by_name.values()} | self._retiring
        free = [s for s in range(self.capacity) if s not in used]
        if not free:
            raise CapacityError(
                f"cannot load adapter {name!r}: all {self.capacity} adapter slots (max_loras) hold adapters"
                + (f" ({len(self._retiring)} finishing their requests after a replacement)" if self._retiring else "")
                + f"; loaded: {sorted(self.by_name)}. Remove one, or raise max_loras")
        return free[0]

    def remove(self, name: str) -> None:
        """Stop serving ``name``; requests already under it finish on it."""
        if name not in self.by_name:
            raise UnknownAdapterError(self._unknown(name))
        self._drop(name)

    def _drop(self, name: str) -> None:
        slot = self.by_name.pop(name).slot.slot
        self._retiring.add(slot)
        self._free_if_unheld(slot)  # prices anew if the slot is freed; a retiring slot still counts

    def _price(self) -> None:
        """The latency model charges a step's adapter reads at the largest adapter resident."""
        if self.latency is not None:
            held = [r.slot.slot for r in self.by_name.values()] + sorted(self._retiring)
            self.latency.price_adapters(max((self.slots.slot_nbytes(s) for s in held), default=0))

    def _free_if_unheld(self, slot: int) -> None:
        if slot in self._retiring and self._holders[slot] == 0:
            self._retiring.discard(slot)
            self.slots.unload(slot)
            self._price()

    def resolve(self, request: LoRARequest | None) -> AdapterSlot | None:
        """The slot a request is served under (None: the base model). A request with a path loads
        the adapter under its name first, when that name is not held yet."""
        if request is None:
            return None
        held = self.by_name.get(request.lora_name)
        if held is None and request.lora_path is not None:
            held = self.add(request.lora_name, request.lora_path)
        if held is None:
            raise UnknownAdapterError(self._unknown(request.lora_name))
        return held.slot

    def _unknown(self, name: str) -> str:
        loaded = ", ".join(sorted(self.by_name)) or "none"
        return f"unknown adapter {name!r}: the engine holds {loaded} (max_loras {self.capacity})"

    def hold(self, adapter: AdapterSlot | None) -> None:
        """A sequence under ``adapter`` enters the engine."""
        if adapter is not None:
            self._holders[adapter.slot] += 1

    def release(self, adapter: AdapterSlot | None) -> None:
        """A sequence under ``adapter`` has ended."""
        if adapter is not None:
            self._holders[adapter.slot] -= 1
            self._free_if_unheld(adapter.slot)

    def names(self) -> list[str]:
        return sorted(self.by_name)

    def stats(self) -> tuple[AdapterStats, ...]:
        """Each adapter served, by name."""
        return tuple(AdapterStats(name, r.slot.slot, r.rank, r.nbytes, r.slot.content_hash, str(r.path),
                                  self._holders[r.slot.slot]) for name, r in sorted(self.by_name.items()))

    @property
    def runtime_nbytes(self) -> int:
        """Bytes the runtime holds for every resident adapter, in its own layout."""
        return self.slots.nbytes if self.slots is not None else 0
