"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3; the base of the other families) over a
flattened token batch.

The layer code mirrors Hugging Face transformers' modules operation by operation (same
dtype casts, same order of residual adds) so that fp32 outputs match it token for token.
Attention goes through the C++ paged kernels; its metadata travels in `AttentionMetadata`.

The other families (pyengine/models/{gemma2,gemma3,phi3,smollm3}.py) subclass this one and
override the parts where they differ: the tensors a layer loads (`_layer_names` / `_load_layer`),
the layer's residual structure (`_decoder`), the norm (`_norm`), the RoPE rows a forward uses
(`_rope_rows`), the embedding (`embed_tokens`).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from pyengine.layers import attention
from pyengine.layers import elementwise as cpu_elementwise
from pyengine.layers import fused_decode as cpu_decode
from pyengine.layers import packed_gemm
from pyengine.layers.cpu_features import bf16_kernel_max_rows, native_bf16_matmul
from pyengine.layers.linear import dense
from pyengine.layers.norm import add_rms_norm, rms_norm
from pyengine.layers.rotary import apply_rotary, rope_tables
from pyengine.models.config import ModelConfig, lm_head_name
from pyengine.quant import QuantizedWeight
from pyengine.runtime.weight_arena import WeightArena


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
    if isinstance(t, QuantizedWeight):  # the CPU kernels compute fastest from the interleaved layout
        return t.interleaved() if device.type == "cpu" else t.to(device)
    return t.to(device).contiguous()


Take = Callable[[str, tuple[int, ...]], Any]


class LlamaFamilyModel:
    """Weights plus a forward over [num_tokens] flattened inputs; returns fp32 logits of the
    rows in `logits_indices`.

    Per-layer attributes the runner and the one-call decode kernel read: `layer_sliding_windows`
    (the attention window of each layer, 0 = the whole context), `layer_uses_rope` (whether the
    layer rotates q and k), `attn_softcap` (0.0: none), and `fused_cpu_decode_ok` (whether the
    C++ one-call decode path, which computes this class's layer structure, may run the model)."""

    #: The layer is the Llama layer the C++ one-call decode kernel computes (input norm, qkv (+bias),
    #: optional q/k RMSNorm, RoPE over whole heads from one table, o, post norm, SiLU gate_up, down).
    LLAMA_LAYER = True

    def packable_bf16_weights(self) -> list[torch.Tensor]:
        """The linear weights that pack_bf16_weights() takes (each once: a tied head is the
        embedding): bf16 on a CPU whose torch bf16 GEMM is native, where oneDNN packs; none
        otherwise."""
        if not self.native_cpu_bf16 or not packed_gemm.packing_works():
            return []
        weights = {w.data_ptr(): w for w in [layer[n] for layer in self.layers for n in ("qkv", "o", "gate_up", "down")]
                   + [self.lm_head] if isinstance(w, torch.Tensor)}
        return list(weights.values())

    def pack_bf16_weights(self, weights: list[torch.Tensor]) -> None:
        """Packs `weights` (packable_bf16_weights()) for torch's oneDNN GEMM
        (pyengine/layers/packed_gemm.py), which then multiplies the batches past
        `bf16_kernel_max_rows` rows; all or none."""
        for w in weights:
            p = packed_gemm.pack(w)
            if p is None:
                self.packed.clear()
                return
            self.packed[w.data_ptr()] = p

    def place_weights_in_huge_pages(self) -> WeightArena | None:
        """Moves every weight (embedding, decoder layers, final norm, head; a quantized weight's
        blocks) into one WeightArena (pyengine/runtime/weight_arena.py: anonymous memory in 2 MiB
        huge pages, where decode streams them faster than from the checkpoint's file mapping),
        one tensor at a time. Returns the arena; None where the weights are not on the CPU.
        Before anything takes the weights' addresses (packing, the one-call decode path)."""
        if not weights_on_cpu(self.embed):
            return None
        # (dict, key) of every value that may be a weight
        slots = [(self.__dict__, k) for k in ("embed", "norm", "lm_head")]
        slots += [(layer, k) for layer in self.layers for k in layer]
        unique = {id(t): t for owner, k in slots for t in _weight_tensors(owner[k])}
        arena = WeightArena.reserve(sum(WeightArena.footprint(t) for t in unique.values()))
        del unique
        lo, hi = arena.buffer.data_ptr(), arena.buffer.data_ptr() + arena.nbytes

        moved: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # (weak: the old copies go as they are replaced)

        def move(t: torch.Tensor) -> torch.Tensor:
            if lo <= t.data_ptr() < hi:  # a quantized weight met twice (a tied head is the embedding)
                return t
            old = moved.get(id(t))
            if old is not None and old[0]() is t:  # a tensor met twice
                return old[1]
            copy = arena.copy_in(t.contiguous())
            moved[id(t)] = (weakref.ref(t), copy)
            return copy

        for owner, k in slots:
            w = owner[k]
            if isinstance(w, QuantizedWeight):
                w.parts = [(fmt, move(data)) for fmt, data in w.parts]
            elif isinstance(w, torch.Tensor):
                owner[k] = move(w)
        self.weight_arena = arena
        return arena

    @property
    def packed_weight_bytes(self) -> int:
        """The bytes of the oneDNN-packed copies of the bf16 weights (0: none)."""
        # (an opaque oneDNN tensor has no storage to measure: it holds what the plain one does)
        if not self.packed:
            return 0
        return sum(w.nbytes for w in self.packable_bf16_weights() if w.data_ptr() in self.packed)

    @property
    def weight_bytes_by_format(self) -> dict[str, int]:
        """The weights' bytes by storage format: a quantized weight's row groups under their
        format's name ("q4_k"; an interleaved layout under the format it holds), float tensors
        under their dtype ("float32"); a tensor held twice (a tied head is the embedding) once."""
        out: dict[str, int] = {}
        seen: set[int] = set()
        for w in [self.embed, self.norm, self.lm_head] + [w for layer in self.layers for w in layer.values()]:
            if id(w) in seen or not isinstance(w, (torch.Tensor, QuantizedWeight)):
                continue
            seen.add(id(w))
            parts = w.parts if isinstance(w, QuantizedWeight) else [(None, w)]
            for fmt, data in parts:
                name = str(data.dtype).removeprefix("torch.") if fmt is None else fmt.plain or fmt.name
                out[name] = out.get(name, 0) + data.numel() * data.element_size()
        return out

    @property
    def output_projection_format(self) -> str:
        """The output projection's format ("q6_k"; "q8_0+q6_k" where its row groups differ) or
        dtype ("bfloat16")."""
        w = self.lm_head
        if isinstance(w, QuantizedWeight):
            return "+".join(dict.fromkeys(w.formats))
        return str(w.dtype).removeprefix("torch.")

    @property
    def decode_weight_bytes(self) -> int:
        """The weight bytes a one-token forward reads: every layer's weights and the head (of
        the embedding, only the token's row)."""
        weights = [w for layer in self.layers for w in layer.values() if isinstance(w, (torch.Tensor, QuantizedWeight))]
        return sum(w.nbytes for w in weights) + self.lm_head.nbytes

    @property
    def cuda_graphs_ok(self) -> bool:
        """Whether a decode step may be replayed from a captured CUDA graph (a replay runs the
        captured kernels only: no Python bookkeeping of the forward)."""
        return True

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

        prefix = c.weight_prefix
        self.embed = take(prefix + "embed_tokens.weight", (c.vocab_size, c.hidden_size))
        self.layers = []
        for i in range(c.num_layers):  # (a loop, not a comprehension: that would be a closure over self)
            self.layers.append(self._load_layer(take, f"{prefix}layers.{i}."))
        self.norm = self._load_norm(take, prefix + "norm.weight", c.hidden_size)
        head = lm_head_name(c)
        if c.tie_word_embeddings or head not in weights:
            self.lm_head = self.embed
        else:
            self.lm_head = take(head, (c.vocab_size, c.hidden_size))

        self.layer_sliding_windows: list[int] = c.layer_sliding_windows
        self.layer_uses_rope: list[bool] = c.layer_uses_rope
        windows = set(self.layer_sliding_windows)
        # the one window of every layer (what the one-call decode kernel takes); 0 where they differ
        self.sliding_window = windows.pop() if len(windows) == 1 else 0
        self.attn_softcap = float(c.attn_logit_softcapping or 0.0)
        self.final_softcap = float(c.final_logit_softcapping or 0.0)
        self.scale = (c.query_pre_attn_scalar if c.query_pre_attn_scalar is not None else c.head_dim) ** -0.5
        self.rotary_dim = c.rotary_dim
        self._init_rope(max_seq_len)
        # bf16 on the CPU (see layers.linear.dense): small batches take pyengine's linear_bf16 (and
        # the one-call decode path); without bf16 instructions torch's bf16 GEMM is emulated and
        # slow, so larger batches multiply in fp32 on the bf16 values.
        cpu_bf16 = dtype == torch.bfloat16 and weights_on_cpu(self.embed)
        self.emulate_bf16 = cpu_bf16 and not native_bf16_matmul()
        self.bf16_kernel_max_rows = bf16_kernel_max_rows() if cpu_bf16 else 0
        # ... and torch's native bf16 GEMM for larger ones, on weights packed for it once where
        # the engine asks (pack_bf16_weights(); pyengine/layers/packed_gemm.py): data_ptr -> packed
        self.native_cpu_bf16 = cpu_bf16 and not self.emulate_bf16
        self.packed: dict[int, torch.Tensor] = {}
        # the region the weights were moved into (place_weights_in_huge_pages(); None: where they were read)
        self.weight_arena: WeightArena | None = None
        # torch's fp32 GEMV streams the weights at a fraction of the memory bandwidth: small fp32
        # batches on the CPU take pyengine's linear_f32 (the same sums in another order), unless
        # exact_fp32 asks for torch's (and transformers') rounding.
        self.fast_fp32 = dtype == torch.float32 and weights_on_cpu(self.embed) and not exact_fp32
        # On the CPU, RMSNorm (+ residual add), RoPE and SiLU-mul of decode batches (up to MAX_ROWS)
        # run as one C++ call each (pyengine/cpu_elementwise.py), rounding as torch's operations do
        # (SiLU-mul within an ulp or two: its exp is not torch's).
        self.fused_elementwise = dtype in cpu_elementwise.SUPPORTED_DTYPES and weights_on_cpu(self.embed)
        # The kernels are as fast as torch's operations or faster at every size (RMSNorm ~3x, RoPE
        # 1.4-14x at 2048 rows, SiLU-mul 4-5x in fp32 from 512 rows), so prefill takes them too --
        # except with exact_fp32, where batches above MAX_ROWS keep torch's RMSNorm (its sum of
        # squares may round differently), RoPE and SiLU-mul.
        self.fused_elementwise_any_rows = self.fused_elementwise and not exact_fp32
        # weights in llama.cpp's block formats (pyengine/quant), computed with fp32 activations
        self.quantized = any(isinstance(w, QuantizedWeight) for layer in self.layers for w in layer.values()) \
            or isinstance(self.lm_head, QuantizedWeight) or isinstance(self.embed, QuantizedWeight)
        if self.quantized and device.type == "cpu" and dtype != torch.float32:
            raise ValueError(f"quantized weights compute with float32 activations on the CPU: dtype must be "
                             f"float32, got {dtype}")
        # some linear layers float in a quantized model (rows that fit no block format; a GGUF file
        # that stores them so): the one-call decode path, which takes them all quantized, is not used
        self.partly_quantized = self.quantized and not all(
            isinstance(layer[n], QuantizedWeight) for layer in self.layers for n in ("qkv", "o", "gate_up", "down"))

    # ---- weights -----------------------------------------------------------------------------

    @classmethod
    def weight_names(cls, config: ModelConfig) -> tuple[list[str], tuple[str, ...]]:
        """(names to load, the subset that may be absent)."""
        prefix = config.weight_prefix
        names = [prefix + "embed_tokens.weight", prefix + "norm.weight"]
        for i in range(config.num_layers):
            names += cls._layer_names(config, f"{prefix}layers.{i}.")
        optional: tuple[str, ...] = ()
        if not config.tie_word_embeddings:
            names.append(lm_head_name(config))
        return names, optional

    @classmethod
    def _layer_names(cls, c: ModelConfig, p: str) -> list[str]:
        """The tensors of the layer whose names start with `p`, as `_load_layer` takes them."""
        names = [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        if c.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if c.o_proj_bias:
            names.append(p + "self_attn.o_proj.bias")
        if c.mlp_bias:
            names += [p + f"mlp.{x}_proj.bias" for x in ("gate", "up", "down")]
        if c.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        return names

    def _load_norm(self, take: Take, name: str, size: int) -> torch.Tensor:
        """A norm's weights, in the form `_norm` computes with."""
        return take(name, (size,))

    def _load_qkv(self, take: Take, p: str) -> torch.Tensor | QuantizedWeight:
        """q, k and v fused into one matrix."""
        c = self.config
        return cat_rows([take(p + "self_attn.q_proj.weight", (self.q_size, c.hidden_size)),
                         take(p + "self_attn.k_proj.weight", (self.kv_size, c.hidden_size)),
                         take(p + "self_attn.v_proj.weight", (self.kv_size, c.hidden_size))])

    def _load_gate_up(self, take: Take, p: str) -> torch.Tensor | QuantizedWeight:
        """gate and up fused into one matrix (gate first)."""
        c = self.config
        return cat_rows([take(p + "mlp.gate_proj.weight", (c.intermediate_size, c.hidden_size)),
                         take(p + "mlp.up_proj.weight", (c.intermediate_size, c.hidden_size))])

    def _load_layer(self, take: Take, p: str) -> dict[str, Any]:
        c = self.config
        layer = {
            "input_norm": self._load_norm(take, p + "input_layernorm.weight", c.hidden_size),
            "post_norm": self._load_norm(take, p + "post_attention_layernorm.weight", c.hidden_size),
            "qkv": self._load_qkv(take, p),
            "o": take(p + "self_attn.o_proj.weight", (c.hidden_size, self.q_size)),
            "gate_up": self._load_gate_up(take, p),
            "down": take(p + "mlp.down_proj.weight", (c.hidden_size, c.intermediate_size)),
            "qkv_bias": None, "q_norm": None, "k_norm": None, "o_bias": None, "gate_up_bias": None,
            "down_bias": None,
        }
        if c.attention_bias:
            layer["qkv_bias"] = torch.cat([take(p + "self_attn.q_proj.bias", (self.q_size,)),
                                           take(p + "self_attn.k_proj.bias", (self.kv_size,)),
                                           take(p + "self_attn.v_proj.bias", (self.kv_size,))])
        if c.o_proj_bias:
            layer["o_bias"] = take(p + "self_attn.o_proj.bias", (c.hidden_size,))
        if c.mlp_bias:
            layer["gate_up_bias"] = torch.cat([take(p + "mlp.gate_proj.bias", (c.intermediate_size,)),
                                               take(p + "mlp.up_proj.bias", (c.intermediate_size,))])
            layer["down_bias"] = take(p + "mlp.down_proj.bias", (c.hidden_size,))
        if c.qk_norm:
            layer["q_norm"] = self._load_norm(take, p + "self_attn.q_norm.weight", c.head_dim)
            layer["k_norm"] = self._load_norm(take, p + "self_attn.k_norm.weight", c.head_dim)
        return layer

    # ---- RoPE --------------------------------------------------------------------------------

    def _init_rope(self, max_seq_len: int) -> None:
        """The cos/sin tables ([max_seq_len, rotary_dim]): `self.cos`/`self.sin` (the full-attention
        layers', the one the one-call decode kernel reads), `self.rope_tables` (every distinct one)
        and `self.layer_rope` (per layer, its table's index in rope_tables; None: no RoPE)."""
        c = self.config
        self.cos, self.sin = rope_tables(c, max_seq_len, self.dtype, self.device)
        self.rope_tables = [(self.cos, self.sin)]
        self.layer_rope: list[int | None] = [0 if uses else None for uses in self.layer_uses_rope]
        if c.sliding_rope_theta is not None:  # sliding-window layers with a RoPE of their own (Gemma 3)
            self.rope_tables.append(rope_tables(c, max_seq_len, self.dtype, self.device, sliding=True))
            self.layer_rope = [None if not uses else (1 if window else 0)
                               for uses, window in zip(self.layer_uses_rope, self.layer_sliding_windows)]

    def _rope_rows(self, positions: torch.Tensor, meta: AttentionMetadata, fused: bool) -> list[tuple]:
        """Per table of rope_tables, what apply_rotary takes for this batch: the whole tables for the
        fused kernel (whole-head RoPE only), else the rows of the batch's positions, [T, 1, rotary_dim]."""
        if fused and self.rotary_dim == self.config.head_dim:
            return self.rope_tables
        return [(cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)) for cos, sin in self.rope_tables]

    # ---- the one-call decode path ------------------------------------------------------------

    @property
    def fused_cpu_decode_ok(self) -> bool:
        """Whether the C++ one-call decode kernel (pyengine/layers/fused_decode.py) computes this
        model: the Llama layer structure with its whole-head RoPE from one table, no final-logit
        soft-capping, no output or MLP biases, and (quantized weights) every linear layer
        quantized. Per-layer windows, layers without RoPE and attention soft-capping it takes
        (layer_sliding_windows, layer_uses_rope, attn_softcap)."""
        c = self.config
        return (self.LLAMA_LAYER and not self.partly_quantized and len(self.rope_tables) == 1
                and self.rotary_dim == c.head_dim and self.final_softcap == 0.0
                and not c.o_proj_bias and not c.mlp_bias and c.hidden_act == "silu")

    # ---- forward -----------------------------------------------------------------------------

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed, QuantizedWeight):  # (fp32 rows; a GPU model may compute in 16 bits)
            h = self.embed.embedding(input_ids)
            return h if h.dtype == self.dtype else h.to(self.dtype)
        return F.embedding(input_ids, self.embed)

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed and x.shape[0] > self.bf16_kernel_max_rows:
            packed = self.packed.get(w.data_ptr())
            if packed is not None:
                return packed_gemm.packed_linear(x, packed, b)
        return dense(x, w, b, self.emulate_bf16, self.fast_fp32, self.bf16_kernel_max_rows)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The family's RMSNorm (torch form)."""
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits_indices: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[0]
        fused = self._fuses_elementwise(T)
        decode = meta.cpu_decode
        if decode is not None and 0 < T <= decode.max_rows:
            h = self.embed_tokens(input_ids)
            decode.run(h, positions, meta)
            if decode.has_head and fused and 0 < logits_indices.shape[0] <= decode.max_rows:
                return decode.logits(h, logits_indices)  # this method's _logits, in the same C++ call's kernels
            return self._logits(h[logits_indices], fused)
        h = self._hidden(input_ids, positions, meta, kv_caches)
        return self._logits(h[logits_indices], fused)

    def _fuses_elementwise(self, num_tokens: int) -> bool:
        """Whether a forward of `num_tokens` rows takes the fused elementwise kernels (RMSNorm,
        RoPE, SiLU-mul) of pyengine.layers.elementwise."""
        return self.fused_elementwise_any_rows or (self.fused_elementwise and num_tokens <= cpu_elementwise.MAX_ROWS)

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The hidden states of every row before the final norm (the layers' K/V stored on the way)."""
        fused = self._fuses_elementwise(input_ids.shape[0])
        rope = self._rope_rows(positions, meta, fused)
        h = self.embed_tokens(input_ids)
        return self._decoder(h, positions, meta, kv_caches, rope, fused)

    def _logits(self, h: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """fp32 logits of the final hidden states `h` (the final norm, the output projection, soft-capped
        in the model's dtype where the model caps them, as transformers does). `fused`: the forward
        takes the fused elementwise kernels, and the final norm is theirs too where the model's
        norm is Llama's (the one-call decode path's head computes it so)."""
        if fused and self.LLAMA_LAYER and h.shape[0] > 0:
            x = cpu_elementwise.rms_norm(h.contiguous(), self.norm, self.config.rms_norm_eps)
        else:
            x = self._norm(h, self.norm)
        logits = self.linear(x, self.lm_head)
        if self.final_softcap:
            cap = self.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def _decoder(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], rope: list[tuple], fused: bool) -> torch.Tensor:
        """The decoder layers on the embeddings h: the hidden states before the final norm."""
        eps = self.config.rms_norm_eps
        delta = None  # the last sublayer's output, not yet added to the residual stream h
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            h, x = add_rms_norm(h, delta, layer["input_norm"], eps, fused)
            delta = self._attention(i, layer, x, positions, meta, kv, rope, fused)
            h, x = add_rms_norm(h, delta, layer["post_norm"], eps, fused)
            delta = self._mlp(layer, x, fused)
        return h + delta

    def _attention(self, i: int, layer: dict[str, Any], x: torch.Tensor, positions: torch.Tensor,
                   meta: AttentionMetadata, kv: tuple[torch.Tensor, torch.Tensor], rope: list[tuple],
                   fused: bool) -> torch.Tensor:
        """Layer i's self-attention on its normed input x, through the output projection."""
        c = self.config
        T = x.shape[0]
        qkv = self.linear(x, layer["qkv"], layer["qkv_bias"])
        q = qkv[:, : self.q_size].view(T, c.num_heads, c.head_dim)
        k = qkv[:, self.q_size: self.q_size + self.kv_size].view(T, c.num_kv_heads, c.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(T, c.num_kv_heads, c.head_dim)
        if layer["q_norm"] is not None:
            q = self._norm(q, layer["q_norm"])
            k = self._norm(k, layer["k_norm"])
        table = self.layer_rope[i]
        if table is not None:
            cos, sin = rope[table]
            q, k = apply_rotary(q, k, cos, sin, positions, fused and cos.dim() == 2)
        k_cache, v_cache = kv
        attention.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.k_scale, meta.v_scale)
        softcap = {"softcap": self.attn_softcap} if self.attn_softcap else {}  # (a kernel option only Gemma 2 needs)
        attn = attention.paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                         meta.block_tables, self.scale, self.layer_sliding_windows[i],
                                         max_query_len=meta.max_query_len, max_context_len=meta.max_context_len,
                                         workspace=meta.workspace, k_scale=meta.k_scale, v_scale=meta.v_scale,
                                         **softcap)
        return self.linear(attn.view(T, self.q_size), layer["o"], layer["o_bias"])

    def _mlp(self, layer: dict[str, Any], x: torch.Tensor, fused: bool) -> torch.Tensor:
        """The gated MLP: down(act(gate(x)) * up(x))."""
        gate_up = self.linear(x, layer["gate_up"], layer["gate_up_bias"])
        if self.config.hidden_act == "silu":
            if fused:  # as fast as torch's at 64 rows, 4-5x faster in fp32 at prefill sizes
                act = cpu_elementwise.silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
        else:  # gelu_pytorch_tanh (Gemma's GeGLU)
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") * up
        return self.linear(act, layer["down"], layer["down_bias"])


def _weight_tensors(w: Any) -> list[torch.Tensor]:
    """The tensors holding a weight's values (a quantized weight's row groups)."""
    if isinstance(w, QuantizedWeight):
        return [data for _, data in w.parts]
    return [w] if isinstance(w, torch.Tensor) else []
