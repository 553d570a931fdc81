"""FastGGUFReader: gguf-py's `GGUFReader`, with the header's metadata read in one pass.

References: gguf-py `gguf_reader.py` (the reader and its `ReaderField` / `ReaderTensor`), the
GGUF format (ggml `docs/gguf.md`: little-endian, each string a uint64 length then its bytes).

NOTE: gguf-py builds numpy views for every element of an array field: a 49k-token vocabulary
is ~250k tiny arrays (a string's length and its bytes, each token's score and type), ~0.7 s of
a warm start, more than mapping the model's repacked weights. Here an array of scalars is one
numpy view and an array of strings is walked once with `struct`, its strings decoded in the same
loop (~30 ms per 50k strings). The fields answer `contents()` and carry `types` as gguf-py's
do; only their `parts` / `data` (byte-level views for editing a file in place) differ. Tensor
infos and tensor data (views of the mapped file) are gguf-py's own.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from typing import Any, Literal

import gguf
import numpy as np

_VT = gguf.GGUFValueType
_U32 = struct.Struct("<I").unpack_from
_U64 = struct.Struct("<Q").unpack_from


class DecodedArrayField(gguf.ReaderField):
    """An array field whose values are decoded already: `parts[0]` holds them all (a numeric
    array, or an object array of str)."""

    __slots__ = ()

    def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
        value = self.parts[0][index_or_slice]
        return value.tolist() if isinstance(value, np.ndarray | np.generic) else value


class FastGGUFReader(gguf.GGUFReader):
    """gguf-py's reader, reading its header's metadata in one pass (module docstring)."""

    def _get(self, offset: int, dtype: Any, count: int = 1,
             override_order: Literal["I", "S", "<"] | None = None) -> np.ndarray:
        # NOTE: slices of a plain ndarray view of the map, not of the `np.memmap` itself: each
        # memmap slice runs its Python `__getitem__` and `__array_finalize__`.
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        dt = np.dtype(dtype)
        arr = plain[offset:offset + dt.itemsize * count].view(dtype=dt)[:count]
        return arr.view(arr.dtype.newbyteorder(
            self.byte_order if override_order is None else override_order))

    def _file_bytes(self) -> memoryview:
        """The whole mapped file, for `struct` and `hashlib`."""
        return self._get(0, np.uint8, len(self.data)).data

    def fingerprint(self) -> str:
        """A cheap check of the file's content, for caches of what is built from it
        (repack_cache.py): a hash of its header (metadata, token tables, tensor infos) and of
        the first and last 4 KiB of every tensor's data. Two files that differ only inside
        tensors, away from those samples, share it: size and mtime tell those apart."""
        plain = self._file_bytes()
        digest = hashlib.sha256(plain[:self.data_offset])
        for tensor in self.tensors:
            start, stop = tensor.data_offset, tensor.data_offset + tensor.n_bytes
            digest.update(plain[start:min(stop, start + 4096)])
            digest.update(plain[max(start, stop - 4096):stop])
        return digest.hexdigest()[:16]

    def _build_fields(self, offs: int, count: int) -> int:
        if self.byte_order != "I" or sys.byteorder != "little":
            return super()._build_fields(offs, count)  # a byte-swapped file: gguf-py's way
        buf = self._file_bytes()
        for _ in range(count):
            start = offs
            (key_len,) = _U64(buf, offs)
            name = str(buf[offs + 8:offs + 8 + key_len], "utf-8")
            offs += 8 + key_len
            (raw_type,) = _U32(buf, offs)
            offs += 4
            field: gguf.ReaderField | None = None
            if raw_type == _VT.ARRAY:
                field, end = self._array_field(buf, start, name, offs)
            if field is None:  # scalars, strings, arrays of arrays: few and small
                size, parts, data, types = self._get_field_parts(offs, raw_type)
                end = offs + size
                field = gguf.ReaderField(start, name, parts, data, types)
            self._push_field(field, skip_sum=True)
            offs = end
        return offs

    def _array_field(self, buf: memoryview, start: int, name: str, offs: int
                     ) -> tuple[DecodedArrayField | None, int]:
        """(the field, offset after it) of the array at `offs`; None for nested arrays."""
        (item_type,) = _U32(buf, offs)
        (length,) = _U64(buf, offs + 4)
        offs += 12
        types = [_VT.ARRAY, _VT(item_type)]
        if item_type == _VT.STRING:
            strings = []
            for _ in range(length):
                (size,) = _U64(buf, offs)
                strings.append(str(buf[offs + 8:offs + 8 + size], "utf-8"))
                offs += 8 + size
            values = np.empty(length, dtype=object)
            values[:] = strings
            return DecodedArrayField(start, name, [values], [0], types), offs
        scalar = self.gguf_scalar_to_np.get(_VT(item_type))
        if scalar is None:
            return None, offs
        array = self._get(offs, scalar, length)
        return DecodedArrayField(start, name, [array], [0], types), offs + array.nbytes
