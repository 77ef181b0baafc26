"""Reads weights from a local Hugging Face directory: single or sharded safetensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Maps each tensor name to the safetensors file that holds it."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"malformed {index}: {e!r}") from None
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise FileNotFoundError(f"{index} names shard {f.name!r}, which does not exist")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        try:
            with safe_open(str(single), framework="pt") as f:
                return {name: single for name in f.keys()}
        except Exception as e:
            raise _read_error(single, e) from e
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in model directory {str(model_dir)!r}")


# Loading shows a progress bar when converting (quantizing) at least this many weights.
PROGRESS_MIN_ELEMENTS = 500_000_000


def load_tensors(model_dir: str | Path, names: list[str], dtype: torch.dtype,
                 optional: tuple[str, ...] = (),
                 convert: Callable[[str, torch.Tensor], Any] | None = None,
                 own_memory: bool = False) -> dict[str, Any]:
    """Loads the named tensors converted to `dtype`, then through `convert(name, tensor)` if given
    (one tensor at a time, so a quantized model never holds all its float weights at once). With
    `own_memory` every tensor is a copy, never a view of the file's memory map (which would keep
    the file's pages resident). A missing required name raises ValueError."""
    files = checkpoint_files(model_dir)
    missing = [n for n in names if n not in files and n not in optional]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"checkpoint {str(model_dir)!r} is missing tensor {missing[0]!r}{more}")
    by_file: dict[Path, list[str]] = {}
    for n in names:
        if n in files:
            by_file.setdefault(files[n], []).append(n)
    out: dict[str, Any] = {}
    bar = None
    if convert is not None:
        total = _count_elements(by_file)
        bar = tqdm(total=total, unit="weights", unit_scale=True, desc="quantizing", leave=False,
                   disable=total < PROGRESS_MIN_ELEMENTS)
    try:
        for path, wanted in by_file.items():
            with _open(path) as f:
                for n in wanted:
                    try:
                        raw = f.get_tensor(n)
                    except Exception as e:  # a corrupt file surfaces as one clear error naming it
                        raise _read_error(path, e) from e
                    check_float_tensor(n, raw, path)
                    t = raw.to(dtype, copy=own_memory)
                    del raw
                    if convert is not None:
                        bar.update(t.numel())
                        t = convert(n, t)
                    out[n] = t
    finally:
        if bar is not None:
            bar.close()
    return out


# Floating types a checkpoint's weights may be stored in (converted to the engine's dtype).
FLOAT_STORAGE = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_FINITE_CHUNK = 1 << 24  # elements per aminmax pass (a NaN or Inf found: isfinite on that chunk only)


def check_float_tensor(name: str, t: torch.Tensor, path: Path) -> None:
    """A weight must be stored in a floating type and hold finite values: an integer tensor
    where a weight belongs, or NaN/Inf (what garbage bytes in a damaged file usually decode
    to), is a ValueError naming the tensor and the file -- not a model that loads and then
    produces nonsense."""
    if t.dtype not in FLOAT_STORAGE:
        raise ValueError(f"tensor {name!r} in {str(path)!r} has dtype {str(t.dtype).replace('torch.', '')}, "
                         f"expected a floating-point type (float32, bfloat16, float16)")
    flat = t.reshape(-1)
    for start in range(0, flat.numel(), _FINITE_CHUNK):
        part = flat[start:start + _FINITE_CHUNK]
        lo, hi = torch.aminmax(part)  # NaN propagates, an Inf is an extreme: ~10x faster than isfinite
        if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
            at = start + int(torch.nonzero(~torch.isfinite(part))[0])
            raise ValueError(f"tensor {name!r} in {str(path)!r} holds a non-finite value ({float(flat[at])} at "
                             f"flat index {at}): the file may be corrupt (an interrupted download or copy?)")


def _open(path: Path):
    """safe_open(path), a failure surfacing as one clear error naming the file."""
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:
        raise _read_error(path, e) from e


def _count_elements(by_file: dict[Path, list[str]]) -> int:
    """Elements of the named tensors, from the files' headers (nothing loaded)."""
    total = 0
    for path, wanted in by_file.items():
        with _open(path) as f:
            for n in wanted:
                try:
                    shape = f.get_slice(n).get_shape()
                except Exception as e:
                    raise _read_error(path, e) from e
                count = 1
                for d in shape:
                    count *= d
                total += count
    return total


def _read_error(path: Path, e: Exception) -> ValueError:
    """A ValueError naming the safetensors file that could not be read, and why."""
    hint = ""
    if type(e).__name__ == "SafetensorError":  # the header, or the sizes it lists, do not match the file
        try:
            size = f", {path.stat().st_size} bytes,"
        except OSError:
            size = ""
        hint = f" (the file{size} may be truncated or corrupt: an interrupted download or copy?)"
    return ValueError(f"cannot read {str(path)!r}: {e}{hint}")
