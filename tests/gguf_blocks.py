"""A GGUF file's weights against the blocks quantize-on-load makes of the checkpoint it came from
(shared by the tests of pyengine's own GGUF writer and of llama.cpp's tools)."""

from __future__ import annotations

from pathlib import Path

import torch

from pyengine.gguf import load_weights, model_config, read_header
from pyengine.models import LlamaFamilyModel
from pyengine.models.loader import load_tensors
from pyengine.quant import QuantizedWeight
from pyengine.quant.on_load import QuantPlan


def assert_file_holds_quantize_on_load_blocks(path: Path, model_dir: Path, method: str) -> set[str]:
    """Every tensor of the GGUF file at `path` loads with the type and, byte for byte, the blocks
    (llama's q/k rows un-permuted inside their blocks) that Engine(model_dir, quantization=method)
    makes; returns the formats seen."""
    header = read_header(path)
    config = model_config(header)
    names, optional = LlamaFamilyModel.weight_names(config)
    ours = load_weights(header, config, names, torch.float32, optional)
    plan = QuantPlan.create(method, config.tie_word_embeddings, num_layers=config.num_layers)
    theirs = load_tensors(model_dir, names, torch.float32, optional, convert=plan.convert)
    assert ours.keys() == theirs.keys()
    seen: set[str] = set()
    for name, w in theirs.items():
        if isinstance(w, QuantizedWeight):
            assert isinstance(ours[name], QuantizedWeight) and ours[name].formats == w.formats, name
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(ours[name].parts, w.parts)), name
            seen.update(w.formats)
        else:
            assert torch.equal(ours[name], w), name
    return seen
