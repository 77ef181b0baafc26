"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flattened token batch.

The layer code mirrors Hugging Face transformers' modules operation by operation (same
dtype casts, same order of residual adds) so that fp32 outputs match it token for token.
Attention goes through the C++ paged kernels; its metadata travels in `AttentionMetadata`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pyengine.layers import attention
from pyengine.layers import elementwise as cpu_elementwise
from pyengine.layers import fused_decode as cpu_decode
from pyengine.layers.cpu_features import native_bf16_matmul
from pyengine.layers.linear import dense
from pyengine.layers.norm import add_rms_norm, rms_norm
from pyengine.layers.rotary import apply_rotary, rope_tables
from pyengine.models.config import ModelConfig
from pyengine.quant import QuantizedWeight


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [num_tokens] int32
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32
    seq_lens: torch.Tensor          # [num_seqs] int32
    block_tables: torch.Tensor      # [num_seqs, max_blocks_per_seq] int32
    # What a CUDA launch needs besides (host values, so that it reads nothing back from the
    # GPU; see pyengine/layers/attention.py); unused on the CPU.
    max_query_len: int | None = None
    max_context_len: int | None = None
    workspace: torch.Tensor | None = None
    k_scale: float = 1.0            # an fp8 cache's per-tensor scales
    v_scale: float = 1.0
    # CPU, bf16 via pyengine's linear kernel: all layers of a small batch in one C++ call
    cpu_decode: "cpu_decode.CpuDecodeLayers | None" = None


def weights_on_cpu(t: torch.Tensor | QuantizedWeight) -> bool:
    return t.device.type == "cpu"


def cat_rows(parts: list[torch.Tensor | QuantizedWeight]) -> torch.Tensor | QuantizedWeight:
    """Weight matrices stacked by rows (q, k, v into qkv; gate, up into gate_up)."""
    quantized = [isinstance(p, QuantizedWeight) for p in parts]
    if all(quantized):
        return QuantizedWeight.cat(parts)
    if any(quantized):
        raise ValueError("cannot fuse quantized and unquantized weights into one matrix: "
                         f"{['quantized' if q else 'float' for q in quantized]}")
    return torch.cat(parts)


def take_weight(weights: dict[str, Any], name: str, shape: tuple[int, ...],
                device: torch.device) -> torch.Tensor | QuantizedWeight:
    """Pops a checkpoint tensor, checking its shape, in the layout the model computes from."""
    t = weights.pop(name)
    if tuple(t.shape) != shape:
        raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape} from config.json")
    if isinstance(t, QuantizedWeight):  # the layout the CPU kernels compute fastest from
        return t.interleaved()
    return t.to(device).contiguous()


class LlamaFamilyModel:
    """Weights plus a forward over [num_tokens] flattened inputs; returns fp32 logits of the
    rows in `logits_indices`."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 max_seq_len: int, device: torch.device | str = "cpu", *, exact_fp32: bool = False):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        c = config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_size, self.kv_size = q_size, kv_size

        # not a closure: a failure's traceback keeps its frames' functions, and a closure over
        # `weights` would keep every tensor read so far alive with it
        take = functools.partial(take_weight, weights, device=self.device)

        self.embed = take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            layer = {
                "input_norm": take(p + "input_layernorm.weight", (c.hidden_size,)),
                "post_norm": take(p + "post_attention_layernorm.weight", (c.hidden_size,)),
                # q, k, v fused into one matmul; gate and up likewise.
                "qkv": cat_rows([take(p + "self_attn.q_proj.weight", (q_size, c.hidden_size)),
                                 take(p + "self_attn.k_proj.weight", (kv_size, c.hidden_size)),
                                 take(p + "self_attn.v_proj.weight", (kv_size, c.hidden_size))]),
                "o": take(p + "self_attn.o_proj.weight", (c.hidden_size, q_size)),
                "gate_up": cat_rows([take(p + "mlp.gate_proj.weight", (c.intermediate_size, c.hidden_size)),
                                     take(p + "mlp.up_proj.weight", (c.intermediate_size, c.hidden_size))]),
                "down": take(p + "mlp.down_proj.weight", (c.hidden_size, c.intermediate_size)),
                "qkv_bias": None, "q_norm": None, "k_norm": None,
            }
            if c.attention_bias:
                layer["qkv_bias"] = torch.cat([take(p + "self_attn.q_proj.bias", (q_size,)),
                                               take(p + "self_attn.k_proj.bias", (kv_size,)),
                                               take(p + "self_attn.v_proj.bias", (kv_size,))])
            if c.qk_norm:
                layer["q_norm"] = take(p + "self_attn.q_norm.weight", (c.head_dim,))
                layer["k_norm"] = take(p + "self_attn.k_norm.weight", (c.head_dim,))
            self.layers.append(layer)
        self.norm = take("model.norm.weight", (c.hidden_size,))
        if c.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = self.embed
        else:
            self.lm_head = take("lm_head.weight", (c.vocab_size, c.hidden_size))

        self.cos, self.sin = rope_tables(c, max_seq_len, dtype, self.device)
        self.scale = c.head_dim ** -0.5
        self.sliding_window = c.sliding_window or 0
        # Without bf16 instructions, torch's bf16 GEMM is emulated and slow (see layers.linear.dense).
        self.emulate_bf16 = dtype == torch.bfloat16 and weights_on_cpu(self.embed) and not native_bf16_matmul()
        # torch's fp32 GEMV streams the weights at a fraction of the memory bandwidth: small fp32
        # batches on the CPU take pyengine's linear_f32 (the same sums in another order), unless
        # exact_fp32 asks for torch's (and transformers') rounding.
        self.fast_fp32 = dtype == torch.float32 and weights_on_cpu(self.embed) and not exact_fp32
        # On the CPU, RMSNorm (+ residual add), RoPE and SiLU-mul of small batches run as one
        # C++ call each (pyengine/cpu_elementwise.py), rounding as torch's operations do.
        self.fused_elementwise = dtype in cpu_elementwise.SUPPORTED_DTYPES and weights_on_cpu(self.embed)
        # weights in llama.cpp's block formats (pyengine/quant), computed with fp32 activations
        self.quantized = any(isinstance(w, QuantizedWeight) for layer in self.layers for w in layer.values()) \
            or isinstance(self.lm_head, QuantizedWeight) or isinstance(self.embed, QuantizedWeight)
        if self.quantized and dtype != torch.float32:
            raise ValueError(f"quantized weights compute with float32 activations: dtype must be float32, got {dtype}")
        # some linear layers float in a quantized model (rows that fit no block format; a GGUF file
        # that stores them so): the one-call decode path, which takes them all quantized, is not used
        self.partly_quantized = self.quantized and not all(
            isinstance(layer[n], QuantizedWeight) for layer in self.layers for n in ("qkv", "o", "gate_up", "down"))

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, QuantizedWeight):
            return self.embed.embedding(input_ids)
        return F.embedding(input_ids, self.embed)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        return dense(x, w, b, self.emulate_bf16, self.fast_fp32)

    @staticmethod
    def weight_names(config: ModelConfig) -> tuple[list[str], tuple[str, ...]]:
        """(names to load, the subset that may be absent)."""
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
            names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
            if config.attention_bias:
                names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
            if config.qk_norm:
                names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        optional: tuple[str, ...] = ()
        if not config.tie_word_embeddings:
            names.append("lm_head.weight")
        return names, optional

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits_indices: torch.Tensor) -> torch.Tensor:
        c = self.config
        T = input_ids.shape[0]
        eps = c.rms_norm_eps
        if meta.cpu_decode is not None and 0 < T <= meta.cpu_decode.max_rows:
            h = self.embed_tokens(input_ids)
            meta.cpu_decode.run(h, positions, meta)
            h = rms_norm(h[logits_indices], self.norm, eps)
            return self.linear(h, self.lm_head).float()
        fused = self.fused_elementwise and T <= cpu_elementwise.MAX_ROWS
        # the fused kernel reads the whole tables; the torch form takes the batch's rows, [T, 1, D]
        cos, sin = (self.cos, self.sin) if fused else (self.cos[positions].unsqueeze(1),
                                                       self.sin[positions].unsqueeze(1))
        h = self.embed_tokens(input_ids)
        delta = None  # the last sublayer's output, not yet added to the residual stream h
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h, x = add_rms_norm(h, delta, layer["input_norm"], eps, fused)
            qkv = self.linear(x, layer["qkv"], layer["qkv_bias"])
            q = qkv[:, : self.q_size].view(T, c.num_heads, c.head_dim)
            k = qkv[:, self.q_size: self.q_size + self.kv_size].view(T, c.num_kv_heads, c.head_dim)
            v = qkv[:, self.q_size + self.kv_size:].view(T, c.num_kv_heads, c.head_dim)
            if layer["q_norm"] is not None:
                q = rms_norm(q, layer["q_norm"], eps)
                k = rms_norm(k, layer["k_norm"], eps)
            q, k = apply_rotary(q, k, cos, sin, positions, fused)
            attention.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.k_scale, meta.v_scale)
            attn = attention.paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                           meta.block_tables, self.scale, self.sliding_window,
                                           max_query_len=meta.max_query_len, max_context_len=meta.max_context_len,
                                           workspace=meta.workspace, k_scale=meta.k_scale, v_scale=meta.v_scale)
            delta = self.linear(attn.view(T, self.q_size), layer["o"])
            h, x = add_rms_norm(h, delta, layer["post_norm"], eps, fused)
            gate_up = self.linear(x, layer["gate_up"])
            if fused:
                act = cpu_elementwise.silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
            delta = self.linear(act, layer["down"])
        h = h + delta
        h = rms_norm(h[logits_indices], self.norm, eps)
        return self.linear(h, self.lm_head).float()
