"""Quantized weights on a GPU end to end -- quantized at load, from a GGUF file, from AWQ / GPTQ
checkpoints: the weight-only kernels (float activations) give the greedy tokens of transformers
with the same dequantized weights, up to fp32 reordering (a token may differ only where the
reference's top two logits are within 1e-4 of its largest |logit|). Skipped without a CUDA device
(tests/gpu/conftest.py)."""

from __future__ import annotations

import random

import pytest
import torch

from hf_reference import check_greedy_near_reference, quantized_hf_model
from pyengine import Engine, KvCacheConfig, SamplingParams
from pyengine.quant import QuantizedWeight

SHAPE = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, num_layers=2)
REORDER_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def gpu_llama_q_dir(checkpoint_factory):
    return checkpoint_factory("gpu_llama_q", model_type="llama", **SHAPE)


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(4, 48))] for _ in range(n)]


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_k", "q5_k"])
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_quantized_greedy_on_the_gpu_matches_the_dequantized_reference(fmt, cuda_graphs, gpu_llama_q_dir):
    engine = Engine(gpu_llama_q_dir, quantization=fmt, device="cuda", dtype="float32", max_seq_len=128,
                    cuda_graphs=cuda_graphs, kv_cache_config=KvCacheConfig(max_tokens=4096, dtype="float32"))
    layer = engine._runner.model.layers[0]
    assert isinstance(layer["qkv"], QuantizedWeight) and layer["qkv"].device.type == "cuda"
    reference = quantized_hf_model(gpu_llama_q_dir, engine._parts.quant_plan.report, quantize_activations=False)
    check_greedy_near_reference(engine, reference, None, prompts(8), 24, tolerance=REORDER_TOLERANCE)


def test_quantized_bf16_activations_on_the_gpu_generate(gpu_llama_q_dir):
    """bf16 activations through the same kernels (a smoke test: the fp32 test above checks the
    math): every request runs to its length with tokens of the vocabulary."""
    kw = dict(quantization="q4_k", device="cuda", max_seq_len=128)
    bf16 = Engine(gpu_llama_q_dir, dtype="bfloat16", **kw)
    assert bf16._runner.model.layers[0]["qkv"].device.type == "cuda"
    out = bf16.generate(prompts(4), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert all(len(r.token_ids) == 16 and all(0 <= t < 512 for t in r.token_ids) for r in out)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_gguf_file_on_the_gpu_gives_the_tokens_of_quantize_on_load(fmt, gpu_llama_q_dir, tmp_path):
    """A GGUF file holds the blocks quantize-on-load makes (tests/test_gguf.py): on the GPU both
    run the same kernels on the same bytes, so their greedy tokens are equal."""
    pytest.importorskip("gguf")
    from pyengine.testing.gguf_export import export_gguf

    path = export_gguf(gpu_llama_q_dir, tmp_path / f"model-{fmt}.gguf", fmt)
    kw = dict(device="cuda", dtype="float32", max_seq_len=128, kv_cache_config=KvCacheConfig(max_tokens=4096))
    from_file = Engine(path, **kw)
    assert from_file._runner.model.layers[0]["qkv"].device.type == "cuda"
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = [r.token_ids for r in from_file.generate(prompts(6), params, use_tqdm=False)]
    on_load = Engine(gpu_llama_q_dir, quantization=fmt, **kw)
    assert tokens == [r.token_ids for r in on_load.generate(prompts(6), params, use_tqdm=False)]


@pytest.mark.parametrize("method,group_size,sym,checkpoint_format", [("awq", 64, False, "gptq"),
                                                                     ("gptq", 128, True, "gptq_v2")])
def test_awq_gptq_checkpoints_on_the_gpu_match_the_dequantized_reference(method, group_size, sym, checkpoint_format,
                                                                        gpu_llama_q_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from pyengine.testing.prequantized import write_prequantized_checkpoint

    model_dir = tmp_path / method
    dequantized = write_prequantized_checkpoint(gpu_llama_q_dir, model_dir, method, group_size, sym=sym,
                                                checkpoint_format=checkpoint_format)
    engine = Engine(model_dir, device="cuda", dtype="float32", max_seq_len=128,
                    kv_cache_config=KvCacheConfig(max_tokens=4096, dtype="float32"))
    layer = engine._runner.model.layers[0]
    assert isinstance(layer["qkv"], QuantizedWeight) and layer["qkv"].formats == ["q4_z"]
    assert layer["qkv"].device.type == "cuda"
    # the checkpoint's values: fp16 everywhere, the linear layers dequantized (tests/test_prequantized.py)
    reference = AutoModelForCausalLM.from_pretrained(str(gpu_llama_q_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(dequantized[name] if name in dequantized else p.half().float())
    rng = random.Random(1)
    ps = [[rng.randrange(3, 512) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    check_greedy_near_reference(engine, reference, None, ps, 20, tolerance=REORDER_TOLERANCE)
