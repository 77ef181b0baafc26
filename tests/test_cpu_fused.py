"""The fused elementwise CPU kernels (pyengine.layers.elementwise) against the torch operations
they replace in the model, and the all-layers bf16 decode kernel (pyengine.layers.fused_decode) against
the model's Python forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pyengine.core._core as _core
from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig
from pyengine.layers.cpu_features import set_cpu_isa
from pyengine.layers import elementwise as ew
from pyengine.layers.norm import rms_norm
from pyengine.layers.rotary import rotate_half

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# Largest difference from torch in units in the last place. RMSNorm: the sum of squares is added
# in another order, which may move the variance's last bit, so rsqrt by one ulp; in fp32 each of
# the two multiplies after it may add one more (in bf16/fp16 the rounding to 8/11 bits absorbs
# them). SiLU-mul: exp may differ from torch's vectorized one in its last bit.
NORM_ULPS = {torch.float32: 4, torch.bfloat16: 1, torch.float16: 1}
SILU_ULPS = {torch.float32: 2, torch.bfloat16: 1, torch.float16: 1}


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between two same-dtype tensors."""
    bits, mask = (torch.int32, 0x7FFFFFFF) if a.dtype == torch.float32 else (torch.int16, 0x7FFF)
    ia = a.contiguous().view(bits).to(torch.int64)
    ib = b.contiguous().view(bits).to(torch.int64)
    # map sign-magnitude bit patterns to a monotone integer line
    ia = torch.where(ia < 0, -(ia & mask), ia)
    ib = torch.where(ib < 0, -(ib & mask), ib)
    return int((ia - ib).abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 64), (15, 1000), (7, 17)])
def test_rms_norm_matches_transformers_order(dtype, rows, hidden, cpu_isa):
    g = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype)
    assert ulps(ew.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6)) <= NORM_ULPS[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_adds_in_place_then_normalizes(dtype, cpu_isa):
    g = torch.Generator().manual_seed(1)
    x, residual = torch.randn(5, 96, generator=g).to(dtype), torch.randn(5, 96, generator=g).to(dtype)
    w = torch.randn(96, generator=g).to(dtype)
    expected_sum = residual + x
    out = ew.add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(residual, expected_sum)  # the add is exact: same rounding as torch
    assert ulps(out, rms_norm(expected_sum, w, 1e-5)) <= NORM_ULPS[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 9, 64), (4, 3, 64), (15, 2, 128), (2, 1, 6)])
def test_rotary_embedding_equals_torch_bit_for_bit(dtype, tokens, heads, head_dim, cpu_isa):
    g = torch.Generator().manual_seed(tokens + heads)
    fused = torch.randn(tokens, 2 * heads + 1, head_dim, generator=g).to(dtype)  # a view inside rows
    x = fused[:, 1: heads + 1]
    table = torch.randn(50, head_dim, generator=g)
    cos, sin = table.cos().to(dtype), table.sin().to(dtype)
    positions = torch.randint(0, 50, (tokens,), generator=g, dtype=torch.int32)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    expected = x * c + rotate_half(x) * s
    before = fused.clone()
    ew.rotary_embedding_(x, cos, sin, positions)
    assert torch.equal(x, expected)
    assert torch.equal(fused[:, 0], before[:, 0]) and torch.equal(fused[:, heads + 1:], before[:, heads + 1:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_within_an_ulp_or_two(dtype, cpu_isa):
    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(6, 2 * 300, generator=g) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert ulps(ew.silu_mul(gate_up), F.silu(gate) * up) <= SILU_ULPS[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_level_rounds_the_same(dtype):
    """The elementwise kernels are compiled without fused multiply-adds, so every instruction-set
    level gives bit-identical results."""
    g = torch.Generator().manual_seed(5)
    x, residual = (torch.randn(7, 200, generator=g) * 3).to(dtype), torch.randn(7, 200, generator=g).to(dtype)
    w = torch.randn(200, generator=g).to(dtype)
    gate_up = (torch.randn(6, 2 * 300, generator=g) * 4).to(dtype)
    table = torch.randn(50, 64, generator=g)
    cos, sin = table.cos().to(dtype), table.sin().to(dtype)
    q = torch.randn(5, 3, 64, generator=g).to(dtype)
    positions = torch.randint(0, 50, (5,), generator=g, dtype=torch.int32)
    previous = _core._cpu_isa()
    results = {}
    try:
        for level in _core._supported_cpu_isas():
            set_cpu_isa(level)
            res = residual.clone()
            rq = q.clone()
            ew.rotary_embedding_(rq, cos, sin, positions)
            results[level] = (ew.rms_norm(x, w, 1e-6), ew.add_rms_norm(x, res, w, 1e-6), res,
                              ew.silu_mul(gate_up), rq)
    finally:
        set_cpu_isa(previous)
    for level, got in results.items():
        for a, b in zip(got, results["generic"]):
            assert torch.equal(a, b), level


def test_errors_name_the_argument():
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x: dtype torch.float64 is not supported"):
        ew.rms_norm(x.double(), torch.zeros(8, dtype=torch.float64), 1e-6)
    with pytest.raises(ValueError, match="weight: dtype torch.float16 differs"):
        ew.rms_norm(x, torch.zeros(8, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match=r"positions: entry 1 is 9, outside \[0, 4\)"):
        table = torch.zeros(4, 8, dtype=torch.bfloat16)
        ew.rotary_embedding_(x.view(2, 1, 8), table, table, torch.tensor([0, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="gate_up: expected a contiguous"):
        ew.silu_mul(torch.zeros(2, 7, dtype=torch.bfloat16))


PROMPTS = [list(range(3, 40)), [5, 9, 44, 71, 100, 3, 8], [300, 12, 17] * 9, list(range(100, 160))]
SHORT_PROMPTS = [[7, 8, 9], [5, 9, 44, 71, 100, 3, 8], [300, 12], [42] * 5]


def decode_logits(model_dir, cpp: bool, monkeypatch, prompts=PROMPTS, max_num_tokens: int = 256,
                  dtype: str = "bfloat16", **engine_args) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy outputs and the logits of every forward of at most 15 rows, with the C++
    all-layers path or the Python forward (fused elementwise kernels, pyengine's linears)."""
    monkeypatch.setenv("PYENGINE_BF16_MATMUL", "fp32")  # as on a CPU without bf16 instructions
    engine = Engine(model_dir, dtype=dtype, max_seq_len=256, seed=0,
                    kv_cache_config=KvCacheConfig(max_tokens=2048, tokens_per_block=min(16, max_num_tokens)),
                    scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=max_num_tokens),
                    **engine_args)
    runner = engine._runner
    assert (runner.cpu_decode is not None) and (runner.model.emulate_bf16 or runner.model.fast_fp32)
    if not cpp:
        runner.cpu_decode = None
    logits = []
    forward = runner.model.forward

    def recording(input_ids, *args):
        out = forward(input_ids, *args)
        if input_ids.shape[0] <= 15:
            logits.append(out.clone())
        return out

    runner.model.forward = recording
    res = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return [r.token_ids for r in res], logits


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("variant", [dict(model_type="llama", num_heads=4, num_kv_heads=2),
                                     dict(model_type="qwen2", num_heads=4, num_kv_heads=1, tie_word_embeddings=True)])
def test_cpp_decode_layers_equal_the_python_forward_bit_for_bit(checkpoint_factory, monkeypatch, variant, dtype,
                                                                 cpu_isa):
    model_dir = checkpoint_factory(f"fused_{variant['model_type']}", **variant)
    tokens_py, logits_py = decode_logits(model_dir, cpp=False, monkeypatch=monkeypatch, dtype=dtype)
    tokens_cpp, logits_cpp = decode_logits(model_dir, cpp=True, monkeypatch=monkeypatch, dtype=dtype)
    assert tokens_cpp == tokens_py
    assert len(logits_cpp) == len(logits_py) > 10
    for a, b in zip(logits_cpp, logits_py):
        assert torch.equal(a, b)  # the same kernels in the same order


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_k"])
@pytest.mark.parametrize("variant", [dict(model_type="llama", num_heads=4, num_kv_heads=2),
                                     dict(model_type="qwen2", num_heads=4, num_kv_heads=1, tie_word_embeddings=True)])
def test_cpp_decode_layers_with_quantized_weights_equal_the_python_forward(checkpoint_factory, monkeypatch, variant,
                                                                          fmt, cpu_isa):
    """Quantized linears (QuantLinearDesc records; Q4_0 and Q4_K interleaved, Q6_K the tied
    output's) in the one-call path on a float16 cache (quantized models' default), prompts in
    chunks of up to 8 rows next to decode rows: the same kernels in the same order as the Python
    forward."""
    if fmt == "q4_k":  # rows of 256 weights: Q4_K and Q6_K themselves, not their fallbacks
        variant = dict(variant, hidden_size=256, intermediate_size=512)
    name = f"fused_{variant['model_type']}" + (f"_{variant['hidden_size']}" if "hidden_size" in variant else "")
    model_dir = checkpoint_factory(name, **variant)
    args = dict(dtype="float32", quantization=fmt, max_num_tokens=8, prompts=SHORT_PROMPTS)
    tokens_py, logits_py = decode_logits(model_dir, False, monkeypatch, **args)
    tokens_cpp, logits_cpp = decode_logits(model_dir, True, monkeypatch, **args)
    assert tokens_cpp == tokens_py
    assert len(logits_cpp) == len(logits_py) > 10
    for a, b in zip(logits_cpp, logits_py):
        assert torch.equal(a, b)


def test_cpp_layers_take_short_prefills_mixed_with_decode_rows(checkpoint_factory, monkeypatch):
    # 8-token budget: prompts arrive in chunks of <= 8 rows next to decode rows, all through
    # the C++ path (prefill attention included), bit for bit as the Python forward.
    model_dir = checkpoint_factory("fused_llama", model_type="llama", num_heads=4, num_kv_heads=2)
    tokens_py, logits_py = decode_logits(model_dir, False, monkeypatch, SHORT_PROMPTS, max_num_tokens=8)
    tokens_cpp, logits_cpp = decode_logits(model_dir, True, monkeypatch, SHORT_PROMPTS, max_num_tokens=8)
    assert tokens_cpp == tokens_py
    assert len(logits_cpp) == len(logits_py)
    for a, b in zip(logits_cpp, logits_py):
        assert torch.equal(a, b)


def test_cpp_decode_layers_with_qk_norm_stay_close(checkpoint_factory, monkeypatch):
    # Qwen3's per-head q/k norms: the C++ path uses pyengine's RMSNorm kernel where the Python
    # forward uses torch's (one ulp apart at most), so the logits are close, not identical.
    model_dir = checkpoint_factory("fused_qwen3", model_type="qwen3", num_heads=4, num_kv_heads=2, head_dim=32)
    tokens_py, logits_py = decode_logits(model_dir, cpp=False, monkeypatch=monkeypatch)
    tokens_cpp, logits_cpp = decode_logits(model_dir, cpp=True, monkeypatch=monkeypatch)
    assert tokens_cpp == tokens_py
    for a, b in zip(logits_cpp, logits_py):
        assert torch.allclose(a, b, atol=0.05, rtol=0.02)
