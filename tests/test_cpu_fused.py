"""The fused elementwise CPU kernels (pyengine.layers.elementwise) against the torch operations
they replace in the model, and the all-layers bf16 decode kernel (pyengine.layers.fused_decode) against
the model's Python forward."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import pyengine.core._core as _core
from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig
from pyengine.layers.cpu_features import set_cpu_isa
from pyengine.layers.linear import GEMM_MIN_ROWS
from pyengine.layers import elementwise as ew
from pyengine.layers import fused_decode
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


# Gates at both ends of exp's range: e^-g overflows to inf (g < ~-88.7), underflows through the
# denormals to 0 (g > ~87.3), and inf, NaN and signed zeros.
SILU_EDGES = [-1e30, -120.0, -104.0, -95.0, -89.0, -88.7, -88.5, -87.0, -80.0, -1e-30, -0.0, 0.0, 1e-30, 80.0,
              87.0, 87.5, 88.5, 89.0, 95.0, 103.0, 104.0, 120.0, 1e30, float("inf"), float("-inf"), float("nan")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_at_the_ends_of_exp_range(dtype, cpu_isa):
    gate = torch.tensor(SILU_EDGES, dtype=torch.float32).to(dtype)
    up = torch.full_like(gate, 1.5)
    got = ew.silu_mul(torch.cat([gate, up]).reshape(1, -1))[0]
    want = F.silu(gate) * up
    assert torch.equal(got.isnan(), want.isnan()), (got, want)
    finite = ~want.isnan()
    assert ulps(got[finite], want[finite]) <= SILU_ULPS[dtype], (gate, got, want)


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
                  dtype: str = "bfloat16", max_batch_size: int = 4, record_rows: int = 15,
                  **engine_args) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy outputs and the logits of every forward of at most `record_rows` rows, with the C++
    all-layers path or the Python forward (fused elementwise kernels, pyengine's linears)."""
    monkeypatch.setenv("PYENGINE_BF16_MATMUL", "fp32")  # as on a CPU without bf16 instructions
    engine = Engine(model_dir, dtype=dtype, max_seq_len=256, seed=0,
                    kv_cache_config=KvCacheConfig(max_tokens=2048, tokens_per_block=min(16, max_num_tokens)),
                    scheduler_config=SchedulerConfig(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens),
                    **engine_args)
    runner = engine._runner
    assert (runner.cpu_decode is not None) and (runner.model.emulate_bf16 or runner.model.fast_fp32)
    if not cpp:
        runner.cpu_decode = None
    logits = []
    forward = runner.model.forward

    def recording(input_ids, *args):
        out = forward(input_ids, *args)
        if input_ids.shape[0] <= record_rows:
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


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("num_prompts", [GEMM_MIN_ROWS - 1, GEMM_MIN_ROWS, 16])
def test_cpp_decode_layers_switch_to_the_gemm_where_the_python_forward_does(checkpoint_factory, monkeypatch,
                                                                             dtype, num_prompts, cpu_isa):
    """Decode batches of 12, 13 and 16 rows: from GEMM_MIN_ROWS rows, at the levels the GEMM is
    routed at, both paths run it (below, and at the portable level, the decode kernels). Its sums
    run in another order than the decode kernels', so the logits are equal bit for bit only if the
    C++ path picks the kernel the Python forward picks at each row count (and, at 16 rows, the
    fused SiLU-mul the C++ path runs: the Python forward's too, past elementwise.MAX_ROWS)."""
    model_dir = checkpoint_factory("fused_llama", model_type="llama", num_heads=4, num_kv_heads=2)
    prompts = [[1 + i, 5 + i, 9 + (i % 7)] + list(range(20, 20 + i % 5)) for i in range(num_prompts)]
    runs = [decode_logits(model_dir, cpp=cpp, monkeypatch=monkeypatch, prompts=prompts, dtype=dtype,
                          max_batch_size=16, record_rows=16) for cpp in (False, True)]
    (tokens_py, logits_py), (tokens_cpp, logits_cpp) = runs
    assert tokens_cpp == tokens_py
    assert len(logits_cpp) == len(logits_py) >= 11  # the decode steps of all prompts at once
    assert all(a.shape[0] == num_prompts for a in logits_py)
    for a, b in zip(logits_cpp, logits_py):
        assert torch.equal(a, b)


def test_cpp_decode_layers_take_fp32_batches_of_up_to_64_rows_where_the_gemm_is_routed(checkpoint_factory,
                                                                                       monkeypatch, cpu_isa):
    """Past 16 rows the model's fp32 linears are the GEMM at the avx2 and avx512 levels, as the
    C++ path's: decode steps of 40 rows run in one call there, bit for bit as the Python forward;
    at the portable level the Python forward takes them (torch's matmul)."""
    model_dir = checkpoint_factory("fused_llama", model_type="llama", num_heads=4, num_kv_heads=2)
    prompts = [[1 + i, 5 + i, 9 + (i % 7)] + list(range(20, 20 + i % 5)) for i in range(40)]
    runs = []
    real_run = fused_decode.CpuDecodeLayers.run
    for cpp in (False, True):
        calls = []
        monkeypatch.setattr(fused_decode.CpuDecodeLayers, "run",
                            lambda self, h, *a: (calls.append(h.shape[0]), real_run(self, h, *a))[1])
        runs.append(decode_logits(model_dir, cpp=cpp, monkeypatch=monkeypatch, prompts=prompts, dtype="float32",
                                  max_batch_size=40, record_rows=40) + (calls,))
    (tokens_py, logits_py, calls_py), (tokens_cpp, logits_cpp, calls_cpp) = runs
    assert 40 not in calls_py  # (start-up's dummy batches ran before the path was turned off)
    assert (40 in calls_cpp) == (cpu_isa in ("avx2", "avx512"))
    assert tokens_cpp == tokens_py
    assert len(logits_cpp) == len(logits_py) >= 11 and all(a.shape[0] == 40 for a in logits_py)
    for a, b in zip(logits_cpp, logits_py):
        assert torch.equal(a, b)


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


# ---- per-layer sliding windows, NoPE layers and logit soft-capping in the one-call path ----
# (Gemma 2/3 alternate sliding and global layers and cap their logits; SmolLM3 skips RoPE on
# some layers.) The model classes' own forward may not implement these yet, so the reference is
# the decoder written out in float64 torch operations, over each whole sequence at once.

WINDOWS, USES_ROPE = [6, 0, 3], [True, False, True]
SOFTCAP = 1.0


def load_model(model_dir, dtype=torch.float32, max_seq_len=64):
    from pyengine.models import ModelConfig, model_class
    from pyengine.models.loader import load_tensors
    config = ModelConfig.from_model_dir(model_dir)
    cls = model_class(config)
    names, optional = cls.weight_names(config)
    return cls(config, load_tensors(model_dir, names, dtype, optional), dtype, max_seq_len, "cpu")


def reference_hidden(model, ids, windows, uses_rope, softcap):
    """The residual stream after the last layer (before the final norm) of one whole sequence,
    [len(ids), hidden], float64: per layer RMSNorm, qkv (+ bias), q/k norms, RoPE where
    uses_rope, causal attention with the layer's window and scores capped as Hugging Face's
    Gemma2 (scale, / softcap, tanh, * softcap), o, residual, RMSNorm, SiLU-gated MLP, residual."""
    c = model.config
    H, KV, D = c.num_heads, c.num_kv_heads, c.head_dim
    eps = c.rms_norm_eps

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()

    def rope(x, cos, sin):
        return x * cos + rotate_half(x) * sin

    L = len(ids)
    h = model.embed_tokens(torch.tensor(ids)).double()
    cos, sin = model.cos[:L].double().unsqueeze(1), model.sin[:L].double().unsqueeze(1)
    pos = torch.arange(L)
    for layer, window, use_rope in zip(model.layers, windows, uses_rope):
        x = norm(h, layer["input_norm"])
        qkv = x @ layer["qkv"].double().T
        if layer["qkv_bias"] is not None:
            qkv = qkv + layer["qkv_bias"].double()
        q = qkv[:, :H * D].view(L, H, D)
        k = qkv[:, H * D:(H + KV) * D].view(L, KV, D)
        v = qkv[:, (H + KV) * D:].view(L, KV, D)
        if layer["q_norm"] is not None:
            q, k = norm(q, layer["q_norm"]), norm(k, layer["k_norm"])
        if use_rope:
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) * model.scale
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        visible = pos[None, :] <= pos[:, None]
        if window > 0:
            visible &= pos[None, :] > pos[:, None] - window
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
        attn = torch.einsum("hqk,khd->qhd", p, v).reshape(L, H * D)
        h = h + attn @ layer["o"].double().T
        x = norm(h, layer["post_norm"])
        gate, up = (x @ layer["gate_up"].double().T).chunk(2, dim=-1)
        h = h + (F.silu(gate) * up) @ layer["down"].double().T
    return h


# Two sequences through the paged cache (4-token blocks, shuffled): prompt chunks first (mixed
# with a decode row), then decode steps; each step's rows as (sequence, first position, count).
SEQ_LENS = (22, 15)
STEPS = [[(0, 0, 7), (1, 0, 5)], [(0, 7, 3), (1, 5, 1)], [(1, 6, 5)]] + \
        [[(0, p, 1), (1, p + 1, 1)] for p in range(10, 14)] + [[(0, p, 1)] for p in range(14, 22)]
BLOCK_TABLES = [[11, 3, 7, 0, 14, 9], [5, 12, 2, 8]]


def run_cpp_layers(model, tokens, tpb=4):
    """Every step of STEPS through CpuDecodeLayers; returns {(sequence, position): h row}."""
    c = model.config
    kv_caches = [(torch.zeros(16, c.num_kv_heads, tpb, c.head_dim), torch.zeros(16, c.num_kv_heads, tpb, c.head_dim))
                 for _ in range(c.num_layers)]
    layers = fused_decode.CpuDecodeLayers(model, kv_caches, max_blocks_per_seq=6)
    table = torch.full((2, 6), -1, dtype=torch.int32)
    for i, row in enumerate(BLOCK_TABLES):
        table[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
    out = {}
    for step in STEPS:
        seqs = [s for s, _, _ in step]
        positions = [p for _, first, n in step for p in range(first, first + n)]
        rows = [(s, p) for s, first, n in step for p in range(first, first + n)]
        assert len(rows) <= layers.max_rows
        meta = SimpleNamespace(
            slot_mapping=torch.tensor([BLOCK_TABLES[s][p // tpb] * tpb + p % tpb for s, p in rows], dtype=torch.int32),
            query_start_loc=torch.tensor([0] + list(itertools.accumulate(n for _, _, n in step)), dtype=torch.int32),
            seq_lens=torch.tensor([first + n for _, first, n in step], dtype=torch.int32),
            block_tables=table[seqs].contiguous())
        h = model.embed_tokens(torch.tensor([tokens[s][p] for s, p in rows])).contiguous()
        layers.run(h, torch.tensor(positions, dtype=torch.int32), meta)
        out.update({key: h[i].clone() for i, key in enumerate(rows)})
    return out


@pytest.mark.parametrize("variant", [dict(model_type="llama", num_heads=4, num_kv_heads=2),
                                     dict(model_type="qwen3", num_heads=4, num_kv_heads=2, head_dim=32)])
def test_cpp_decode_layers_with_per_layer_windows_nope_layers_and_softcap(checkpoint_factory, variant, cpu_isa):
    model_dir = checkpoint_factory(f"fused3_{variant['model_type']}", num_layers=3, **variant)
    model = load_model(model_dir)
    model.layer_sliding_windows, model.layer_uses_rope, model.attn_softcap = WINDOWS, USES_ROPE, SOFTCAP
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in SEQ_LENS]
    got = run_cpp_layers(model, tokens)
    assert len(got) == sum(SEQ_LENS)
    tol = dict(atol=1e-4, rtol=1e-4)  # fp32 kernels against float64 over three layers

    def compare(windows, uses_rope, softcap):
        """The largest difference from the reference, checking the given settings."""
        worst = 0.0
        for s, ids in enumerate(tokens):
            ref = reference_hidden(model, ids, windows, uses_rope, softcap)
            for p in range(len(ids)):
                worst = max(worst, float(((got[s, p].double() - ref[p]).abs() - tol["rtol"] * ref[p].abs()).max()))
        return worst

    assert compare(WINDOWS, USES_ROPE, SOFTCAP) <= tol["atol"]
    # each setting shows: the reference without it is far off (a kernel that dropped it would fail)
    assert compare([0, 0, 0], USES_ROPE, SOFTCAP) > 50 * tol["atol"]
    assert compare([WINDOWS[0]] * 3, USES_ROPE, SOFTCAP) > 50 * tol["atol"]
    assert compare(WINDOWS, [True] * 3, SOFTCAP) > 50 * tol["atol"]
    assert compare(WINDOWS, USES_ROPE, 0.0) > 50 * tol["atol"]


def test_layer_settings_default_to_the_model_wide_window_and_rope(checkpoint_factory):
    model = load_model(checkpoint_factory("fused3_llama", model_type="llama", num_layers=3, num_heads=4,
                                          num_kv_heads=2))
    del model.layer_sliding_windows, model.layer_uses_rope  # (a model without them: the fallbacks)
    model.sliding_window = 5
    assert fused_decode.layer_settings(model) == ([5, 5, 5], [True, True, True])
    layers = fused_decode.CpuDecodeLayers(model, [(torch.zeros(4, 2, 4, 16), torch.zeros(4, 2, 4, 16))] * 3, 2)
    assert layers.layer_ptrs[:, _core.DECODE_LAYER_SLIDING_WINDOW].tolist() == [5, 5, 5]
    assert layers.layer_ptrs[:, _core.DECODE_LAYER_USE_ROPE].tolist() == [1, 1, 1]
    model.layer_sliding_windows, model.layer_uses_rope = (4, 0, 4), [1, 0, 0]
    assert fused_decode.layer_settings(model) == ([4, 0, 4], [True, False, False])


@pytest.mark.parametrize("windows, uses_rope, softcap, match", [
    ([4, 0], None, 0.0, r"layer_sliding_windows / layer_uses_rope: 2 / 3 entries for 3 layers"),
    (None, [True], 0.0, r"1 entries for 3 layers"),
    ([4, -1, 0], None, 0.0, r"layer_sliding_windows: entry 1 is -1"),
    ([4, 2.5, 0], None, 0.0, r"layer_sliding_windows: entry 1 is 2.5"),
    (None, None, -3.0, r"softcap: must be finite and >= 0 \(0 disables it\), got -3.0"),
    (None, None, float("nan"), r"softcap: .* got nan"),
])
def test_bad_layer_settings_are_refused(checkpoint_factory, windows, uses_rope, softcap, match):
    model = load_model(checkpoint_factory("fused3_llama", model_type="llama", num_layers=3, num_heads=4,
                                          num_kv_heads=2))
    if windows is not None:
        model.layer_sliding_windows = windows
    if uses_rope is not None:
        model.layer_uses_rope = uses_rope
    model.attn_softcap = softcap
    with pytest.raises(ValueError, match=match):
        fused_decode.CpuDecodeLayers(model, [(torch.zeros(4, 2, 4, 16), torch.zeros(4, 2, 4, 16))] * 3, 2)


@pytest.mark.parametrize("column, value, match", [
    ("DECODE_LAYER_SLIDING_WINDOW", -1, r"layer_ptrs: layer 2's sliding window is -1"),
    ("DECODE_LAYER_SLIDING_WINDOW", 1 << 31, r"layer_ptrs: layer 2's sliding window is 2147483648"),
    ("DECODE_LAYER_USE_ROPE", 2, r"layer_ptrs: layer 2's RoPE flag is 2 \(must be 0 or 1\)"),
])
def test_the_kernel_checks_every_layer_before_running(checkpoint_factory, column, value, match):
    model = load_model(checkpoint_factory("fused3_llama", model_type="llama", num_layers=3, num_heads=4,
                                          num_kv_heads=2))
    c = model.config
    caches = [(torch.zeros(4, c.num_kv_heads, 4, c.head_dim), torch.zeros(4, c.num_kv_heads, 4, c.head_dim))
              for _ in range(3)]
    layers = fused_decode.CpuDecodeLayers(model, caches, 2)
    layers.layer_ptrs[2, getattr(_core, column)] = value
    meta = SimpleNamespace(slot_mapping=torch.tensor([0], dtype=torch.int32),
                           query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                           seq_lens=torch.tensor([1], dtype=torch.int32),
                           block_tables=torch.tensor([[0, 1]], dtype=torch.int32))
    h = torch.randn(1, c.hidden_size)
    before = h.clone()
    with pytest.raises(ValueError, match=match):
        layers.run(h, torch.tensor([0], dtype=torch.int32), meta)
    assert torch.equal(h, before) and all(not k.any() for k, _ in caches)  # nothing ran


# ---- the output head in the one-call path (decode_head) ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [False, True])
def test_cpp_head_equals_the_model_logits_bit_for_bit(checkpoint_factory, dtype, tied, cpu_isa):
    """The final norm (the fused kernel) and the output projection of rows picked in any order,
    repeats included, as the model's _logits computes them for a forward that fuses."""
    model = load_model(checkpoint_factory(f"fused_head_{tied}", model_type="llama", num_heads=4, num_kv_heads=2,
                                          tie_word_embeddings=tied), dtype)
    c = model.config
    layers = fused_decode.CpuDecodeLayers(model, [(torch.zeros(4, c.num_kv_heads, 4, c.head_dim),) * 2] * c.num_layers,
                                          2)
    assert layers.has_head
    torch.manual_seed(0)
    h = (torch.randn(7, c.hidden_size) * 3).to(dtype)
    for rows in ([0], [6, 0, 3, 3], list(range(7))):
        idx = torch.tensor(rows, dtype=torch.int32)
        got = layers.logits(h, idx)
        assert got.dtype == torch.float32 and got.shape == (len(rows), c.vocab_size)
        assert torch.equal(got, model._logits(h[idx.long()], fused=True))
    # int64 row indices (a batch with prompt-logprob rows) are taken as well
    assert torch.equal(layers.logits(h, torch.tensor([5, 1])), model._logits(h[[5, 1]], fused=True))


@pytest.mark.parametrize("rows, match", [
    ([0, 7], r"rows: entry 1 is 7, outside \[0, 7\)"),
    ([-1], r"rows: entry 0 is -1, outside \[0, 7\)"),
    ([0] * 65, r"num_rows: must be in \[1, 64\], got 65"),
])
def test_cpp_head_refuses_bad_rows(checkpoint_factory, rows, match):
    model = load_model(checkpoint_factory("fused_head_False", model_type="llama", num_heads=4, num_kv_heads=2,
                                          tie_word_embeddings=False))
    c = model.config
    layers = fused_decode.CpuDecodeLayers(model, [(torch.zeros(4, c.num_kv_heads, 4, c.head_dim),) * 2] * c.num_layers,
                                          2)
    with pytest.raises(ValueError, match=match):
        layers.logits(torch.randn(7, c.hidden_size), torch.tensor(rows, dtype=torch.int32))


@pytest.mark.parametrize("exact_fp32", [False, True])
def test_cpp_head_takes_a_float_head_of_a_quantized_model_where_the_model_would(checkpoint_factory, monkeypatch,
                                                                               exact_fp32):
    """quantize_lm_head=False keeps the head in fp32: the one-call path computes it with pyengine's
    fp32 kernel, as the model's linear does -- except with exact_fp32, where the model keeps
    torch's matmul and so the head stays the model's."""
    model_dir = checkpoint_factory("fused_llama", model_type="llama", num_heads=4, num_kv_heads=2)
    engine = Engine(model_dir, dtype="float32", quantization="q8_0", quantize_lm_head=False, exact_fp32=exact_fp32,
                    max_seq_len=256)
    decode = engine._runner.cpu_decode
    assert not decode.head_quantized and decode.has_head == (not exact_fp32)
    if not exact_fp32:
        model = engine._runner.model
        h = torch.randn(3, model.config.hidden_size)
        rows = torch.tensor([2, 0], dtype=torch.int32)
        assert torch.equal(decode.logits(h, rows), model._logits(h[rows.long()], fused=True))
