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
                        t = f.get_tensor(n).to(dtype, copy=own_memory)
                    except Exception as e:  # a corrupt file surfaces as one clear error naming it
                        raise _read_error(path, e) from e
                    if convert is not None:
                        bar.update(t.numel())
                        t = convert(n, t)
                    out[n] = t
    finally:
        if bar is not None:
            bar.close()
    return out


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
