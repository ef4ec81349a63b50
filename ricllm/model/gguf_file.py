"""A GGUF file's header in one pass: its metadata as plain Python values, its tensors as read-only
views of the memory-mapped file.

gguf-py's ``GGUFReader`` keeps every element of a metadata array as a numpy view of its own, and
building them for Gemma 3's 262,144-token vocabulary takes it about 17 s on two cores (2 s for
SmolLM2's 49,152). Here a string array is decoded straight from an ``mmap`` and a numeric array is
one ``numpy.frombuffer``. Tensor types, block sizes and byte shapes are gguf-py's own
(``gguf.constants``, ``gguf.quants``), so a tensor's ``data`` is the array ``GGUFReader`` gives and
``gguf.quants.dequantize`` reads it alike.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
# GGUF value types by number: little-endian scalars, as struct and numpy spell them
SCALAR_TYPES = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                12: "<d"}
SCALAR_DTYPES = {kind: np.dtype(layout) for kind, layout in SCALAR_TYPES.items()}
# tensor types whose ``data`` holds elements (the rest: blocks, as bytes)
ELEMENT_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: ``shape`` in GGUF's order (columns first), ``data`` as ``GGUFReader`` has it."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class GGUFFile:
    """A GGUF file's ``fields`` (key → int, float, bool, str or list) and ``tensors``, in file order.
    Raises ``ValueError`` naming what is wrong with a file that is not a readable GGUF."""

    def __init__(self, path: str | Path) -> None:
        cursor = _Cursor(path)
        tensor_count, kv_count = cursor.preamble()
        self.fields: dict[str, Any] = dict(cursor.entry() for _ in range(kv_count))
        self.tensors: list[GGUFTensor] = cursor.tensors(tensor_count, self.fields)


def read_gguf_value(path: str | Path, key: str) -> Any:
    """One metadata value (None where the file has no ``key``), read up to its entry only."""
    cursor = _Cursor(path)
    for _ in range(cursor.preamble()[1]):
        name, value = cursor.entry()
        if name == key:
            return value
    return None


class _Cursor:
    """A read position in a memory-mapped GGUF file."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as handle:
            self.map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self.at = 0

    def preamble(self) -> tuple[int, int]:
        """(tensor count, metadata entry count)."""
        if self.map[:4] != MAGIC:
            raise ValueError("not a GGUF file (no GGUF magic)")
        self.at = 4
        version = self.unpack("<I")[0]
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} (this reader reads versions {VERSIONS}, little-endian)")
        return self.unpack("<QQ")

    def unpack(self, layout: str) -> tuple:
        try:
            values = struct.unpack_from(layout, self.map, self.at)
        except struct.error:
            raise ValueError(f"the file ends inside its header (at byte {self.at})") from None
        self.at += struct.calcsize(layout)
        return values

    def string(self) -> str:
        size = self.unpack("<Q")[0]
        if self.at + size > len(self.map):
            raise ValueError(f"the file ends inside its header (at byte {self.at})")
        text = self.map[self.at:self.at + size].decode("utf-8")
        self.at += size
        return text

    def entry(self) -> tuple[str, Any]:
        key = self.string()
        return key, self.value(self.unpack("<I")[0])

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.unpack("<IQ")
            if item in SCALAR_TYPES:
                items = np.frombuffer(self.map, SCALAR_DTYPES[item], count, self.at)
                self.at += items.nbytes
                return items.tolist()
            return [self.value(item) for _ in range(count)]
        if kind not in SCALAR_TYPES:
            raise ValueError(f"unknown GGUF value type {kind} at byte {self.at}")
        return self.unpack(SCALAR_TYPES[kind])[0]

    def tensors(self, count: int, fields: dict[str, Any]) -> list[GGUFTensor]:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        infos = []
        for _ in range(count):
            name, dims = self.string(), self.unpack("<I")[0]
            infos.append((name, self.unpack(f"<{dims}Q"), *self.unpack("<IQ")))
        alignment = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment} is not a power of two")
        start = -(-self.at // alignment) * alignment
        tensors, names = [], set()
        for name, shape, kind, offset in infos:
            if name in names:
                raise ValueError(f"tensor {name} appears twice")
            names.add(name)
            tensor_type = GGMLQuantizationType(kind)
            elements = int(np.prod(shape, dtype=np.int64))
            rows_first = tuple(reversed(shape))
            if tensor_type.name in ELEMENT_TYPES:
                data = np.frombuffer(self.map, ELEMENT_TYPES[tensor_type.name], elements, start + offset)
            else:
                block, block_bytes = GGML_QUANT_SIZES[tensor_type]
                data = np.frombuffer(self.map, np.uint8, elements * block_bytes // block, start + offset)
                rows_first = quant_shape_to_byte_shape(rows_first, tensor_type)
            tensors.append(GGUFTensor(name, tensor_type, tuple(shape), data.reshape(rows_first)))
        return tensors
