"""Quantize-on-load end to end: Engine(hf_dir, quantization=...) against transformers running
the same quantized weights and the same 8-bit activation blocks, the per-tensor format plan,
and bad input."""

from __future__ import annotations

import random

import pytest
import torch

from hf_reference import check_greedy_near_reference, quantized_hf_model
import pyengine.core._core as _core
from pyengine import Engine, KvCacheConfig, SamplingParams, StartupError
from pyengine.cli import num_parameters
from pyengine.quant import QuantizedWeight

# hidden and intermediate sizes multiples of 256: every format applies to every linear layer
SHAPE = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, num_layers=2)


@pytest.fixture(scope="module")
def llama_q_dir(checkpoint_factory):
    return checkpoint_factory("llama_q", model_type="llama", **SHAPE)


@pytest.fixture(scope="module")
def qwen3_tied_dir(checkpoint_factory):
    return checkpoint_factory("qwen3_tied", model_type="qwen3", tie_word_embeddings=True, head_dim=64, **SHAPE)


def prompts(n: int, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(4, 48))] for _ in range(n)]


# The reference keeps K and V in float32: so must the engines checked against it (by default a
# quantized model's cache is float16, whose rounding the reference does not model).
FP32_KV = KvCacheConfig(dtype="float32")


def check_greedy_against_reference(engine: Engine, model_dir) -> None:
    """Greedy outputs, teacher-forced through transformers with the same quantized weights and
    activation blocks: the two differ only in the order of fp32 additions, which can move an
    activation across a rounding boundary of its 8-bit grid. A token may therefore differ from the
    reference's argmax only where the gap is within what the activation quantization as a whole
    moves the logits at that position (bugs move them by far more), and rarely. Where the kernels
    have their AMX path, the reference computes the prompts as it does (8 prompts prefilled in one
    step, then 8 rows a decode step: under the path's 16)."""
    report = engine._parts.quant_plan.report
    reference = quantized_hf_model(model_dir, report, amx_prompt=_core._cpu_amx())
    float_acts = quantized_hf_model(model_dir, report, quantize_activations=False)
    check_greedy_near_reference(engine, reference, float_acts, prompts(8), 24)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_k", "q5_k", "q5_1"])
def test_quantized_greedy_matches_transformers_with_the_same_quantization(fmt, llama_q_dir, quant_cpu_isa):
    engine = Engine(llama_q_dir, quantization=fmt, kv_cache_config=FP32_KV)
    check_greedy_against_reference(engine, llama_q_dir)


def test_quantized_tied_qwen3(qwen3_tied_dir):
    engine = Engine(qwen3_tied_dir, quantization="q4_k", kv_cache_config=FP32_KV)
    model = engine._runner.model
    assert model.lm_head is model.embed and model.embed.formats == ["q6_k"]
    check_greedy_against_reference(engine, qwen3_tied_dir)


def test_lm_head_quantization_chooses_the_output_projections_format(llama_q_dir):
    """In place of llama.cpp's Q6_K (llama-quantize's --output-tensor-type): the output projection
    only, a separate input table keeps the format asked for; the tokens match transformers' with
    the same per-tensor formats."""
    engine = Engine(llama_q_dir, quantization="q4_k", lm_head_quantization="Q4_0", kv_cache_config=FP32_KV)
    report = engine._parts.quant_plan.report
    assert report["lm_head.weight"] == "q4_0"
    assert report["model.embed_tokens.weight"] == "q4_k"
    assert report["model.layers.1.mlp.down_proj.weight"] == "q4_k"
    assert engine._runner.model.lm_head.formats == ["q4_0"]
    check_greedy_against_reference(engine, llama_q_dir)


def test_startup_report_says_what_the_weights_are(llama_q_dir):
    """startup_report()["weights"]: where they came from, their bytes by format as the model holds
    them (each tensor once; Q4_K in its interleaved layout, 148 bytes a block of 256), the output
    projection's format, and the plan of quantize-on-load."""
    engine = Engine(llama_q_dir, quantization="q4_k", lm_head_quantization="q4_0")
    weights = engine.startup_report()["weights"]
    model = engine._runner.model
    assert weights["source"] == "quantized at load" and weights["output_projection"] == "q4_0"
    assert weights["plan"] == engine._parts.quant_plan.report and weights["plan"]["lm_head.weight"] == "q4_0"
    layers = sum(w.nbytes for layer in model.layers for k, w in layer.items() if isinstance(w, QuantizedWeight))
    norms = sum(w.numel() * 4 for layer in model.layers for w in layer.values() if isinstance(w, torch.Tensor))
    assert weights["bytes_by_format"] == {"q4_k": model.embed.nbytes + layers, "q4_0": model.lm_head.nbytes,
                                          "float32": norms + model.norm.numel() * 4}
    assert layers == 2 * (512 + 256 + 1024 + 256 * 2) * 148  # SHAPE: (rows x blocks of 256) a layer
    engine.shutdown()
    float_engine = Engine(llama_q_dir)
    weights = float_engine.startup_report()["weights"]
    assert weights == {"source": "checkpoint", "output_projection": "float32", "plan": None,
                       "bytes_by_format": {"float32": 4 * num_parameters(llama_q_dir)}}  # (untied: each once)
    float_engine.shutdown()


def test_lm_head_quantization_of_a_tied_table(qwen3_tied_dir):
    engine = Engine(qwen3_tied_dir, quantization="q4_k", lm_head_quantization="q8_0", kv_cache_config=FP32_KV)
    model = engine._runner.model
    assert model.lm_head is model.embed and model.embed.formats == ["q8_0"]
    check_greedy_against_reference(engine, qwen3_tied_dir)


def test_lm_head_quantization_falls_back_where_the_rows_do_not_fit(checkpoint_factory):
    odd = checkpoint_factory("llama_q96", model_type="llama", hidden_size=96, intermediate_size=512,
                             num_heads=4, num_kv_heads=2, num_layers=2)
    engine = Engine(odd, quantization="q8_0", lm_head_quantization="q4_k")
    assert engine._parts.quant_plan.report["lm_head.weight"] == "q5_0 (rows of 96 weights)"
    engine.shutdown()


def test_quantized_models_keep_a_float16_cache_by_default(llama_q_dir):
    """KvCacheConfig(dtype="auto") with quantized weights: K and V in float16 (llama.cpp's
    default), activations in float32; asked for, float32; a float model's stays its dtype.
    (test_cpu_fused checks the one-call decode path against the layer-by-layer one on such a
    cache.)"""
    engine = Engine(llama_q_dir, quantization="q4_0", max_seq_len=128)
    assert engine.kv_dtype == torch.float16 and engine._runner.kv_pool.dtype == torch.float16
    ps = prompts(4)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    out = [r.token_ids for r in engine.generate(ps, params, use_tqdm=False)]
    assert all(len(t) == 16 for t in out)
    stats = engine.stats()  # every slot and KV block back in its pool
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_free_slots"] == stats["num_slots"]
    fp32 = Engine(llama_q_dir, quantization="q4_0", max_seq_len=128, kv_cache_config=FP32_KV)
    assert fp32.kv_dtype == torch.float32
    float_model = Engine(llama_q_dir, dtype="float32", max_seq_len=128)
    assert float_model.kv_dtype == torch.float32


def test_plan_follows_llama_cpp_rules(checkpoint_factory, llama_q_dir):
    engine = Engine(llama_q_dir, quantization="q4_0")
    report = engine._parts.quant_plan.report
    assert report["lm_head.weight"] == "q6_k"  # the output projection: Q6_K
    assert report["model.embed_tokens.weight"] == "q4_0"  # a separate input table: the format asked for
    assert all(report[f"model.layers.{i}.{n}"] == "q4_0" for i in range(2)
               for n in ("self_attn.q_proj.weight", "mlp.down_proj.weight"))
    assert "model.norm.weight" not in report  # norms stay float
    layer = engine._runner.model.layers[0]
    assert isinstance(layer["qkv"], QuantizedWeight) and layer["qkv"].formats == ["q4_0"]
    assert layer["qkv"].shape == (256 + 2 * 128, 256)
    assert isinstance(layer["input_norm"], torch.Tensor) and layer["input_norm"].dtype == torch.float32
    engine.shutdown()

    # rows of 96 weights fit no K-quant: llama.cpp's fallbacks, Q5_0 for Q4_K and Q8_0 for the
    # output projection's Q6_K; the MLP's down projection (rows of 512) keeps Q4_K
    odd = checkpoint_factory("llama_q96", model_type="llama", hidden_size=96, intermediate_size=512,
                             num_heads=4, num_kv_heads=2, num_layers=2)
    engine = Engine(odd, quantization="q4_k")
    report = engine._parts.quant_plan.report
    assert report["model.layers.0.self_attn.q_proj.weight"] == "q5_0 (rows of 96 weights)"
    assert report["model.layers.0.mlp.down_proj.weight"] == "q4_k"
    assert report["lm_head.weight"] == "q8_0"
    assert report["model.embed_tokens.weight"] == "q5_0"
    assert engine._parts.quant_plan.summary() == {"q5_0": 13, "q8_0": 1, "q4_k": 2}
    engine.shutdown()
    engine = Engine(odd, quantization="q5_k")  # Q5_K falls back to Q5_1
    report = engine._parts.quant_plan.report
    assert report["model.layers.0.self_attn.q_proj.weight"] == "q5_1 (rows of 96 weights)"
    assert report["model.layers.0.mlp.down_proj.weight"] == "q5_k"
    assert engine._parts.quant_plan.summary() == {"q5_1": 13, "q8_0": 1, "q5_k": 2}
    engine.shutdown()


def test_quantize_lm_head_false_keeps_embeddings_float(llama_q_dir):
    engine = Engine(llama_q_dir, quantization="q8_0", quantize_lm_head=False)
    model = engine._runner.model
    assert isinstance(model.embed, torch.Tensor) and isinstance(model.lm_head, torch.Tensor)
    assert isinstance(model.layers[1]["down"], QuantizedWeight)
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert len(out[0].token_ids) == 4


def test_no_float_copy_of_quantized_weights(llama_q_dir):
    """The model holds the blocks only: its weight bytes are those of the formats, in the layouts
    the kernels read (Q4_K interleaved: 148 bytes per 256 weights, its 6-bit scales unpacked;
    Q6_K interleaved: 210, as in the file)."""
    engine = Engine(llama_q_dir, quantization="q4_k")
    model = engine._runner.model
    per_layer = {"qkv": (512, 256), "o": (256, 256), "gate_up": (1024, 256), "down": (256, 512)}
    for layer in model.layers:
        for name, (n, k) in per_layer.items():
            assert isinstance(layer[name], QuantizedWeight) and layer[name].layouts == ["q4_kx8"]
            assert layer[name].nbytes == n * k // 256 * 148
    assert model.lm_head.layouts == ["q6_kx8"] and model.lm_head.nbytes == 512 * 256 // 256 * 210


@pytest.mark.parametrize("kwargs,phase,message", [
    (dict(quantization="q4_1"), "config",
     "unsupported quantization format 'q4_1'; supported: q8_0, q5_0, q5_1, q4_0, q4_k, q5_k, q6_k, q4_z; or a "
     "mixture: q4_k_s, q4_k_m, q5_k_s, q5_k_m"),
    (dict(quantization="q4_0", dtype="bfloat16"), "config",
     "quantization='q4_0' computes with float32 activations on the CPU: dtype must be 'float32', got torch.bfloat16"),
    (dict(quantization="q4_0", quantize_lm_head="yes"), "config", "quantize_lm_head must be a bool, got 'yes'"),
    (dict(quantize_lm_head=False), "config",
     "quantize_lm_head=False needs quantization=: it keeps the embedding table and lm_head of a model quantized at "
     "load in float"),
    (dict(lm_head_quantization="q4_0"), "config",
     "lm_head_quantization='q4_0' needs quantization=: it chooses the output projection's format"),
    (dict(quantization="q4_0", quantize_lm_head=False, lm_head_quantization="q8_0"), "config",
     "lm_head_quantization='q8_0' and quantize_lm_head=False exclude each other"),
    (dict(quantization="q4_0", lm_head_quantization="q4_1"), "config",
     "lm_head_quantization: unsupported quantization format 'q4_1'; supported: q8_0, q5_0, q5_1, q4_0, q4_k, q5_k, "
     "q6_k, q4_z"),
])
def test_bad_quantization_arguments(llama_q_dir, kwargs, phase, message):
    with pytest.raises(StartupError) as e:
        Engine(llama_q_dir, **kwargs)
    assert e.value.phase == phase
    assert message in str(e.value)


def _resident_kib(path_fragment: str) -> int:
    """Resident KiB of this process's memory maps of files whose path contains `path_fragment`."""
    total, current = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
                current = fields[5] if len(fields) > 5 else None
            elif fields[0] == "Rss:" and current is not None and path_fragment in current:
                total += int(fields[1])
    return total


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_the_float_checkpoint_is_not_kept_mapped(llama_q_dir):
    """After a quantized load nothing views the float checkpoint's memory map, so its pages are
    not resident next to the quantized weights (process RSS ~ quantized weights + KV pool)."""
    engine = Engine(llama_q_dir, quantization="q4_0")
    assert _resident_kib(str(llama_q_dir)) == 0
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert len(out[0].token_ids) == 2


@pytest.mark.parametrize("mixture,base", [("Q4_K_M", "q4_k"), ("q5_k_m", "q5_k")])
def test_k_m_mixtures_are_llama_cpps(checkpoint_factory, mixture, base):
    """q4_k_m / q5_k_m: Q4_K / Q5_K, with the v and down projections of llama.cpp's use_more_bits
    layers (the first and last eighth, every third between: 0, 3, 6, 7 of 8) in Q6_K, the output
    projection Q6_K. (Checked against llama-quantize's Q4_K_M file of such a model: the same
    bytes; test_gguf_llamacpp compares llama-quantize's Q5_K_M file's tokens.)"""
    model_dir = checkpoint_factory("llama_q_8layers", model_type="llama", hidden_size=256, intermediate_size=512,
                                   num_heads=4, num_kv_heads=2, num_layers=8)
    engine = Engine(model_dir, quantization=mixture, kv_cache_config=FP32_KV)
    report = engine._parts.quant_plan.report
    more = {0, 3, 6, 7}
    for i in range(8):
        wide = "q6_k" if i in more else base
        assert report[f"model.layers.{i}.self_attn.v_proj.weight"] == wide
        assert report[f"model.layers.{i}.mlp.down_proj.weight"] == wide
        assert report[f"model.layers.{i}.self_attn.q_proj.weight"] == base
        assert engine._runner.model.layers[i]["qkv"].formats == ([base, "q6_k"] if i in more else [base])
    assert report["lm_head.weight"] == "q6_k"
    check_greedy_against_reference(engine, model_dir)


def test_q4_k_s_is_llama_cpps_mixture(checkpoint_factory):
    """q4_k_s: Q4_K, with the v projections of the first 4 layers and the down projections of the
    first eighth (layer 0 of 8) in Q5_K, the output projection Q6_K; q5_k_s is q5_k.
    (test_gguf_llamacpp compares llama-quantize's Q4_K_S and Q5_K_S files byte for byte.)"""
    model_dir = checkpoint_factory("llama_q_8layers", model_type="llama", hidden_size=256, intermediate_size=512,
                                   num_heads=4, num_kv_heads=2, num_layers=8)
    engine = Engine(model_dir, quantization="q4_k_s", kv_cache_config=FP32_KV)
    report = engine._parts.quant_plan.report
    for i in range(8):
        assert report[f"model.layers.{i}.self_attn.v_proj.weight"] == ("q5_k" if i < 4 else "q4_k")
        assert report[f"model.layers.{i}.mlp.down_proj.weight"] == ("q5_k" if i == 0 else "q4_k")
        assert report[f"model.layers.{i}.self_attn.k_proj.weight"] == "q4_k"
    assert report["lm_head.weight"] == "q6_k"
    check_greedy_against_reference(engine, model_dir)
    engine.shutdown()
    q5_k_s = Engine(model_dir, quantization="Q5_K_S")._parts.quant_plan.report
    assert q5_k_s == Engine(model_dir, quantization="q5_k")._parts.quant_plan.report
