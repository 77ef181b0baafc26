"""A GGUF file's header: its metadata and where each tensor lies, read with the `gguf` package's
GGUFReader and copied into plain Python values, so that nothing keeps the file mapped afterwards.

A file that cannot be parsed (not GGUF, truncated inside the header or inside a tensor, a value
that is not what the format says) raises ValueError naming the file (and the tensor cut off).
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GGUFHeader", "GGUFTensorInfo", "read_header", "corrupt_file_error"]

# Arrays longer than this (the tokenizer's tokens, merges, scores) are kept as their length only:
# the model configuration needs no more, and the tokenizer reads the file itself; except the token
# types (the tokenizer needs to know the unused ones).
_MAX_ARRAY_KEPT = 256
_ALWAYS_KEPT = ("tokenizer.ggml.token_type",)


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of the file: its GGML type, its shape in torch order (GGUF lists the dims the
    other way round: ne[0], the length of a row, comes first) and its bytes' place in the file."""

    name: str
    type_id: int
    type_name: str            # "Q4_K", "F32", ...; "type <id>" for an id the gguf package does not know
    shape: tuple[int, ...]
    offset: int               # absolute, in bytes from the start of the file
    nbytes: int | None        # None where the type is unknown, or its rows hold no whole number of blocks


@dataclass
class GGUFHeader:
    """What pyengine needs from a GGUF file before reading its tensors."""

    path: Path
    file_size: int
    metadata: dict[str, Any]
    array_lengths: dict[str, int]                       # every array key -> its number of items
    tensors: dict[str, GGUFTensorInfo] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


def corrupt_file_error(path: Path, reason: str) -> ValueError:
    """The ValueError for a GGUF file that cannot be read, naming it and its size."""
    try:
        size = f", {path.stat().st_size} bytes,"
    except OSError:
        size = ""
    return ValueError(f"cannot read GGUF file {str(path)!r}: {reason} (the file{size} may be truncated or "
                      "corrupt: an interrupted download or copy?)")


def read_header(path: str | Path) -> GGUFHeader:
    """The metadata and tensor table of the GGUF file at `path`. ValueError naming the file if it
    is not a GGUF file or its header is damaged; ImportError if the gguf package is missing."""
    path = Path(path)
    reader_class = _reader_class()
    # The errors are raised outside the `except` blocks: the parser's exception (and through its
    # traceback, the memory map) must not stay reachable from the error that reports it.
    error: ValueError | None = None
    try:
        reader = reader_class(str(path), "r")
    except Exception as e:
        reason = str(e) or type(e).__name__
        if isinstance(e, ValueError) and "magic" in reason:
            reason = "not a GGUF file (it does not start with the bytes 'GGUF')"
        error = corrupt_file_error(path, reason)
    if error is not None:
        raise error
    if getattr(reader, "byte_order", "I") != "I":
        del reader
        raise ValueError(f"GGUF file {str(path)!r} is in the other byte order (big-endian): pyengine reads "
                         "little-endian GGUF files only")
    try:
        header = _copy_out(reader, path)
    except (ValueError, IndexError, UnicodeDecodeError, OverflowError) as e:
        error = corrupt_file_error(path, str(e) or type(e).__name__)
    del reader  # the memory map closes with the last reference to it
    if error is not None:
        raise error
    return header


def _copy_out(reader: Any, path: Path) -> GGUFHeader:
    import gguf

    metadata: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
            lengths[key] = int(f.parts[4][0])  # parts: key length, key, type, item type, item count, ...
            if lengths[key] <= _MAX_ARRAY_KEPT:
                metadata[key] = _value(f)
            elif key in _ALWAYS_KEPT and f.types[-1] != gguf.GGUFValueType.STRING:
                metadata[key] = f.parts[f.data[0]].tolist()  # one part holds them all (_HeaderReader)
        else:
            metadata[key] = _value(f)
    tensors: dict[str, GGUFTensorInfo] = {}
    for name, type_id, ne, rel_offset in reader.tensor_table:
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
            type_name = qtype.name
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n = math.prod(ne)
            nbytes = n // block * type_size if ne and ne[0] % block == 0 else None  # blocks run along a row
        except (ValueError, KeyError):
            type_name, nbytes = f"type {type_id}", None
        tensors[name] = GGUFTensorInfo(name=name, type_id=type_id, type_name=type_name, shape=tuple(reversed(ne)),
                                       offset=reader.data_offset + rel_offset, nbytes=nbytes)
    size = os.path.getsize(path)
    for t in tensors.values():  # (a type it does not know, the weights loader names)
        if t.nbytes is not None and t.offset + t.nbytes > size:
            raise ValueError(f"tensor {t.name!r} (bytes {t.offset} to {t.offset + t.nbytes}) runs past the end of "
                             "the file")
    return GGUFHeader(path=path, file_size=size, metadata=metadata, array_lengths=lengths, tensors=tensors)


def _value(f: Any) -> Any:
    """A metadata field as plain Python: str, int, float, bool, or a list of them."""
    import gguf

    t = gguf.GGUFValueType

    def one(part: Any, vtype: Any) -> Any:
        if vtype == t.STRING:
            return bytes(part).decode("utf-8")
        v = part.tolist()[0]
        return bool(v) if vtype == t.BOOL else v

    if f.types[0] == t.ARRAY:
        return [one(f.parts[i], f.types[-1]) for i in f.data]
    return one(f.parts[f.data[0]], f.types[0])


def _skip_strings(data: Any, pos: int, count: int) -> int:
    """The offset just past `count` GGUF strings (u64 length, then the bytes) from `pos`."""
    size = len(data)
    for _ in range(count):
        if pos + 8 > size:
            raise ValueError("a string array runs past the end of the file")
        pos += 8 + struct.unpack_from("<Q", data, pos)[0]
    if pos > size:
        raise ValueError("a string array runs past the end of the file")
    return pos


_READER_CLASS: Any = None


def _reader_class() -> Any:
    """GGUFReader with two of its steps replaced (tests/test_gguf.py checks the result against
    GGUFReader's own):

    - the tensor table is recorded without building a view of each tensor's data: pyengine
      reads tensors with plain file reads, and a tensor that runs past the end of the file is
      reported by name (GGUFReader's own views would fail on it, naming none);
    - an array of more than _MAX_ARRAY_KEPT items (a vocabulary: 150k tokens, 300k merges) is
      kept as one part (numbers) or skipped over (strings) instead of one numpy view per item,
      which takes GGUFReader ten times longer than the rest of start-up."""
    global _READER_CLASS
    if _READER_CLASS is not None:
        return _READER_CLASS
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise ImportError("reading GGUF files needs the gguf package: pip install gguf "
                          "(or pip install 'pyengine[gguf]')") from e

    from gguf import GGUFValueType

    class _HeaderReader(GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple:
            if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            count, start = int(alen[0]), orig_offs + 12
            if count <= _MAX_ARRAY_KEPT:
                return super()._get_field_parts(orig_offs, raw_type)
            itype = GGUFValueType(int(raw_itype[0]))
            if itype == GGUFValueType.STRING:
                end = _skip_strings(self.data, start, count)
                items = self.data[start:end]
            elif itype in self.gguf_scalar_to_np:
                items = self._get(start, self.gguf_scalar_to_np[itype], count)
                if len(items) != count:
                    raise ValueError(f"an array of {count} items runs past the end of the file")
                end = start + int(items.nbytes)
            else:
                raise ValueError(f"unsupported array item type {itype.name}")
            return end - orig_offs, [raw_itype, alen, items], [2], [GGUFValueType.ARRAY, itype]

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            table, seen = [], set()
            for f in fields:
                _name_len, name_data, _n_dims, dims, raw_dtype, offset_tensor = f.parts
                name = bytes(name_data).decode("utf-8")
                if name in seen:
                    raise ValueError(f"the tensor {name!r} is listed twice")
                seen.add(name)
                table.append((name, int(raw_dtype[0]), [int(d) for d in dims], int(offset_tensor[0])))
            self.tensor_table = table
            self.tensors = []

    _READER_CLASS = _HeaderReader
    return _READER_CLASS
