"""The quantized weight formats pyengine reads and computes with: llama.cpp's (GGUF's) block
layouts, byte for byte (``csrc/include/pyengine/cpu_quant.h`` describes each), and the
interleaved layouts the CPU kernels compute fastest from (8 rows side by side; made at load
time, never written to files)."""

from __future__ import annotations

from dataclasses import dataclass

import pyengine.core._core as _core

__all__ = ["QuantFormat", "QUANT_FORMATS", "INTERLEAVED_LAYOUTS", "quant_format"]


@dataclass(frozen=True)
class QuantFormat:
    """One block format: its name, GGML type id, weights per block and bytes per block (an
    interleaved layout: per row, and `plain` names the format it holds)."""

    name: str
    type_id: int
    block_elems: int
    block_bytes: int
    plain: str | None = None

    @property
    def interleaved(self) -> bool:
        return self.plain is not None

    @property
    def group_rows(self) -> int:
        """Rows stored together: 8 for an interleaved layout, else 1."""
        return 8 if self.interleaved else 1

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of `k` weights; ValueError unless `k` is a multiple of the block."""
        if not isinstance(k, int) or k < 1 or k % self.block_elems:
            raise ValueError(f"{self.name} rows must hold a positive multiple of {self.block_elems} weights, "
                             f"got {k!r}")
        return k // self.block_elems * self.block_bytes

    def fits(self, k: int) -> bool:
        """Whether rows of `k` weights can be stored in this format."""
        return k > 0 and k % self.block_elems == 0

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_elems


# GGML type ids of the formats the C++ kernels implement.
# q8_0, q5_0, q5_1, q4_0, q4_k, q5_k, q6_k, q4_z (pyengine's: AWQ / GPTQ)
_TYPE_IDS = (8, 6, 7, 2, 12, 13, 14, 100)

QUANT_FORMATS: dict[str, QuantFormat] = {}
for _id in _TYPE_IDS:
    _name, _elems, _bytes = _core._quant_format(_id)
    QUANT_FORMATS[_name] = QuantFormat(_name, _id, _elems, _bytes)

# The interleaved layout of each format that has one, by the format's name ("q4_0" -> "q4_0x8").
INTERLEAVED_LAYOUTS: dict[str, QuantFormat] = {}
for _fmt in QUANT_FORMATS.values():
    _id = _core._interleaved_type(_fmt.type_id)
    if _id != _fmt.type_id:
        _name, _elems, _bytes = _core._quant_format(_id)
        INTERLEAVED_LAYOUTS[_fmt.name] = QuantFormat(_name, _id, _elems, _bytes, plain=_fmt.name)
_BY_ID = {f.type_id: f for f in [*QUANT_FORMATS.values(), *INTERLEAVED_LAYOUTS.values()]}


def quant_format(key: str | int | QuantFormat) -> QuantFormat:
    """The format named `key` ("q8_0", "q5_0", "q5_1", "q4_0", "q4_k", "q5_k", "q6_k", "q4_z"; any
    case) or with type id `key` (an interleaved layout's too). ValueError naming the value and the
    supported formats otherwise."""
    if isinstance(key, QuantFormat):
        return key
    if isinstance(key, str) and key.lower() in QUANT_FORMATS:
        return QUANT_FORMATS[key.lower()]
    if isinstance(key, int) and not isinstance(key, bool) and key in _BY_ID:
        return _BY_ID[key]
    raise ValueError(f"unsupported quantization format {key!r}; supported: {', '.join(QUANT_FORMATS)}")
