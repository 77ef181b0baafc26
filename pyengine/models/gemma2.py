"""Gemma 2 (``model_type`` "gemma2"), as transformers' ``Gemma2ForCausalLM`` computes it.

Where it differs from the Llama family (pyengine/models/llama.py), each as transformers does it:

* RMSNorm scales by ``1 + w`` in fp32 and rounds once: ``(x.float() * rsqrt(...) * (1 + w.float())).to(dtype)``
  (Llama rounds first, then scales in the activation dtype). The weights are kept as ``1 + w`` in fp32.
* Four norms per layer: the attention's and the MLP's outputs are normed *before* their residual
  add (post_attention_layernorm, post_feedforward_layernorm), the MLP's input by
  pre_feedforward_layernorm.
* Embeddings scaled by ``sqrt(hidden_size)``, a normalizer cast to the activation dtype first (in
  bf16, sqrt(3072) = 55.43 becomes 55.5), the product rounded to it.
* Softmax scale ``query_pre_attn_scalar ** -0.5``; attention scores soft-capped
  (``cap * tanh(score / cap)``, the paged attention's ``softcap``), and the final logits too, in
  the activation dtype.
* GeGLU: ``gelu(gate, approximate="tanh") * up``.
* Sliding-window and global layers alternate (config.json's layer_types).

The one-call CPU decode kernel computes Llama layers only: this model always runs its Python forward.
"""

from __future__ import annotations

from typing import Any

import torch

from pyengine.layers.norm import gemma_rms_norm
from pyengine.models.config import ModelConfig
from pyengine.models.llama import AttentionMetadata, LlamaFamilyModel, Take


class Gemma2Model(LlamaFamilyModel):
    LLAMA_LAYER = False

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 max_seq_len: int, device: torch.device | str = "cpu", *, exact_fp32: bool = False):
        super().__init__(config, weights, dtype, max_seq_len, device, exact_fp32=exact_fp32)
        # transformers: torch.tensor(hidden_size ** 0.5) (fp32), cast to the weights' dtype
        self.normalizer = torch.tensor(config.hidden_size ** 0.5).to(dtype).to(self.device)

    @classmethod
    def _layer_names(cls, c: ModelConfig, p: str) -> list[str]:
        return super()._layer_names(c, p) + [p + "pre_feedforward_layernorm.weight",
                                             p + "post_feedforward_layernorm.weight"]

    def _load_norm(self, take: Take, name: str, size: int) -> torch.Tensor:
        return 1.0 + take(name, (size,)).float()  # as the norm computes it: 1 + w.float(), fp32

    def _load_layer(self, take: Take, p: str) -> dict[str, Any]:
        layer = super()._load_layer(take, p)
        size = self.config.hidden_size
        layer["pre_ff_norm"] = self._load_norm(take, p + "pre_feedforward_layernorm.weight", size)
        layer["post_ff_norm"] = self._load_norm(take, p + "post_feedforward_layernorm.weight", size)
        return layer

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, weight, self.config.rms_norm_eps)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_tokens(input_ids) * self.normalizer

    def _decoder(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], rope: list[tuple], fused: bool) -> torch.Tensor:
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            x = self._norm(h, layer["input_norm"])
            h = h + self._norm(self._attention(i, layer, x, positions, meta, kv, rope, fused), layer["post_norm"])
            x = self._norm(h, layer["pre_ff_norm"])
            h = h + self._norm(self._mlp(layer, x, fused), layer["post_ff_norm"])
        return h
