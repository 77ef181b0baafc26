"""`QuantizedWeight`: a weight matrix [N, K] stored in quantized blocks on the CPU or a GPU, with
the operations a model needs from it -- the linear layer, an embedding lookup, dequantization.

The rows may come in groups of different formats (a GGUF file can store q and k in Q4_K and v
in Q6_K; pyengine fuses them into one qkv matrix all the same): each group is a uint8 tensor
[rows, row_bytes] of llama.cpp blocks, or of their interleaved layout (`interleaved()`: 8 rows
side by side, what the CPU kernels compute fastest from). No fp32 or bf16 copy of the weights is
kept.
"""

from __future__ import annotations

from typing import Iterator

import torch

import pyengine.core._core as _core
from pyengine.quant.formats import INTERLEAVED_LAYOUTS, QuantFormat, quant_format

__all__ = ["QuantizedWeight"]

# On a GPU, a linear layer of at most this many rows of x runs the weight-only GEMV kernel (the
# exact weights); more rows dequantize the weights chunk by chunk into x's dtype and take torch's
# GEMM. bench/quant_linear_cuda.py on an H200: at 1 row the kernel is as fast or faster on 3 of
# the 5 Qwen3-0.6B shapes, at 8 rows the GEMM 1.3-3x faster.
CUDA_GEMV_MAX_ROWS = 2
# the scratch of that path: at most this many weights at a time (32 MiB in bf16)
CUDA_DEQUANT_CHUNK_ELEMS = 1 << 24
# pyengine's DType codes (pyengine/kernels.h) of the activation dtypes the GPU kernels take
_CUDA_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _check_float(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.float32:
        raise ValueError(f"{name}: dtype must be torch.float32, got {t.dtype}")
    if not t.is_cpu:
        raise ValueError(f"{name}: must be a CPU tensor, got device {t.device}")


class QuantizedWeight:
    """Quantized [N, K] weights: `parts` are (format, uint8 tensor [rows, row_bytes]) groups of
    consecutive rows."""

    def __init__(self, parts: list[tuple[QuantFormat, torch.Tensor]], k: int) -> None:
        if not parts:
            raise ValueError("a QuantizedWeight needs at least one row group")
        checked = []
        device = parts[0][1].device
        for fmt, data in parts:
            fmt = quant_format(fmt)
            rb = fmt.row_bytes(k)
            if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != rb or data.device != device:
                raise ValueError(f"{fmt.name} rows of {k} weights: expected a uint8 tensor [rows, {rb}] on {device}, "
                                 f"got {data.dtype} {tuple(data.shape)} on {data.device}")
            if fmt.interleaved and device.type != "cpu":
                raise ValueError(f"{fmt.name} is a CPU layout; on {device} the weights keep llama.cpp's")
            if data.shape[0] % fmt.group_rows:
                raise ValueError(f"{fmt.name} holds groups of {fmt.group_rows} rows, got {data.shape[0]} rows")
            checked.append((fmt, data.contiguous()))
        self.parts = checked
        self.k = k
        self.n = sum(d.shape[0] for _, d in checked)

    # ---- construction ----

    @classmethod
    def quantize(cls, w: torch.Tensor, fmt: str | QuantFormat) -> "QuantizedWeight":
        """Quantizes float weights [N, K] (round-to-nearest, llama.cpp's reference quantizers)."""
        fmt = quant_format(fmt)
        if w.dim() != 2:
            raise ValueError(f"weight: expected 2 dims [N, K], got {tuple(w.shape)}")
        n, k = w.shape
        rb = fmt.row_bytes(k)
        src = w.detach().to("cpu", torch.float32).contiguous()
        data = torch.empty((n, rb), dtype=torch.uint8)
        _core._quantize_rows(fmt.type_id, src.data_ptr(), data.data_ptr(), n, k, torch.get_num_threads())
        return cls([(fmt, data)], k)

    @classmethod
    def from_blocks(cls, fmt: str | int | QuantFormat, data: torch.Tensor, shape: tuple[int, int]) -> "QuantizedWeight":
        """Wraps raw blocks (any uint8 tensor of N * row_bytes bytes, e.g. read from a GGUF file)
        as weights of `shape` [N, K]."""
        fmt = quant_format(fmt)
        n, k = shape
        rb = fmt.row_bytes(k)
        if data.dtype != torch.uint8 or data.numel() != n * rb:
            raise ValueError(f"{fmt.name} weights of shape {tuple(shape)}: expected {n * rb} uint8 bytes, "
                             f"got {data.numel()} of {data.dtype}")
        return cls([(fmt, data.reshape(n, rb))], k)

    @staticmethod
    def cat(weights: list["QuantizedWeight"]) -> "QuantizedWeight":
        """The rows of `weights` one after another (all of the same K); adjacent groups of one
        format are joined into one tensor."""
        k = weights[0].k
        if any(w.k != k for w in weights):
            raise ValueError(f"cannot stack weights with rows of {[w.k for w in weights]} weights")
        groups: list[tuple[QuantFormat, list[torch.Tensor]]] = []
        for w in weights:
            for fmt, data in w.parts:
                if groups and groups[-1][0] == fmt:
                    groups[-1][1].append(data)
                else:
                    groups.append((fmt, [data]))
        return QuantizedWeight([(f, d[0] if len(d) == 1 else torch.cat(d)) for f, d in groups], k)

    def interleaved(self) -> "QuantizedWeight":
        """The same weights with each row group whose format has an interleaved layout (every
        format has one) and whose rows are a multiple of 8 in that layout; the values, and the
        results of every operation but for the order of the fp32 sums, are the same. Returns `self` when no
        group changes (and for weights on a GPU, which reads llama.cpp's layouts)."""
        if self.device.type != "cpu":
            return self
        parts = []
        for fmt, data in self.parts:
            layout = INTERLEAVED_LAYOUTS.get(fmt.name)
            if layout is None or data.shape[0] % layout.group_rows:
                parts.append((fmt, data))
                continue
            out = torch.empty((data.shape[0], layout.row_bytes(self.k)), dtype=torch.uint8)
            _core._interleave_rows(fmt.type_id, data.data_ptr(), out.data_ptr(), data.shape[0], self.k)
            parts.append((layout, out))
        if all(p[1] is d for p, (_, d) in zip(parts, self.parts)):
            return self
        return QuantizedWeight(parts, self.k)

    def plain(self) -> "QuantizedWeight":
        """The same weights with every row group in its format's own (llama.cpp's) layout: what a
        GGUF file stores. Returns `self` when no group is interleaved."""
        if not any(fmt.interleaved for fmt, _ in self.parts):
            return self
        parts = []
        for fmt, data in self.parts:
            if fmt.interleaved:
                plain = quant_format(fmt.plain)
                out = torch.empty((data.shape[0], plain.row_bytes(self.k)), dtype=torch.uint8)
                _core._deinterleave_rows(fmt.type_id, data.data_ptr(), out.data_ptr(), data.shape[0], self.k)
                parts.append((plain, out))
            else:
                parts.append((fmt, data))
        return QuantizedWeight(parts, self.k)

    # ---- what a model reads ----

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def device(self) -> torch.device:
        return self.parts[0][1].device

    @property
    def nbytes(self) -> int:
        return sum(d.numel() for _, d in self.parts)

    @property
    def formats(self) -> list[str]:
        """The formats of the row groups, in row order (an interleaved group: the format it holds)."""
        return [f.plain or f.name for f, _ in self.parts]

    @property
    def layouts(self) -> list[str]:
        """The layouts of the row groups, in row order ("q4_0x8" for interleaved Q4_0, ...)."""
        return [f.name for f, _ in self.parts]

    def data_ptr(self) -> int:
        """The address of the first group's blocks (what identifies the storage)."""
        return self.parts[0][1].data_ptr()

    def to(self, device: torch.device | str) -> "QuantizedWeight":
        """The weights on `device`: the CPU, or a CUDA device (in llama.cpp's layout, which the
        GPU's linear kernel reads; `linear` is the operation that runs there)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device == self.device:
            return self
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"quantized weights run on the CPU or a CUDA device, not on {device}")
        src = self.plain() if device.type == "cuda" else self
        return QuantizedWeight([(f, d.to(device)) for f, d in src.parts], self.k)

    def contiguous(self) -> "QuantizedWeight":
        return self

    def _row_groups(self) -> Iterator[tuple[QuantFormat, torch.Tensor, int, int]]:
        """(format, blocks, first row, rows) of each row group, in row order."""
        row = 0
        for fmt, data in self.parts:
            yield fmt, data, row, data.shape[0]
            row += data.shape[0]

    def dequantize(self) -> torch.Tensor:
        """The fp32 values [N, K] (on the weights' device, computed there)."""
        if self.device.type == "cuda":
            out = torch.empty((self.n, self.k), dtype=torch.float32, device=self.device)
            self._dequantize_cuda(out, 0, self.n)
            return out
        out = torch.empty((self.n, self.k), dtype=torch.float32)
        for fmt, data, row, rows in self._row_groups():
            _core._dequantize_rows(fmt.type_id, data.data_ptr(), out[row:].data_ptr(), rows, self.k)
        return out

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The fp32 rows `ids` (any shape of int ids): an embedding lookup. ValueError naming an id
        out of range."""
        if self.device.type == "cuda":
            return self._embedding_cuda(ids)
        # int32 ids (a decode step's, as the engine holds them) go to the C++ gather as they are: the
        # int64 copy and reshapes cost tens of us there, with the caches cold from the weights' stream
        as_int32 = len(self.parts) == 1 and ids.dtype == torch.int32 and ids.is_contiguous()
        flat = ids if as_int32 else ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty((flat.numel(), self.k), dtype=torch.float32)
        if len(self.parts) == 1:
            fmt, data = self.parts[0]
            gather = _core._dequantize_gather_i32 if as_int32 else _core._dequantize_gather
            gather(fmt.type_id, data.data_ptr(), data.shape[0], self.k, flat.data_ptr(), flat.numel(),
                   out.data_ptr())
        else:
            bad = ((flat < 0) | (flat >= self.n)).nonzero().flatten()
            if bad.numel():
                i = int(bad[0])
                raise ValueError(f"ids[{i}]: {int(flat[i])} is out of range [0, {self.n})")
            for fmt, data, row, rows in self._row_groups():
                sel = ((flat >= row) & (flat < row + rows)).nonzero().flatten()
                if sel.numel():
                    local = (flat[sel] - row).contiguous()
                    part = torch.empty((sel.numel(), self.k), dtype=torch.float32)
                    _core._dequantize_gather(fmt.type_id, data.data_ptr(), rows, self.k, local.data_ptr(),
                                             local.numel(), part.data_ptr())
                    out[sel] = part
        return out if ids.dim() == 1 else out.reshape(*ids.shape, self.k)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """``x[M, K] @ W.T (+ bias)``. On the CPU in fp32 (x is quantized to 8 bits per block on
        the fly; from 16 rows of x on, where cpu_info().amx, interleaved layouts multiply on AMX
        with x and the weights rounded to bf16); on a GPU in x's dtype (float32, bfloat16 or
        float16) with fp32 sums: up to CUDA_GEMV_MAX_ROWS rows the weights dequantized in
        registers, beyond that dequantized into x's dtype (rounded to bf16 / fp16 with 16-bit x,
        as llama.cpp and vLLM do for their GEMMs) and multiplied by torch's GEMM."""
        if x.dim() != 2 or x.shape[1] != self.k:
            raise ValueError(f"x: expected shape [M, {self.k}], got {tuple(x.shape)}")
        if self.device.type == "cuda":
            return self._linear_cuda(x, bias, out)
        if x.dtype != torch.float32:
            x = x.float()
        _check_float(x, "x")
        if x.stride(1) != 1:
            x = x.contiguous()
        m = x.shape[0]
        if out is None:
            out = torch.empty((m, self.n), dtype=torch.float32)
        else:
            _check_float(out, "out")
            if tuple(out.shape) != (m, self.n) or out.stride(1) != 1:
                raise ValueError(f"out: expected a row-major [{m}, {self.n}] tensor, got {tuple(out.shape)}")
        if m == 0:
            return out
        bias = self._bias_like(bias, x)
        threads = torch.get_num_threads()
        for fmt, data, row, rows in self._row_groups():
            b = 0 if bias is None else bias[row:].data_ptr()
            _core._linear_quant(out[:, row:].data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), m,
                                data.data_ptr(), fmt.type_id, rows, self.k, b, threads)
        return out

    def _bias_like(self, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
        """`bias` as a contiguous [N] tensor of x's dtype on x's device; ValueError for another shape."""
        if bias is None:
            return None
        bias = bias.to(device=x.device, dtype=x.dtype).contiguous()
        if tuple(bias.shape) != (self.n,):
            raise ValueError(f"bias: expected shape ({self.n},), got {tuple(bias.shape)}")
        return bias

    # ---- on a GPU ----

    def _cuda_call_args(self) -> tuple[int, int]:
        return self.device.index, torch.cuda.current_stream(self.device).cuda_stream

    def _embedding_cuda(self, ids: torch.Tensor) -> torch.Tensor:
        """The fp32 rows `ids` from the blocks on the GPU, without a synchronization (so also
        inside a CUDA graph): ids are not checked here, a row of an id outside [0, N) is NaN
        (the engine checks token ids when a request is added)."""
        flat = ids.reshape(-1).to(device=self.device, dtype=torch.int64).contiguous()
        out = torch.full((flat.numel(), self.k), float("nan"), dtype=torch.float32, device=self.device)
        device, stream = self._cuda_call_args()
        for fmt, data, row, rows in self._row_groups():
            _core._cuda_dequantize_rows(out.data_ptr(), out.stride(0), 0, data.data_ptr(), fmt.type_id, rows, self.k,
                                        flat.data_ptr(), row, flat.numel(), device, stream)
        return out.reshape(*ids.shape, self.k)

    def _dequantize_cuda(self, out: torch.Tensor, first: int, count: int) -> None:
        """out[0:count] = rows first..first+count-1 dequantized, in out's dtype (a row-major CUDA
        tensor of float32, bfloat16 or float16)."""
        code = _CUDA_DTYPE_CODES[out.dtype]
        device, stream = self._cuda_call_args()
        for fmt, data, row, rows in self._row_groups():
            lo, hi = max(first, row), min(first + count, row + rows)
            if lo < hi:  # the group's rows lo..hi-1 -> out rows lo-first..
                _core._cuda_dequantize_rows(out[lo - first:].data_ptr(), out.stride(0), code, data.data_ptr(),
                                            fmt.type_id, rows, self.k, 0, lo - row, hi - lo, device, stream)

    def _linear_cuda_dequantized(self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        """The linear layer of many rows: chunks of the weights dequantized into x's dtype and
        multiplied by torch's GEMM (tensor cores; fp32 sums, the bias added before the one
        rounding); the chunks bound the scratch memory to CUDA_DEQUANT_CHUNK_ELEMS elements."""
        chunk = max(1, CUDA_DEQUANT_CHUNK_ELEMS // self.k)
        scratch = torch.empty((min(chunk, self.n), self.k), dtype=x.dtype, device=x.device)
        for first in range(0, self.n, chunk):
            count = min(chunk, self.n - first)
            w = scratch[:count]
            self._dequantize_cuda(w, first, count)
            y = out[:, first: first + count]
            if bias is None:
                res = torch.mm(x, w.t(), out=y) if y.is_contiguous() else torch.mm(x, w.t())
            else:
                b = bias[first: first + count]
                res = torch.addmm(b, x, w.t(), out=y) if y.is_contiguous() else torch.addmm(b, x, w.t())
            if res is not y:
                y.copy_(res)
        return out

    def _linear_cuda(self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
        codes = _CUDA_DTYPE_CODES
        if x.device != self.device or x.dtype not in codes:
            raise ValueError(f"x: expected a float32, bfloat16 or float16 tensor on {self.device}, "
                             f"got {x.dtype} on {x.device}")
        if x.stride(1) != 1:
            x = x.contiguous()
        m = x.shape[0]
        if out is None:
            out = torch.empty((m, self.n), dtype=x.dtype, device=x.device)
        elif out.dtype != x.dtype or out.device != x.device or tuple(out.shape) != (m, self.n) or out.stride(1) != 1:
            raise ValueError(f"out: expected a row-major [{m}, {self.n}] {x.dtype} tensor on {x.device}")
        if m == 0:
            return out
        bias = self._bias_like(bias, x)
        if m > CUDA_GEMV_MAX_ROWS:
            return self._linear_cuda_dequantized(x.contiguous(), bias, out)
        stream = torch.cuda.current_stream(x.device).cuda_stream
        for fmt, data, row, rows in self._row_groups():
            b = 0 if bias is None else bias[row:].data_ptr()
            _core._cuda_linear_quant(out[:, row:].data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), codes[x.dtype],
                                     m, data.data_ptr(), fmt.type_id, rows, self.k, b, x.device.index, stream)
        return out

    def __repr__(self) -> str:
        return f"QuantizedWeight(shape={self.shape}, layouts={self.layouts}, bytes={self.nbytes})"
