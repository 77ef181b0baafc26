"""4-bit checkpoints quantized by AWQ or GPTQ (a Hugging Face directory whose config.json has a
`quantization_config`), repacked at load into pyengine's Q4_Z blocks (w = d * (q - z), 32
weights per block; every block of a group carries the group's scale and zero point). No
dequantized copy is made.

Published layouts (x @ W with W [K, N] = in_features x out_features; 8 levels per int32):
- AWQ, GEMM packing: ``qweight`` int32 [K, N / 8] and ``qzeros`` int32 [K / g, N / 8], the 8
  levels of an int32 at bits 4i belonging to columns 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i];
  ``scales`` fp16 [K / g, N]. w[k, n] = (q - z) * s.
- GPTQ: ``qweight`` int32 [K / 8, N], level 8r + i of a column at bits 4i; ``qzeros`` int32
  [K / g, N / 8] packed along N in order; ``scales`` fp16 [K / g, N]; ``g_idx`` [K] (must be
  k // g: activation reordering, desc_act=True, is not supported). The "gptq" (v1) checkpoint
  format stores zero points minus one; "gptq_v2" stores them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from pyengine.quant.formats import quant_format
from pyengine.quant.weight import QuantizedWeight

__all__ = ["PrequantizedSpec", "repack_linear", "LINEAR_TENSORS"]

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column (within 8) of the level at bits 4i
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
_Q4_Z = quant_format("q4_z")

#: the tensors of one quantized linear layer, per method
LINEAR_TENSORS = {"awq": ("qweight", "qzeros", "scales"), "gptq": ("qweight", "qzeros", "scales", "g_idx")}


@dataclass(frozen=True)
class PrequantizedSpec:
    """A checkpoint's `quantization_config`, checked."""

    method: str               # "awq" or "gptq"
    group_size: int           # weights per group along K; -1: the whole row (GPTQ)
    zeros_minus_one: bool     # GPTQ v1 checkpoints store z - 1

    @classmethod
    def from_config(cls, qc: dict[str, Any]) -> "PrequantizedSpec":
        """ValueError naming the field and value pyengine does not support."""
        method = str(qc.get("quant_method", "")).lower()
        if method not in LINEAR_TENSORS:
            raise ValueError(f"quantization_config: unsupported quant_method {qc.get('quant_method')!r}; "
                             "supported: 'awq', 'gptq' (4-bit)")
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise ValueError(f"quantization_config: bits={bits!r} is not supported ({method}: 4-bit only)")
        group = qc.get("group_size", qc.get("q_group_size"))
        if not isinstance(group, int) or isinstance(group, bool) or (group < 1 and group != -1):
            raise ValueError(f"quantization_config: group_size={group!r} is not a positive int (or -1)")
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"quantization_config: AWQ version={qc.get('version')!r} is not supported "
                                 "(the GEMM packing only)")
            if qc.get("zero_point", True) is not True:
                raise ValueError("quantization_config: AWQ zero_point=False is not supported")
            return cls("awq", group, False)
        if qc.get("desc_act", False):
            raise ValueError("quantization_config: desc_act=True (GPTQ activation order) is not supported")
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization_config: checkpoint_format={qc.get('checkpoint_format')!r} is not "
                             "supported ('gptq', 'gptq_v2')")
        return cls("gptq", group, fmt == "gptq")


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., C] -> the 4-bit levels [..., C, 8], level i from bits 4i."""
    return ((packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 15).to(torch.uint8)


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
    if t.dtype not in dtypes:
        raise ValueError(f"tensor {name!r} has dtype {t.dtype}, expected {' or '.join(map(str, dtypes))}")


def repack_linear(spec: PrequantizedSpec, prefix: str,
                  get: Callable[[str], torch.Tensor | None]) -> QuantizedWeight:
    """The layer `prefix` read through `get(tensor name)` (None: absent) and repacked into Q4_Z
    blocks; its shape [N, K] (nn.Linear's) comes from its levels: AWQ [K, N / 8], GPTQ [K / 8, N].
    ValueError naming the tensor and value on a layout that does not match the config."""
    qweight, qzeros, scales = (get(f"{prefix}.{t}") for t in ("qweight", "qzeros", "scales"))
    for t, v in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        if v is None:
            raise ValueError(f"checkpoint is missing tensor {prefix + '.' + t!r} ({spec.method} layer): a "
                             f"{spec.method} checkpoint stores each linear layer as "
                             f"{', '.join(LINEAR_TENSORS[spec.method])} (or its float weight {prefix}.weight)")
    if qweight.dim() != 2:
        raise ValueError(f"tensor {prefix + '.qweight'!r} has shape {tuple(qweight.shape)}, expected 2 dims")
    n, k = (qweight.shape[1], qweight.shape[0] * 8) if spec.method == "gptq" else \
        (qweight.shape[1] * 8, qweight.shape[0])
    g = k if spec.group_size == -1 else spec.group_size
    if g % 32 or k % g:
        raise ValueError(f"{prefix}: group_size={spec.group_size} must be a multiple of 32 that divides the "
                         f"layer's {k} input features")
    if n % 8:
        raise ValueError(f"{prefix}: {n} output features is not a multiple of 8 (the packing's)")
    ng = k // g
    ints = (torch.int32,)
    _expect(f"{prefix}.scales", scales, (ng, n), (torch.float16,))
    _expect(f"{prefix}.qzeros", qzeros, (ng, n // 8), ints)
    if spec.method == "awq":
        _expect(f"{prefix}.qweight", qweight, (k, n // 8), ints)
        order = torch.tensor(_AWQ_ORDER)
        q_kn = torch.empty((k, n // 8, 8), dtype=torch.uint8)
        q_kn[:, :, order] = _unpack(qweight)
        z = torch.empty((ng, n // 8, 8), dtype=torch.uint8)
        z[:, :, order] = _unpack(qzeros)
        q_kn, z = q_kn.reshape(k, n), z.reshape(ng, n)
    else:
        _expect(f"{prefix}.qweight", qweight, (k // 8, n), ints)
        g_idx = get(f"{prefix}.g_idx")
        if g_idx is not None and not torch.equal(g_idx.to(torch.int64), torch.arange(k) // g):
            raise ValueError(f"tensor {prefix + '.g_idx'!r} is not k // group_size: activation reordering "
                             "(desc_act) is not supported")
        q_kn = _unpack(qweight).permute(0, 2, 1).reshape(k, n)
        z = _unpack(qzeros).reshape(ng, n)
        if spec.zeros_minus_one:
            z = (z + 1) & 15
    # Q4_Z blocks [n, k / 32]: fp16 scale, zero point, pad, 16 bytes of nibbles
    q = q_kn.t().reshape(n, k // 32, 2, 16)
    blocks = torch.empty((n, k // 32, _Q4_Z.block_bytes), dtype=torch.uint8)
    per_block = g // 32
    d = scales.t().contiguous().reshape(-1).view(torch.uint8).reshape(n, ng, 2)
    blocks[:, :, 0:2] = d.repeat_interleave(per_block, dim=1)
    blocks[:, :, 2] = z.t().repeat_interleave(per_block, dim=1)
    blocks[:, :, 3] = 0
    blocks[:, :, 4:] = q[:, :, 0] | (q[:, :, 1] << 4)
    return QuantizedWeight([(_Q4_Z, blocks.reshape(n, -1))], k)


def tensor_getter(files: dict[str, Path], open_file: Callable[[Path], Any]) -> Callable[[str], torch.Tensor | None]:
    """get(name) over a checkpoint's files (name -> file), each file opened once."""
    handles: dict[Path, Any] = {}

    def get(name: str) -> torch.Tensor | None:
        path = files.get(name)
        if path is None:
            return None
        if path not in handles:
            handles[path] = open_file(path)
        return handles[path].get_tensor(name)

    return get


def load_prequantized(model_dir: str | Path, names: list[str], dtype: torch.dtype, optional: tuple[str, ...],
                      spec: PrequantizedSpec, linear_suffixes: tuple[str, ...]) -> dict[str, Any]:
    """The model's tensors `names` from an AWQ / GPTQ checkpoint: each linear layer's weight
    (a name ending in one of `linear_suffixes`) repacked from its quantized tensors (or, where
    the checkpoint kept a layer in float, its float weight), the rest loaded as floats."""
    from pyengine.models.loader import _open, checkpoint_files, load_tensors

    files = checkpoint_files(model_dir)
    linears = [n for n in names if n.endswith(linear_suffixes) and n not in files]
    floats = [n for n in names if n not in linears]
    out = load_tensors(model_dir, floats, dtype, optional, own_memory=True)
    get = tensor_getter(files, _open)
    for name in linears:
        out[name] = repack_linear(spec, name[: -len(".weight")], get)
    return out
