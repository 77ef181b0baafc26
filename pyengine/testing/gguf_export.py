"""Writes a GGUF file from a (tiny) Hugging Face checkpoint the way llama.cpp's
``convert_hf_to_gguf.py`` does, for tests and benchmarks that need GGUF files without llama.cpp.

Same metadata keys in the same order, same tensor names and order, the same q/k row permutation
for the llama architecture, the same tokenizer fields (a byte-level BPE: tokenizer.ggml.model
"gpt2", tokens, token types, merges, special ids, declared as pre-tokenizer ``pre_tokenizer``,
"gpt-2" by default), written with ``gguf.GGUFWriter``; name and size label come from
``gguf.Metadata`` as in the converter. The tensors:

- ``outtype`` "f32", "f16", "bf16", "q8_0": as the converter's ``--outtype`` (1-D tensors and
  norms F32; Q8_0 through ``gguf.quants.quantize``, llama.cpp's reference quantizer).
- "q5_0", "q5_1", "q4_0", "q4_k", "q5_k", "q6_k": what ``llama-quantize`` would make of an F32 file, with the
  per-tensor formats of pyengine's own ``QuantPlan`` (pyengine/quant/on_load.py: linear layers
  in the format or llama.cpp's fallback, the output projection Q6_K), so that the file holds byte
  for byte the blocks that ``Engine(hf_dir, quantization=...)`` computes. Q8_0, Q5_0, Q5_1 and
  Q4_0 blocks come from ``gguf.quants``; Q4_K, Q5_K and Q6_K (which ``gguf.quants`` cannot
  quantize) from pyengine's quantizers.
- ``tensor_types`` overrides the type of single tensors (GGUF names -> "Q5_0", "F16", ...: any
  type ``gguf.quants`` quantizes, or Q4_K / Q5_K / Q6_K); ``drop_tensors`` leaves tensors out
  (tests of damaged files).

Needs the ``gguf`` package; the quantized outtypes but q8_0, and K-quant tensors, also need
pyengine's compiled core.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import torch

__all__ = ["OUTTYPES", "export_gguf", "permute_qk"]

OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q5_0", "q5_1", "q4_0", "q4_k", "q5_k", "q6_k")
# Hugging Face model_type -> GGUF architecture (the converter writes Mistral as llama)
_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def permute_qk(w: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """convert_hf_to_gguf.py's ``LlamaModel.permute``: the rows of q (or k) reordered within each
    head for llama.cpp's RoPE on adjacent pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def export_gguf(model_dir: str | Path, out_path: str | Path, outtype: str = "f32", *,
                tensor_types: Mapping[str, str] | None = None, drop_tensors: tuple[str, ...] = (),
                pre_tokenizer: str = "gpt-2") -> Path:
    """Writes the checkpoint in `model_dir` as the GGUF file `out_path` and returns its path."""
    import gguf

    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {OUTTYPES}, got {outtype!r}")
    model_dir, out_path = Path(model_dir), Path(out_path)
    hparams = json.loads((model_dir / "config.json").read_text())
    model_type = hparams.get("model_type")
    if model_type not in _ARCH:
        raise ValueError(f"cannot export model_type {model_type!r}; supported: {', '.join(_ARCH)}")
    arch = _ARCH[model_type]
    tensor_types = dict(tensor_types or {})
    writer = gguf.GGUFWriter(str(out_path), arch)
    try:
        # as the converter: tensors first (their count sizes the label), then the metadata
        choose = _type_chooser(outtype, hparams, tensor_types)
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], hparams["num_hidden_layers"])
        for hf_name, data in _tensors(model_dir, hparams, arch):
            name = hf_name if hf_name.startswith("rope_freqs") else \
                names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            if name is None:
                raise ValueError(f"no GGUF name for tensor {hf_name!r}")
            if name in drop_tensors:
                continue
            qtype = choose(name, hf_name, data)
            writer.add_tensor(name, _encode(data, qtype), raw_dtype=qtype)
        _add_metadata(writer, model_dir, hparams, arch, outtype)
        _add_vocab(writer, model_dir, hparams, arch, pre_tokenizer)
        writer.write_header_to_file(path=str(out_path))
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return out_path


# ---- tensors --------------------------------------------------------------------------------

def _tensors(model_dir: Path, hparams: dict[str, Any], arch: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 or float16 tensor) in the checkpoint's order, q/k permuted for
    llama, Llama 3's rope_freqs first (the converter's generate_extra_tensors)."""
    from safetensors import safe_open

    rope = _rope_parameters(hparams)
    if arch == "llama" and rope.get("rope_type", "").lower() == "llama3":
        yield "rope_freqs.weight", _llama3_rope_factors(hparams, rope)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = [model_dir / "model.safetensors"]
    n_head, n_kv = hparams["num_attention_heads"], hparams.get("num_key_value_heads")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for hf_name in f.keys():
                if hf_name.endswith(".rotary_emb.inv_freq"):
                    continue
                t = f.get_tensor(hf_name)
                if t.dtype not in (torch.float16, torch.float32):
                    t = t.to(torch.float32)
                if arch == "llama":
                    if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                        t = permute_qk(t, n_head, n_head)
                    elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                        t = permute_qk(t, n_head, n_kv)
                yield hf_name, t


def _rope_parameters(hparams: dict[str, Any]) -> dict[str, Any]:
    rope = dict(hparams.get("rope_parameters") or hparams.get("rope_scaling") or {})
    if "rope_theta" not in rope and "rope_theta" in hparams:
        rope["rope_theta"] = hparams["rope_theta"]
    return rope


def _llama3_rope_factors(hparams: dict[str, Any], rope: dict[str, Any]) -> torch.Tensor:
    """LlamaModel.generate_extra_tensors: one divisor per RoPE frequency."""
    base = rope.get("rope_theta", 10000.0)
    dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor, high_freq_factor = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen, high_freq_wavelen = old_context_len / low_freq_factor, old_context_len / high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def _type_chooser(outtype: str, hparams: dict[str, Any], overrides: dict[str, str]):
    import gguf

    Q = gguf.GGMLQuantizationType
    plan = None
    if outtype not in ("f32", "f16", "bf16", "q8_0"):
        from pyengine.quant.on_load import QuantPlan  # needs the compiled core
        plan = QuantPlan.create(outtype, bool(hparams.get("tie_word_embeddings", False)))

    def choose(name: str, hf_name: str, data: torch.Tensor) -> Any:
        if name in overrides:
            return Q[overrides[name].upper()]
        if data.dim() <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
            return Q.F32
        if outtype in ("f32", "f16", "bf16"):
            return Q[outtype.upper()]
        if outtype == "q8_0":
            return Q.Q8_0 if data.shape[-1] % 32 == 0 else Q.F16  # the converter's QuantError fallback
        fmt = plan.format_for(hf_name, tuple(data.shape))
        return Q.F32 if fmt is None else Q[fmt.name.upper()]

    return choose


def _encode(data: torch.Tensor, qtype: Any) -> np.ndarray:
    """The tensor in `qtype`: floats, or the blocks as uint8 [rows, row bytes]."""
    import gguf

    if qtype.name in ("Q4_K", "Q5_K", "Q6_K"):
        from pyengine.quant import QuantizedWeight  # gguf.quants has no K-quant quantizer
        return QuantizedWeight.quantize(data.float(), qtype.name.lower()).parts[0][1].numpy()
    return gguf.quants.quantize(data.numpy(), qtype)


# ---- metadata -------------------------------------------------------------------------------

_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
               "q5_0": "MOSTLY_Q5_0", "q5_1": "MOSTLY_Q5_1", "q4_0": "MOSTLY_Q4_0", "q4_k": "MOSTLY_Q4_K_S",
               "q5_k": "MOSTLY_Q5_K_S", "q6_k": "MOSTLY_Q6_K"}


def _add_metadata(writer: Any, model_dir: Path, hparams: dict[str, Any], arch: str, outtype: str) -> None:
    """convert_hf_to_gguf.py's prepare_metadata and set_gguf_parameters, in its order."""
    import gguf

    total, shared, expert, expert_count = writer.get_total_parameter_count()
    meta = gguf.Metadata.load(None, model_dir, None, total)
    if meta.name is None:
        meta.name = model_dir.name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, expert_count)
    writer.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(writer)

    writer.add_block_count(hparams["num_hidden_layers"])
    writer.add_context_length(hparams["max_position_embeddings"])
    writer.add_embedding_length(hparams["hidden_size"])
    writer.add_feed_forward_length(hparams["intermediate_size"])
    writer.add_head_count(hparams["num_attention_heads"])
    if "num_key_value_heads" in hparams:
        writer.add_head_count_kv(hparams["num_key_value_heads"])
    rope = _rope_parameters(hparams)
    if rope.get("rope_type") not in (None, "default", "llama3"):
        raise ValueError(f"cannot export rope_type {rope['rope_type']!r}")
    if rope.get("rope_theta") is not None:
        writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
    if hparams.get("head_dim") is not None:
        writer.add_key_length(hparams["head_dim"])
        writer.add_value_length(hparams["head_dim"])
    writer.add_file_type(gguf.LlamaFileType[_FILE_TYPES[outtype]])
    if arch == "llama":
        writer.add_vocab_size(hparams["vocab_size"])
        writer.add_rope_dimension_count(hparams.get("head_dim") or
                                        hparams["hidden_size"] // hparams["num_attention_heads"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_vocab(writer: Any, model_dir: Path, hparams: dict[str, Any], arch: str, pre_tokenizer: str) -> None:
    """The converter's _set_vocab_gpt2 (get_vocab_base, then gguf.SpecialVocab)."""
    import gguf
    from transformers import AutoTokenizer

    if arch == "llama":  # LlamaModel.set_vocab
        config_file = model_dir / "tokenizer_config.json"
        if config_file.is_file():
            add_prefix_space = json.loads(config_file.read_text()).get("add_prefix_space")
            if add_prefix_space is not None:
                writer.add_add_space_prefix(add_prefix_space)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    vocab_size = hparams.get("vocab_size", len(tokenizer.vocab))
    reverse = {i: t for t, i in tokenizer.vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            if not decoder[i].normalized:
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if decoder[i].special or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(model_dir, load_merges=True).add_to_gguf(writer, quiet=True)


def _looks_special(token: str) -> bool:
    """The converter's does_token_look_special."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))
