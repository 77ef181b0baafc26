"""Which linear-layer path a bf16 model on the CPU takes. Without bf16 instructions: the pyengine
kernel (pyengine.layers.linear.linear_bf16) for fewer than GEMM_MIN_ROWS (13) rows, the tied
lm_head included, and pyengine's GEMM (gemm_bf16) from there on at the levels it is routed at
(avx2, avx512; at the portable level the kernel up to EMULATED_BF16_MIN_ROWS - 1 = 64 rows, then
torch's fp32 GEMM). With them (AVX512-BF16/AMX): the kernel up to
NATIVE_BF16_KERNEL_MAX_ROWS rows (8; NATIVE_BF16_KERNEL_MAX_ROWS_AMX = 4 with AMX: decode, where it
streams the weights faster than torch's bf16 GEMM), torch's bf16 GEMM above."""

from __future__ import annotations

import torch

import pyengine.layers.linear as linear_layer
from pyengine.layers import packed_gemm
from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig
import pyengine.layers.cpu_features as cpu_features
from pyengine.layers.cpu_features import (EMULATED_BF16_MIN_ROWS, NATIVE_BF16_KERNEL_MAX_ROWS,
                                         NATIVE_BF16_KERNEL_MAX_ROWS_AMX, bf16_kernel_max_rows)
from pyengine.layers.linear import GEMM_MIN_ROWS, MAX_ROWS, cpu_gemm_routed


def test_kernel_takes_every_row_count_below_the_fp32_threshold():
    assert EMULATED_BF16_MIN_ROWS - 1 <= MAX_ROWS


def test_decode_linears_and_tied_lm_head_use_the_kernel(checkpoint_factory, monkeypatch):
    monkeypatch.setenv("PYENGINE_BF16_MATMUL", "fp32")  # as on a CPU without bf16 instructions
    # The same checkpoint as test_correctness's "qwen2_tied" (the factory caches by name).
    model_dir = checkpoint_factory("qwen2_tied", model_type="qwen2", num_heads=4, num_kv_heads=1,
                                   tie_word_embeddings=True)
    calls: list[tuple[int, int, bool]] = []  # (rows, weight address, has bias)
    gemm_rows: list[int] = []

    def spy(x, w, b=None, out=None):
        calls.append((x.shape[0], w.data_ptr(), b is not None))
        return real(x, w, b, out)

    def spy_gemm(x, w, b=None, out=None):
        gemm_rows.append(x.shape[0])
        return real_gemm(x, w, b, out)

    real, real_gemm = linear_layer.linear_bf16, linear_layer.gemm_bf16
    monkeypatch.setattr(linear_layer, "linear_bf16", spy)
    monkeypatch.setattr(linear_layer, "gemm_bf16", spy_gemm)
    engine = Engine(model_dir, dtype="bfloat16", max_seq_len=128,
                    kv_cache_config=KvCacheConfig(max_tokens=512),
                    scheduler_config=SchedulerConfig(max_batch_size=2, max_num_tokens=128))
    model = engine._runner.model
    assert model.emulate_bf16
    assert engine._runner.cpu_decode is not None
    engine._runner.cpu_decode = None  # the Python forward's routing (the C++ one: test_cpu_fused.py)
    calls.clear()
    gemm_rows.clear()
    routed = cpu_gemm_routed()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = engine.generate([list(range(1, 80)), list(range(5, 12))], params, use_tqdm=False)  # 86 rows: a GEMM
    assert [len(r.token_ids) for r in out] == [4, 4]
    out = engine.generate([list(range(100, 129)), list(range(200, 207))], params, use_tqdm=False)  # 36 rows
    assert [len(r.token_ids) for r in out] == [4, 4]
    kernel_max = GEMM_MIN_ROWS - 1 if routed else EMULATED_BF16_MIN_ROWS - 1
    assert calls and all(1 <= rows <= kernel_max for rows, _, _ in calls)
    assert 2 in {rows for rows, _, _ in calls}  # decode batches of the two requests
    if routed:
        assert {86, 36} <= set(gemm_rows) and all(rows >= GEMM_MIN_ROWS for rows in gemm_rows)
    else:
        assert not gemm_rows and 36 in {rows for rows, _, _ in calls}
    used = {addr for _, addr, _ in calls}
    layer = model.layers[0]
    for name in ("qkv", "o", "gate_up", "down"):
        assert layer[name].data_ptr() in used, name
    assert model.embed.data_ptr() in used  # the lm_head is the embedding table
    assert any(bias for _, addr, bias in calls if addr == layer["qkv"].data_ptr())
    assert all(t.dtype == torch.bfloat16 for t in (layer["qkv"], model.embed))


def test_with_bf16_instructions_the_kernel_takes_decode_batches_only(checkpoint_factory, monkeypatch):
    monkeypatch.setenv("PYENGINE_BF16_MATMUL", "native")  # as on a CPU with AVX512-BF16 or AMX
    model_dir = checkpoint_factory("qwen2_tied", model_type="qwen2", num_heads=4, num_kv_heads=1,
                                   tie_word_embeddings=True)
    kernel_rows: list[int] = []
    torch_rows: list[int] = []

    def spy_kernel(x, w, b=None, out=None):
        kernel_rows.append(x.shape[0])
        return real_kernel(x, w, b, out)

    def spy_torch(x, w, b=None):
        torch_rows.append(x.shape[0])
        return real_torch(x, w, b)

    def spy_packed(x, packed, b=None):  # torch's GEMM on weights packed for it (packed_gemm.py)
        torch_rows.append(x.shape[0])
        return real_packed(x, packed, b)

    real_kernel, real_torch = linear_layer.linear_bf16, linear_layer.F.linear
    real_packed = packed_gemm.packed_linear
    monkeypatch.setattr(linear_layer, "linear_bf16", spy_kernel)
    monkeypatch.setattr(linear_layer.F, "linear", spy_torch)
    monkeypatch.setattr(packed_gemm, "packed_linear", spy_packed)
    engine = Engine(model_dir, dtype="bfloat16", max_seq_len=128,
                    kv_cache_config=KvCacheConfig(max_tokens=512),
                    scheduler_config=SchedulerConfig(max_batch_size=12, max_num_tokens=128))
    # Start-up's own calls (packed_gemm.packing_works's 5-row probe, the KV estimation's and the
    # step-cost calibration's dummy batches) are not the routing under test: record from here.
    kernel_rows.clear()
    torch_rows.clear()
    model = engine._runner.model
    max_rows = bf16_kernel_max_rows()  # 4 or 8, by whether this CPU has AMX
    assert max_rows in (NATIVE_BF16_KERNEL_MAX_ROWS, NATIVE_BF16_KERNEL_MAX_ROWS_AMX)
    assert not model.emulate_bf16 and model.bf16_kernel_max_rows == max_rows
    assert engine._runner.cpu_decode is not None
    assert engine._runner.cpu_decode.max_rows == max_rows
    engine._runner.cpu_decode = None  # the Python forward's routing
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    # prefill: 6 + 7 rows (torch); decode: 2 rows (the kernel)
    out = engine.generate([list(range(1, 7)), list(range(5, 12))], params, use_tqdm=False)
    assert [len(r.token_ids) for r in out] == [3, 3]
    # twelve requests: prefill 24 rows, decode batches of 12 rows (torch)
    out = engine.generate([[i + 1, i + 2] for i in range(12)], params, use_tqdm=False)
    assert [len(r.token_ids) for r in out] == [3] * 12
    assert 2 in kernel_rows and all(1 <= rows <= max_rows for rows in kernel_rows)
    assert {13, 24, 12} <= set(torch_rows) and all(rows > max_rows for rows in torch_rows)


def test_the_native_bf16_row_limit_is_lower_with_amx(monkeypatch):
    monkeypatch.setenv("PYENGINE_BF16_MATMUL", "auto")
    for flags, expected in (({"avx512f", "avx512_bf16", "amx_bf16"}, NATIVE_BF16_KERNEL_MAX_ROWS_AMX),
                            ({"avx512f", "avx512_bf16"}, NATIVE_BF16_KERNEL_MAX_ROWS),
                            ({"avx2", "fma"}, EMULATED_BF16_MIN_ROWS - 1)):
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert bf16_kernel_max_rows() == expected, flags
    assert (NATIVE_BF16_KERNEL_MAX_ROWS_AMX, NATIVE_BF16_KERNEL_MAX_ROWS) == (4, 8)
