"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flattened token batch.

The layer code mirrors Hugging Face transformers' modules operation by operation (same
dtype casts, same order of residual adds) so that fp32 outputs match it token for token.
Attention goes through the C++ paged kernels; its metadata travels in `AttentionMetadata`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pyengine.layers import attention as kernels
from pyengine.layers import elementwise as cpu_elementwise
from pyengine.layers import fused_decode as cpu_decode
from pyengine.layers.cpu_features import EMULATED_BF16_MIN_ROWS, native_bf16_matmul
from pyengine.layers.linear import linear_bf16
from pyengine.models.config import ModelConfig


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [num_tokens] int32
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32
    seq_lens: torch.Tensor          # [num_seqs] int32
    block_tables: torch.Tensor      # [num_seqs, max_blocks_per_seq] int32
    # What a CUDA launch needs besides (host values, so that it reads nothing back from the
    # GPU; see pyengine/cuda_kernels.py); unused on the CPU.
    max_query_len: int | None = None
    max_context_len: int | None = None
    workspace: torch.Tensor | None = None
    k_scale: float = 1.0            # an fp8 cache's per-tensor scales
    v_scale: float = 1.0
    # CPU, bf16 via pyengine's linear kernel: all layers of a small batch in one C++ call
    cpu_decode: "cpu_decode.CpuDecodeLayers | None" = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    # Llama 3.1 frequency scaling: long wavelengths divided by `factor`, a smooth ramp between.
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s.get("original_max_position_embeddings", config.max_position_embeddings))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def weights_on_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaFamilyModel:
    """Weights plus a forward over [num_tokens] flattened inputs; returns fp32 logits of the
    rows in `logits_indices`."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 max_seq_len: int, device: torch.device | str = "cpu"):
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        c = config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_size, self.kv_size = q_size, kv_size

        def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            t = weights.pop(name)
            if tuple(t.shape) != shape:
                raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape} from config.json")
            return t.to(self.device).contiguous()

        self.embed = take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            layer = {
                "input_norm": take(p + "input_layernorm.weight", (c.hidden_size,)),
                "post_norm": take(p + "post_attention_layernorm.weight", (c.hidden_size,)),
                # q, k, v fused into one matmul; gate and up likewise.
                "qkv": torch.cat([take(p + "self_attn.q_proj.weight", (q_size, c.hidden_size)),
                                  take(p + "self_attn.k_proj.weight", (kv_size, c.hidden_size)),
                                  take(p + "self_attn.v_proj.weight", (kv_size, c.hidden_size))]),
                "o": take(p + "self_attn.o_proj.weight", (c.hidden_size, q_size)),
                "gate_up": torch.cat([take(p + "mlp.gate_proj.weight", (c.intermediate_size, c.hidden_size)),
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

        positions = torch.arange(max_seq_len, dtype=torch.float32)
        freqs = positions[:, None] * rope_inv_freq(c)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype).to(self.device)
        self.sin = emb.sin().to(dtype).to(self.device)
        self.scale = c.head_dim ** -0.5
        self.sliding_window = c.sliding_window or 0
        # Without bf16 instructions, torch's bf16 GEMM is emulated and slow: for batches of
        # several rows, multiply in fp32 (weights converted on the fly, products exact, fp32
        # accumulation, output rounded to bf16 as a bf16 GEMM does); for fewer rows (decode),
        # the same arithmetic in pyengine's kernel, which streams the weights at memory speed.
        self.emulate_bf16 = dtype == torch.bfloat16 and weights_on_cpu(self.embed) and not native_bf16_matmul()
        # On the CPU, RMSNorm (+ residual add), RoPE and SiLU-mul of small batches run as one
        # C++ call each (pyengine/cpu_elementwise.py), rounding as torch's operations do.
        self.fused_elementwise = dtype in cpu_elementwise.SUPPORTED_DTYPES and weights_on_cpu(self.embed)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if self.emulate_bf16 and x.shape[0] >= EMULATED_BF16_MIN_ROWS:
            return F.linear(x.float(), w.float(), None if b is None else b.float()).to(torch.bfloat16)
        if self.emulate_bf16 and x.shape[0] > 0:  # 1 .. EMULATED_BF16_MIN_ROWS - 1 rows
            return linear_bf16(x.contiguous(), w, b)
        return F.linear(x, w, b)

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
        if meta.cpu_decode is not None and 0 < T <= cpu_decode.MAX_ROWS:
            h = F.embedding(input_ids, self.embed)
            meta.cpu_decode.run(h, positions, meta)
            h = rms_norm(h[logits_indices], self.norm, eps)
            return self.linear(h, self.lm_head).float()
        fused = self.fused_elementwise and T <= cpu_elementwise.MAX_ROWS
        if not fused:
            cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
            sin = self.sin[positions].unsqueeze(1)
        h = F.embedding(input_ids, self.embed)
        delta = None  # the last sublayer's output, not yet added to the residual stream h
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h, x = self._add_norm(h, delta, layer["input_norm"], fused)
            qkv = self.linear(x, layer["qkv"], layer["qkv_bias"])
            q = qkv[:, : self.q_size].view(T, c.num_heads, c.head_dim)
            k = qkv[:, self.q_size: self.q_size + self.kv_size].view(T, c.num_kv_heads, c.head_dim)
            v = qkv[:, self.q_size + self.kv_size:].view(T, c.num_kv_heads, c.head_dim)
            if layer["q_norm"] is not None:
                q = rms_norm(q, layer["q_norm"], eps)
                k = rms_norm(k, layer["k_norm"], eps)
            if fused:
                cpu_elementwise.rotary_embedding_(q, self.cos, self.sin, positions)
                cpu_elementwise.rotary_embedding_(k, self.cos, self.sin, positions)
            else:
                q = q * cos + rotate_half(q) * sin
                k = k * cos + rotate_half(k) * sin
            kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.k_scale, meta.v_scale)
            attn = kernels.paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                           meta.block_tables, self.scale, self.sliding_window,
                                           max_query_len=meta.max_query_len, max_context_len=meta.max_context_len,
                                           workspace=meta.workspace, k_scale=meta.k_scale, v_scale=meta.v_scale)
            delta = self.linear(attn.view(T, self.q_size), layer["o"])
            h, x = self._add_norm(h, delta, layer["post_norm"], fused)
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

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                  fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, rms_norm(h + delta)) as transformers' residual add and next norm; the
        fused kernel adds into h in place (h is the forward's own residual stream)."""
        eps = self.config.rms_norm_eps
        if fused:
            if delta is None:
                return h, cpu_elementwise.rms_norm(h, weight, eps)
            return h, cpu_elementwise.add_rms_norm(delta, h, weight, eps)
        if delta is not None:
            h = h + delta
        return h, rms_norm(h, weight, eps)
