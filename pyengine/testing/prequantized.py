"""AWQ and GPTQ checkpoints written from a float checkpoint, in the published packings (see
pyengine/quant/prequantized.py), by plain round-to-nearest per group (no calibration): real
files for tests and benchmarks, made without the quantization libraries."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

__all__ = ["write_prequantized_checkpoint"]

_LINEARS = tuple(f"self_attn.{p}_proj.weight" for p in "qkvo") + tuple(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _quantize(w: torch.Tensor, g: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> levels q [N, K] (0..15), zero points z [N, K / g] and fp16 scales s [N, K / g]
    with w ~= (q - z) * s."""
    n, k = w.shape
    groups = w.float().reshape(n, k // g, g)
    if sym:
        amax = groups.abs().amax(-1)
        s = (2 * amax / 15).half()
        z = torch.full_like(amax, 8, dtype=torch.int64)
    else:
        lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        s = ((hi - lo) / 15).half()
        sf = s.float()
        z = torch.where(sf > 0, torch.round(-lo / torch.where(sf > 0, sf, 1)), torch.zeros_like(sf)).clamp(0, 15)
        z = z.to(torch.int64)
    sf = s.float()[..., None]
    q = torch.where(sf > 0, torch.round(groups / torch.where(sf > 0, sf, 1)), torch.zeros_like(groups))
    q = (q + z[..., None]).clamp(0, 15).to(torch.int64)
    return q.reshape(n, k), z, s


def _pack(levels: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int levels [R, C] (C a multiple of 8) -> int32 [R, C / 8], level of column 8c + order[i] at bits 4i."""
    r, c = levels.shape
    grouped = levels.reshape(r, c // 8, 8)
    packed = torch.zeros((r, c // 8), dtype=torch.int64)
    for i, col in enumerate(order):
        packed |= (grouped[:, :, col] & 15) << (4 * i)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the int32 bit pattern


def write_prequantized_checkpoint(src: str | Path, dst: str | Path, method: str = "awq", group_size: int = 64,
                                  sym: bool = False, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """Writes `src` (a float Hugging Face checkpoint, one safetensors file) to `dst` as an AWQ
    (GEMM packing) or GPTQ (`checkpoint_format` "gptq": zero points stored minus one; "gptq_v2")
    checkpoint: every decoder linear layer 4-bit with groups of `group_size` along the input
    features (symmetric with zero point 8 if `sym`), everything else fp16. Returns the linear
    layers' dequantized fp32 weights, (q - z) * s, by weight name."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not name.endswith(_LINEARS):
            out[name] = t.half()
            continue
        prefix = name[: -len(".weight")]
        n, k = t.shape
        g = k if group_size == -1 else group_size
        q, z, s = _quantize(t, g, sym)
        dequantized[name] = ((q - z.repeat_interleave(g, dim=1)) * s.float().repeat_interleave(g, dim=1)).float()
        out[prefix + ".scales"] = s.t().contiguous()                      # [K / g, N]
        if method == "awq":
            out[prefix + ".qweight"] = _pack(q.t().contiguous(), _AWQ_ORDER)   # [K, N / 8]
            out[prefix + ".qzeros"] = _pack(z.t().contiguous(), _AWQ_ORDER)    # [K / g, N / 8]
        else:
            seq = tuple(range(8))
            out[prefix + ".qweight"] = _pack(q.contiguous(), seq).t().contiguous()  # [K / 8, N]
            stored = z - 1 if checkpoint_format == "gptq" else z
            out[prefix + ".qzeros"] = _pack(stored.t().contiguous(), seq)          # [K / g, N / 8]
            out[prefix + ".g_idx"] = (torch.arange(k) // g).to(torch.int32)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if method == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                         "zero_point": True, "version": "gemm"}
    else:
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                                         "desc_act": False, "sym": sym, "checkpoint_format": checkpoint_format}
    config["torch_dtype"] = config["dtype"] = "float16"
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, dst / f.name)
    return dequantized
