"""A GGUF file's tensors -> the Hugging Face-named weights the model takes.

- Names: llama.cpp's (token_embd, blk.N.attn_q, ...) <-> Hugging Face's (model.embed_tokens,
  model.layers.N.self_attn.q_proj, ...).
- Types: F32, F16 and BF16 become float tensors of the model's dtype; the GGML block types
  pyengine computes with (`quant_types()`: Q8_0, Q5_0, Q5_1, Q4_0, Q4_K, Q5_K, Q6_K) are kept as
  they are, as `QuantizedWeight`s (the same blocks, byte for byte). Any other type is refused,
  naming the tensor and the type.
- Rows: for the llama architecture, llama.cpp's converter reorders the rows of attn_q and attn_k
  within each head (`LlamaModel.permute` in convert_hf_to_gguf.py: rows 0, d/2, 1, d/2+1, ...,
  so that RoPE can rotate adjacent pairs). pyengine rotates the two halves of a head, as
  transformers does, so the order is undone here. Whole rows move, so it works on quantized
  rows alike (their blocks run along a row).

Tensors are read with plain file reads into memory of their own (no memory map is kept), all
checks done before the first byte is read.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch

from pyengine.gguf.header import GGUFHeader, GGUFTensorInfo
from pyengine.models.config import ModelConfig
from pyengine.quant import QUANT_FORMATS, QuantFormat, QuantizedWeight

__all__ = ["FLOAT_TYPES", "gguf_name", "load_weights", "quant_types", "read_float_tensor", "supported_types",
           "unpermute_rows"]

logger = logging.getLogger(__name__)

FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def quant_types() -> dict[str, QuantFormat]:
    """GGML type name -> pyengine's format, for each block format pyengine computes with that is
    a GGML type (the same name and type id; not pyengine's own Q4_Z)."""
    import gguf

    out = {}
    for f in QUANT_FORMATS.values():
        t = getattr(gguf.GGMLQuantizationType, f.name.upper(), None)
        if t is not None and int(t) == f.type_id:
            out[t.name] = f
    return out


def supported_types() -> tuple[str, ...]:
    """The tensor types pyengine reads from a GGUF file."""
    return tuple(FLOAT_TYPES) + tuple(quant_types())

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# the matrices the model multiplies with (may stay quantized); everything else must be float
_MATRICES = ("model.embed_tokens.weight", "lm_head.weight") + tuple(
    "." + k for k in _LAYER_NAMES if k.endswith("_proj.weight"))


def gguf_name(hf_name: str) -> str:
    """The GGUF tensor name of a Hugging Face weight name (KeyError for one the model lacks)."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    prefix, _, rest = hf_name.partition(".layers.")
    layer, _, suffix = rest.partition(".")
    if prefix != "model" or not layer.isdigit() or suffix not in _LAYER_NAMES:
        raise KeyError(hf_name)
    return f"blk.{layer}.{_LAYER_NAMES[suffix]}"


def _expected_shape(hf_name: str, c: ModelConfig) -> tuple[int, ...]:
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (c.vocab_size, c.hidden_size)
    suffix = hf_name.split(".", 3)[3] if hf_name.startswith("model.layers.") else hf_name
    return {
        "model.norm.weight": (c.hidden_size,),
        "input_layernorm.weight": (c.hidden_size,),
        "post_attention_layernorm.weight": (c.hidden_size,),
        "self_attn.q_proj.weight": (q, c.hidden_size),
        "self_attn.k_proj.weight": (kv, c.hidden_size),
        "self_attn.v_proj.weight": (kv, c.hidden_size),
        "self_attn.o_proj.weight": (c.hidden_size, q),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.q_norm.weight": (c.head_dim,),
        "self_attn.k_norm.weight": (c.head_dim,),
        "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
        "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
    }[suffix]


def _check(header: GGUFHeader, info: GGUFTensorInfo, expected: tuple[int, ...] | None, matrix: bool) -> None:
    """ValueError naming the tensor if pyengine cannot take it as it is in the file."""
    where = f"GGUF file {str(header.path)!r}: tensor {info.name!r}"
    if info.type_name not in supported_types():
        raise ValueError(f"{where} has type {info.type_name}, which pyengine does not read; supported: "
                         f"{', '.join(supported_types())}")
    if expected is not None and info.shape != expected:
        raise ValueError(f"{where} has shape {list(info.shape)} (rows first), expected {list(expected)} from the "
                         "file's metadata")
    if info.type_name in quant_types() and not (matrix and len(info.shape) == 2):
        raise ValueError(f"{where} is {info.type_name}; pyengine needs it in float (F32, F16 or BF16)")
    if info.nbytes is None:
        raise ValueError(f"{where}: rows of {info.shape[-1]} weights do not hold whole {info.type_name} blocks")
    end = info.offset + info.nbytes
    if end > header.file_size:
        raise ValueError(f"{where} (bytes {info.offset} to {end}) runs past the end of the file "
                         f"({header.file_size} bytes): the file is truncated or corrupt")


def _read_bytes(f: Any, info: GGUFTensorInfo) -> torch.Tensor:
    """The tensor's bytes, read into a new uint8 tensor."""
    buf = torch.empty(info.nbytes, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    f.seek(info.offset)
    done = 0
    while done < info.nbytes:
        n = f.readinto(view[done:])
        if not n:
            raise ValueError(f"tensor {info.name!r}: the file ended after {done} of its {info.nbytes} bytes")
        done += n
    return buf


def _as_float(buf: torch.Tensor, info: GGUFTensorInfo, dtype: torch.dtype) -> torch.Tensor:
    return buf.view(FLOAT_TYPES[info.type_name]).reshape(info.shape).to(dtype)


def read_float_tensor(header: GGUFHeader, name: str) -> torch.Tensor:
    """One float tensor of the file (e.g. rope_freqs.weight), as float32."""
    info = header.tensors[name]
    _check(header, info, None, matrix=False)
    with open(header.path, "rb") as f:
        return _as_float(_read_bytes(f, info), info, torch.float32)


def unpermute_rows(rows: int, head_dim: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation: W_hf = W_gguf[unpermute_rows(...)].

    convert_hf_to_gguf.py's permute views each head's rows as [2, head_dim/2] and swaps the two
    axes, so GGUF row h*d + 2i + j holds HF row h*d + j*d/2 + i; the inverse reads them back."""
    heads = rows // head_dim
    return torch.arange(rows).reshape(heads, head_dim // 2, 2).transpose(1, 2).reshape(rows)


def load_weights(header: GGUFHeader, config: ModelConfig, names: list[str], dtype: torch.dtype,
                 optional: tuple[str, ...] = ()) -> dict[str, torch.Tensor | QuantizedWeight]:
    """The named (Hugging Face) weights from the file: float tensors in `dtype`, quantized
    matrices as QuantizedWeight. ValueError naming the tensor for one that is missing, of a type
    pyengine does not read, of the wrong shape, or cut off by the end of the file; all of them
    are checked before any tensor is read."""
    path = str(header.path)
    wanted: list[tuple[str, GGUFTensorInfo]] = []
    missing = []
    for hf in names:
        name = gguf_name(hf)
        info = header.tensors.get(name)
        if info is None:
            if hf not in optional:
                missing.append(f"{name!r} ({hf})")
            continue
        wanted.append((hf, info))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"GGUF file {path!r} is missing tensor {missing[0]}{more}")
    for hf, info in wanted:
        _check(header, info, _expected_shape(hf, config), matrix=hf.endswith(_MATRICES))

    permute = config.model_type == "llama"  # llama.cpp permutes q/k for its "llama" architecture only
    blocks = quant_types()
    out: dict[str, torch.Tensor | QuantizedWeight] = {}
    with open(header.path, "rb", buffering=0) as f:
        for hf, info in wanted:
            try:
                buf = _read_bytes(f, info)
            except ValueError as e:
                raise ValueError(f"GGUF file {path!r}: {e}") from None
            quantized = info.type_name in blocks
            t = buf.view(info.shape[0], -1) if quantized else _as_float(buf, info, dtype)
            if permute and (".self_attn.q_proj." in hf or ".self_attn.k_proj." in hf):
                t = t[unpermute_rows(info.shape[0], config.head_dim)]
            out[hf] = QuantizedWeight.from_blocks(blocks[info.type_name], t, info.shape) if quantized else t
    _unmix_fused_groups(out, config)
    logger.info("GGUF %s: %d tensors (%s)", path, len(wanted),
                ", ".join(f"{n} {t}" for t, n in Counter(i.type_name for _, i in wanted).most_common()))
    return out


def _unmix_fused_groups(weights: dict[str, Any], config: ModelConfig) -> None:
    """The model fuses q/k/v and gate/up into one matrix each; where a file stores some of a
    group quantized and some in float, the quantized ones are dequantized (exact values)."""
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for group in ([p + f"self_attn.{x}_proj.weight" for x in "qkv"],
                      [p + f"mlp.{x}_proj.weight" for x in ("gate", "up")]):
            parts = [weights.get(n) for n in group]
            kinds = {isinstance(w, QuantizedWeight) for w in parts if w is not None}
            if len(kinds) == 2:
                logger.warning("GGUF: %s mix quantized and float tensors: dequantizing the quantized ones",
                               ", ".join(gguf_name(n) for n in group))
                for n, w in zip(group, parts):
                    if isinstance(w, QuantizedWeight):
                        weights[n] = w.dequantize().to(next(x.dtype for x in parts if isinstance(x, torch.Tensor)))
