"""AWQ and GPTQ checkpoints (written in the published packings by
pyengine.testing.prequantized) load into Q4_Z blocks and generate as transformers does with the
same dequantized weights and the same 8-bit activation blocks; bad quantization configs and
layouts fail at start-up naming the field or tensor."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hf_reference import _fake_quantize, check_greedy_near_reference
from pyengine import Engine, KvCacheConfig, StartupError
from pyengine.quant import QuantizedWeight
from pyengine.testing.prequantized import write_prequantized_checkpoint

SHAPE = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, num_layers=2)
VARIANTS = {  # name: (method, group_size, sym, checkpoint_format)
    "awq_g64": ("awq", 64, False, "gptq"),
    "gptq_g128_v1": ("gptq", 128, False, "gptq"),
    "gptq_sym_row_v2": ("gptq", -1, True, "gptq_v2"),
}


@pytest.fixture(scope="module")
def float_dir(checkpoint_factory):
    return checkpoint_factory("llama_prequant_src", model_type="llama", **SHAPE)


@pytest.fixture(scope="module")
def prequantized(float_dir, tmp_path_factory):
    """name -> (checkpoint dir, the linear layers' dequantized weights)."""
    out = {}
    for name, (method, g, sym, fmt) in VARIANTS.items():
        d = tmp_path_factory.mktemp(name)
        out[name] = (d, write_prequantized_checkpoint(float_dir, d, method, g, sym=sym, checkpoint_format=fmt))
    return out


def reference_models(float_dir, dequantized):
    """transformers' model with the checkpoint's values (fp16 everywhere, the linear layers
    dequantized), with and without the 8-bit activation blocks in front of those layers."""
    models = []
    for quantize_activations in (True, False):
        model = AutoModelForCausalLM.from_pretrained(str(float_dir), dtype=torch.float32).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(dequantized[name] if name in dequantized else p.half().float())
        if quantize_activations:
            for name in dequantized:
                module = model.get_submodule(name[: -len(".weight")])
                module.register_forward_pre_hook(lambda m, args: (_fake_quantize(args[0], 32),))
        models.append(model)
    return models


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prequantized_greedy_matches_transformers(variant, float_dir, prequantized):
    model_dir, dequantized = prequantized[variant]
    engine = Engine(model_dir, kv_cache_config=KvCacheConfig(dtype="float32"))  # as the reference keeps K, V
    assert Engine(model_dir, max_seq_len=64).kv_dtype == torch.float16  # the default for quantized weights
    layer = engine._runner.model.layers[0]
    assert isinstance(layer["qkv"], QuantizedWeight) and layer["qkv"].formats == ["q4_z"]
    weights = engine.startup_report()["weights"]
    assert weights["source"] == VARIANTS[variant][0] and weights["plan"] is None
    assert set(weights["bytes_by_format"]) == {"q4_z", "float32"}  # the embeddings and lm_head stay float
    # the repacked blocks hold exactly the checkpoint's (q - z) * s
    assert torch.equal(layer["down"].dequantize(), dequantized["model.layers.0.mlp.down_proj.weight"])
    reference, float_acts = reference_models(float_dir, dequantized)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    check_greedy_near_reference(engine, reference, float_acts, prompts, 20)


def _edit(src, dst, config_change=None, tensor_change=None):
    shutil.copytree(src, dst)
    if config_change:
        cfg = json.loads((dst / "config.json").read_text())
        config_change(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensor_change:
        tensors = load_file(str(dst / "model.safetensors"))
        tensor_change(tensors)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("change,phase,message", [
    (dict(config_change=lambda q: q.update(bits=8)), "config",
     "quantization_config: bits=8 is not supported (awq: 4-bit only)"),
    (dict(config_change=lambda q: q.update(version="gemv")), "config",
     "quantization_config: AWQ version='gemv' is not supported (the GEMM packing only)"),
    (dict(config_change=lambda q: q.update(quant_method="bitsandbytes")), "config",
     "quantization_config: unsupported quant_method 'bitsandbytes'; supported: 'awq', 'gptq' (4-bit)"),
    (dict(config_change=lambda q: q.update(group_size=48)), "weights",
     "model.layers.0.self_attn.q_proj: group_size=48 must be a multiple of 32 that divides the layer's 256 input features"),
    (dict(tensor_change=lambda t: t.pop("model.layers.1.mlp.up_proj.qzeros")), "weights",
     "checkpoint is missing tensor 'model.layers.1.mlp.up_proj.qzeros' (awq layer)"),
    (dict(tensor_change=lambda t: t.update({"model.layers.0.mlp.down_proj.scales":
                                            t["model.layers.0.mlp.down_proj.scales"][:, :128].contiguous()})),
     "weights", "tensor 'model.layers.0.mlp.down_proj.scales' has shape (8, 128), expected (8, 256)"),
])
def test_bad_awq_checkpoints(prequantized, tmp_path, change, phase, message):
    bad = _edit(prequantized["awq_g64"][0], tmp_path / "bad", **change)
    with pytest.raises(StartupError) as e:
        Engine(bad)
    assert e.value.phase == phase
    assert message in str(e.value)


def test_bad_gptq_checkpoints(prequantized, tmp_path):
    src = prequantized["gptq_g128_v1"][0]
    bad = _edit(src, tmp_path / "desc_act", config_change=lambda q: q.update(desc_act=True))
    with pytest.raises(StartupError, match=r"desc_act=True \(GPTQ activation order\) is not supported") as e:
        Engine(bad)
    assert e.value.phase == "config"

    def shuffle(t):
        t["model.layers.0.self_attn.o_proj.g_idx"] = t["model.layers.0.self_attn.o_proj.g_idx"].flip(0).contiguous()
    bad = _edit(src, tmp_path / "g_idx", tensor_change=shuffle)
    with pytest.raises(StartupError, match=r"tensor 'model.layers.0.self_attn.o_proj.g_idx' is not k // group_size"):
        Engine(bad)
    with pytest.raises(StartupError, match=r"quantization='q4_0': the checkpoint is already quantized \(gptq\)"):
        Engine(src, quantization="q4_0")
