"""Gemma 3's text model (``model_type`` "gemma3_text", and the language model of a multimodal
"gemma3" checkpoint), as transformers' ``Gemma3ForCausalLM`` computes it.

Gemma 2's layer (pyengine/models/gemma2.py: 1 + w norms in fp32, four norms per layer, scaled
embeddings, ``query_pre_attn_scalar``, GeGLU), plus:

* q and k normed per head with Gemma's RMSNorm (q_norm, k_norm) before RoPE;
* two RoPEs: the sliding-window layers' base ``rope_local_base_freq`` (transformers 5:
  rope_parameters["sliding_attention"]), the full-attention layers' ``rope_theta`` with its
  scaling (linear for the larger Gemma 3 models; rope_parameters["full_attention"]);
* the layer pattern: config.json's layer_types, else every ``sliding_window_pattern``-th layer
  full (transformers' default 6);
* final-logit soft-capping if configured. transformers' Gemma 3 attention does not apply
  ``attn_logit_softcapping`` (its attention module never passes it to the attention function), and
  neither does pyengine, to give its outputs.

A multimodal checkpoint's text weights are read from model.language_model.* (or the older
language_model.model.*); the vision tower is not loaded.
"""

from __future__ import annotations

from pyengine.models.gemma2 import Gemma2Model


class Gemma3TextModel(Gemma2Model):
    """Gemma 2's layers with Gemma-style q/k norms (config.qk_norm) and a RoPE per layer type
    (config.sliding_rope_theta; see LlamaFamilyModel._init_rope)."""
