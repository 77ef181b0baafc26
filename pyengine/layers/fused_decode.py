"""Binds a bf16 or fp32 model and a KV pool to the C++ kernel that runs all decoder layers of a
small batch in one call (``csrc/include/pyengine/cpu_decode.h``).

Used where the model's small-batch linears are pyengine's kernels (bf16 on CPUs without native
bf16 matmul; fp32 unless ``exact_fp32``) for batches of at most ``max_rows`` rows: the
same kernels, in the same order, as the model's Python forward with fused elementwise kernels,
without the few hundred Python calls per step around them.
"""

from __future__ import annotations

import operator

import torch

import pyengine.core._core as _core
from pyengine.layers.cpu_features import FAST_FP32_MAX_ROWS
from pyengine.layers._kernel_checks import check_softcap, dtype_code
from pyengine.quant import QuantizedWeight

__all__ = ["CpuDecodeLayers"]

_QUANT_LINEARS = ("qkv", "o", "gate_up", "down")
_QUANT_DESC_WORDS = 1 + 3 * _core.MAX_QUANT_LINEAR_PARTS
_ORDER = ("input_norm", "post_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "gate_up", "down")


def layer_settings(model) -> tuple[list[int], list[bool]]:
    """Each layer's attention window (0: full attention) and whether it applies RoPE:
    ``model.layer_sliding_windows`` / ``model.layer_uses_rope`` where the model has them (Gemma 2/3
    alternate sliding and global layers, Qwen2 windows only some, SmolLM3 skips RoPE on some),
    else ``model.sliding_window`` and RoPE on every layer."""
    n = model.config.num_layers
    windows = getattr(model, "layer_sliding_windows", None)
    windows = [model.sliding_window] * n if windows is None else list(windows)
    uses_rope = getattr(model, "layer_uses_rope", None)
    uses_rope = [True] * n if uses_rope is None else list(uses_rope)
    if len(windows) != n or len(uses_rope) != n:
        raise ValueError(f"model.layer_sliding_windows / layer_uses_rope: {len(windows)} / {len(uses_rope)} "
                         f"entries for {n} layers")
    checked = []
    for i, w in enumerate(windows):
        try:
            value = operator.index(w)  # ints and integer scalars (numpy, torch), not floats
        except TypeError:
            value = None
        if value is None or isinstance(w, bool) or not 0 <= value < 2 ** 31:
            raise ValueError(f"model.layer_sliding_windows: entry {i} is {w!r}, expected an int in [0, 2^31) "
                             "(0 = full attention)")
        checked.append(value)
    return checked, [bool(r) for r in uses_rope]


class CpuDecodeLayers:
    """One model's layers and one KV pool's caches, as the C++ kernel takes them."""

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], max_blocks_per_seq: int) -> None:
        c = model.config
        k0 = kv_caches[0][0]
        rows = []
        self.quantized = model.quantized
        if self.quantized:  # the linears' QuantLinearDesc records, addressed by the layer pointers
            self.quant_descs = torch.zeros((c.num_layers, len(_QUANT_LINEARS), _QUANT_DESC_WORDS), dtype=torch.int64)
        windows, uses_rope = layer_settings(model)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(model.layers, kv_caches)):
            ptrs = [0 if layer[name] is None else layer[name].data_ptr() for name in _ORDER]
            if self.quantized:
                for j, name in enumerate(_QUANT_LINEARS):
                    ptrs[_ORDER.index(name)] = self._describe(layer[name], self.quant_descs[i, j])
            # then the layer's plain integers (not addresses): window, RoPE flag
            rows.append(ptrs + [k_cache.data_ptr(), v_cache.data_ptr(), windows[i], int(uses_rope[i])])
        assert len(rows[0]) == _core.DECODE_LAYER_POINTERS
        assert len(rows[0]) - 2 == _core.DECODE_LAYER_SLIDING_WINDOW == _core.DECODE_LAYER_USE_ROPE - 1
        self.layer_ptrs = torch.tensor(rows, dtype=torch.int64)
        # The addresses above stay valid while the runner that owns this binding lives (it holds
        # the model and the KV pool).
        self.shape = _core.CoreDecodeShape(
            num_layers=c.num_layers, hidden=c.hidden_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim, intermediate=c.intermediate_size, rms_norm_eps=c.rms_norm_eps,
            scale=model.scale, max_position=model.cos.shape[0],
            tokens_per_block=k0.shape[2], max_blocks_per_seq=max_blocks_per_seq, num_blocks=k0.shape[0],
            cache_dtype=dtype_code(k0, "k_cache"), dtype=dtype_code(model.norm, "weights"),
            quantized=self.quantized,
            # Gemma 2's attn_logit_softcapping (None or absent: off)
            attn_softcap=check_softcap(getattr(model, "attn_softcap", 0.0) or 0.0))
        # the row counts at which the model's linears are pyengine's kernels (see layers.linear.dense;
        # quantized weights: at any count, up to what one call takes; fp32: see max_rows)
        if self.quantized:
            self._max_rows = _core.LINEAR_MAX_ROWS
        elif model.dtype == torch.bfloat16:
            self._max_rows = model.bf16_kernel_max_rows
        else:
            self._max_rows = None
        self.scratch = torch.empty(self.shape.scratch_elements(self._max_rows or _core.LINEAR_MAX_ROWS),
                                   dtype=model.dtype)
        self.cos, self.sin = model.cos, model.sin
        self._bind_head(model)

    @property
    def max_rows(self) -> int:
        """The most rows a call takes: where the model's linears are pyengine's kernels. fp32:
        LINEAR_MAX_ROWS where the GEMM is routed (the active level, read each time: `dense` takes
        gemm_f32 from GEMM_MIN_ROWS rows on, as this path's linears do), else FAST_FP32_MAX_ROWS
        (past it `dense` takes torch's matmul)."""
        if self._max_rows is not None:
            return self._max_rows
        return _core.LINEAR_MAX_ROWS if _core._gemm_routed() else FAST_FP32_MAX_ROWS

    def _bind_head(self, model) -> None:
        """The final norm and output projection for `logits` (decode_head): a head of the model's
        dtype, or quantized with at most MAX_QUANT_LINEAR_PARTS row groups; else `has_head` is
        False and the model computes its logits itself."""
        head = model.lm_head
        self.norm = model.norm
        self.head_quantized = isinstance(head, QuantizedWeight)
        self.head_desc = None
        self.has_head = False
        if self.head_quantized:
            if head.device.type != "cpu" or len(head.parts) > _core.MAX_QUANT_LINEAR_PARTS:
                return
            self.head_desc = torch.zeros(_QUANT_DESC_WORDS, dtype=torch.int64)
            self.head_ptr = self._describe(head, self.head_desc)
            self.vocab = head.n
        else:
            if head.dtype != model.dtype or head.dim() != 2 or not head.is_contiguous() or not head.is_cpu:
                return
            # the model's own linear takes pyengine's kernels for it (not with exact_fp32: torch's)
            if not (model.fast_fp32 if model.dtype == torch.float32 else model.bf16_kernel_max_rows):
                return
            self.head_ptr = head.data_ptr()
            self.vocab = head.shape[0]
        self.head_weight = head  # keeps the address valid
        self.has_head = self.norm.dtype == model.dtype and self.norm.is_contiguous()
        self.head_scratch = torch.empty(0, dtype=model.dtype)

    @staticmethod
    def _describe(w: QuantizedWeight, desc: torch.Tensor) -> int:
        """Fills `desc` (int64 words) as a QuantLinearDesc of `w`; returns its address."""
        if not isinstance(w, QuantizedWeight):
            raise ValueError("the one-call decode path takes a quantized model's linear layers all quantized")
        if len(w.parts) > _core.MAX_QUANT_LINEAR_PARTS:
            raise ValueError(f"a linear layer of {len(w.parts)} row groups of different formats "
                             f"(at most {_core.MAX_QUANT_LINEAR_PARTS})")
        desc[0] = len(w.parts)
        for i, (fmt, data) in enumerate(w.parts):
            desc[1 + 3 * i: 4 + 3 * i] = torch.tensor([fmt.type_id, data.shape[0], data.data_ptr()])
        return desc.data_ptr()

    def run(self, h: torch.Tensor, positions: torch.Tensor, meta) -> None:
        """All layers on h [T, hidden] of the model's dtype (contiguous, updated in place)."""
        num_seqs = meta.seq_lens.shape[0]
        self.shape.run(h.data_ptr(), h.shape[0], self.layer_ptrs.data_ptr(), self.cos.data_ptr(),
                       self.sin.data_ptr(), positions.data_ptr(), meta.slot_mapping.data_ptr(),
                       meta.query_start_loc.data_ptr(), meta.seq_lens.data_ptr(), meta.block_tables.data_ptr(),
                       num_seqs, self.scratch.data_ptr(), self.scratch.numel(), torch.get_num_threads())

    def logits(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """fp32 logits [len(rows), vocab] of `rows` of h after `run` (has_head; at most max_rows
        rows): the final RMSNorm with the fused kernel and the output projection with the kernel
        the model's linear takes for that many rows -- the model's _logits, bit for bit."""
        if rows.dtype != torch.int32 or not rows.is_contiguous():
            rows = rows.to(torch.int32).contiguous()
        n = rows.shape[0]
        needed = self.shape.head_scratch_elements(self.vocab, self.head_quantized, n)
        if self.head_scratch.numel() < needed:  # grows to the most rows seen
            self.head_scratch = torch.empty(needed, dtype=self.head_scratch.dtype)
        out = torch.empty((n, self.vocab), dtype=torch.float32)
        self.shape.head(out.data_ptr(), h.data_ptr(), h.shape[0], rows.data_ptr(), n, self.norm.data_ptr(),
                        self.head_ptr, self.vocab, self.head_quantized, self.head_scratch.data_ptr(),
                        self.head_scratch.numel(), torch.get_num_threads())
        return out
