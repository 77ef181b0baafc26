"""SmolLM3 (``model_type`` "smollm3"), as transformers' ``SmolLM3ForCausalLM`` computes it: the
Llama layer, except that some layers apply no RoPE (config.json's ``no_rope_layers``, 1 = the
layer uses RoPE; by default every ``no_rope_layer_interval``-th layer skips it), and, with
``use_sliding_window``, the no-RoPE layers attend within the window (``layer_types``).

The model's ``layer_uses_rope`` says which layers rotate q and k. Until the one-call CPU decode
kernel reads it, a model with no-RoPE layers runs its Python forward (see
LlamaFamilyModel.fused_cpu_decode_ok).
"""

from __future__ import annotations

from pyengine.models.llama import LlamaFamilyModel


class SmolLM3Model(LlamaFamilyModel):
    """The Llama family's model: the no-RoPE layers come from the config (layer_uses_rope)."""
