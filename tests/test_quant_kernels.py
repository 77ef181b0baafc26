"""Tests of the quantized-weight kernels (csrc/include/pyengine/cpu_quant.h through
pyengine.quant.QuantizedWeight): block layouts and quantizers against the `gguf` package (the
reference implementation of llama.cpp's formats in Python), and the linear layer against an fp64
reference, at every instruction-set level this CPU has."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants as gguf_quants

import pyengine.core._core as _core
from pyengine.quant import QUANT_FORMATS, QuantizedWeight, quant_format
from pyengine.quant.formats import INTERLEAVED_LAYOUTS

U = 2.0 ** -24  # fp32 unit roundoff
FORMATS = list(QUANT_FORMATS)  # q8_0, q5_0, q5_1, q4_0, q4_k, q5_k, q6_k, q4_z
X8 = list(INTERLEAVED_LAYOUTS)  # the formats with an interleaved layout: all of them
GGUF_TYPE = {"q8_0": GGMLQuantizationType.Q8_0, "q5_0": GGMLQuantizationType.Q5_0, "q5_1": GGMLQuantizationType.Q5_1,
             "q4_0": GGMLQuantizationType.Q4_0, "q4_k": GGMLQuantizationType.Q4_K, "q5_k": GGMLQuantizationType.Q5_K,
             "q6_k": GGMLQuantizationType.Q6_K}


def weights(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[0, :32] *= 20  # an outlier block
    if n > 1:
        w[1, 32:64] = 0  # an all-zero block
    return w


def quantize_activations(x: torch.Tensor, block: int) -> np.ndarray:
    """The 8-bit activation blocks the kernel multiplies with, in fp64: per `block` values
    d = max|x| / 127, q = round-half-even(x * (1 / d)), each step rounded in fp32 as the kernel
    does (csrc/kernels/cpu/quant_blocks.h)."""
    v = x.numpy().astype(np.float32).reshape(x.shape[0], -1, block)
    d = (np.abs(v).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    safe = np.where(d != 0, d, np.float32(1))
    inv = np.where(d != 0, np.float32(1) / safe, np.float32(0)).astype(np.float32)
    q = np.rint((v * inv).astype(np.float32))
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape[0], -1)


@pytest.mark.parametrize("block", [32, 256])
def test_activation_blocks_are_the_same_bytes_at_every_level(block, cpu_isa):
    """The 8-bit activation blocks (cpu_quant.h: quantize_activation_blocks) equal the fp32
    recipe computed in numpy, byte for byte, whatever the level's instructions."""
    g = torch.Generator().manual_seed(30)
    x = torch.randn(5, 1024, generator=g)
    x[1, :block] = 0  # an all-zero block: d = 0, q = 0
    x[2, 7] = 1e4  # an outlier
    x[3, :block] = (torch.arange(block) % 9 - 4) + 0.5  # d = 1: every value a tie, rounded to even
    x[3, 0] = 127.0
    size = 40 if block == 32 else 292
    out = torch.zeros(5 * 1024 // block * size, dtype=torch.uint8)
    _core._quantize_activation_blocks(x.data_ptr(), 1024, 5, 1024, block, out.data_ptr())
    got = out.numpy().reshape(5, 1024 // block, size)
    v = x.numpy().reshape(5, -1, block)
    d = (np.abs(v).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.rint((v * inv[..., None]).astype(np.float32)).astype(np.int8)
    assert np.array_equal(got[..., :4].copy().view(np.float32)[..., 0], d)
    if block == 32:
        s8 = (8 * q.astype(np.int64).sum(-1)).astype(np.float32) * d
        assert np.array_equal(got[..., 4:8].copy().view(np.float32)[..., 0], s8)
        assert np.array_equal(got[..., 8:].view(np.int8), q)
    else:
        sums = q.astype(np.int64).reshape(5, -1, 16, 16).sum(-1)
        assert np.array_equal(got[..., 4:36].copy().view(np.int16), sums)
        assert np.array_equal(got[..., 36:].view(np.int8), q)


def level_offsets(fmt: str, data: np.ndarray, k: int) -> np.ndarray | None:
    """|the offset| per weight of rows whose blocks add one apart from their scaled levels (Q4_K
    and Q5_K: dmin * m per sub-block; Q5_1: m per block), fp64 [N, K]; None for other formats."""
    if fmt in ("q4_k", "q5_k"):
        return k_quant_offsets(data, k, 144 if fmt == "q4_k" else 176)
    if fmt == "q5_1":
        m = data.reshape(data.shape[0], k // 32, 24)[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        return np.repeat(np.abs(m), 32, axis=-1).reshape(data.shape[0], k)
    return None


def k_quant_offsets(data: np.ndarray, k: int, block_bytes: int) -> np.ndarray:
    """|dmin * m| per weight of Q4_K / Q5_K rows (the sub-block offsets the kernel subtracts apart
    from the scaled levels), fp64 [N, K]."""
    blocks = data.reshape(data.shape[0], k // 256, block_bytes)
    dmin = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    s = blocks[..., 4:16].astype(np.int64)
    mins = np.empty(blocks.shape[:2] + (8,), dtype=np.float64)
    for j in range(8):
        mins[..., j] = (s[..., j + 4] & 63) if j < 4 else ((s[..., j + 4] >> 4) | ((s[..., j] >> 6) << 4))
    return np.repeat(np.abs(dmin[..., None] * mins), 32, axis=-1).reshape(data.shape[0], k)


# ---- formats ----

def test_formats_are_llama_cpps():
    assert {f.name: (f.type_id, f.block_elems, f.block_bytes) for f in QUANT_FORMATS.values()} == {
        "q8_0": (8, 32, 34), "q5_0": (6, 32, 22), "q5_1": (7, 32, 24), "q4_0": (2, 32, 18), "q4_k": (12, 256, 144),
        "q5_k": (13, 256, 176), "q6_k": (14, 256, 210), "q4_z": (100, 32, 20)}
    for name, t in GGUF_TYPE.items():
        assert gguf_quants.GGML_QUANT_SIZES[t] == (QUANT_FORMATS[name].block_elems, QUANT_FORMATS[name].block_bytes)
    assert quant_format("Q4_K") is QUANT_FORMATS["q4_k"] and quant_format(14) is QUANT_FORMATS["q6_k"]
    with pytest.raises(ValueError, match=r"unsupported quantization format 'q4_1'; supported: q8_0, q5_0, q5_1, q4_0, q4_k, "
                                         r"q5_k, q6_k, q4_z"):
        quant_format("q4_1")
    with pytest.raises(ValueError, match=r"q4_k rows must hold a positive multiple of 256 weights, got 576"):
        QUANT_FORMATS["q4_k"].row_bytes(576)


@pytest.mark.parametrize("fmt", list(GGUF_TYPE))
def test_dequantize_matches_gguf(fmt):
    w = weights(9, 512, seed=1)
    q = QuantizedWeight.quantize(w, fmt)
    data = q.parts[0][1].numpy()
    ref = gguf_quants.dequantize(data, GGUF_TYPE[fmt])
    assert np.array_equal(q.dequantize().numpy(), ref)


@pytest.mark.parametrize("fmt", ["q8_0", "q5_0", "q5_1", "q4_0"])
def test_quantize_matches_gguf_bit_for_bit(fmt):
    """gguf-py's Q8_0 / Q5_0 / Q5_1 / Q4_0 quantizers are llama.cpp's reference ones in numpy."""
    w = weights(7, 1024, seed=2)
    w[2, 64:96] = torch.arange(32) / 4.0 - 4.0  # exact ties of the rounding
    q = QuantizedWeight.quantize(w, fmt)
    assert np.array_equal(q.parts[0][1].numpy(), gguf_quants.quantize(w.numpy(), GGUF_TYPE[fmt]))


@pytest.mark.parametrize("fmt,max_rel_rmse", [("q8_0", 0.007), ("q5_0", 0.05), ("q5_1", 0.045), ("q4_0", 0.1),
                                               ("q4_k", 0.09), ("q5_k", 0.045), ("q6_k", 0.022), ("q4_z", 0.1)])
def test_quantization_error_is_that_of_the_format(fmt, max_rel_rmse):
    """Round-to-nearest error per format on Gaussian weights: about step / sqrt(12) with step =
    E[max|w| of a block] / (levels / 2), i.e. 0.0047 sigma for Q8_0 (32 weights, 255 levels),
    0.037 for Q5_0 (32 levels), 0.075 for Q4_0 (16 levels), 0.016 for Q6_K (16 weights, 64
    levels), 0.079 for Q4_Z (asymmetric, 16 levels over the block's range), 0.038 for Q5_1 (32
    levels over the block's range); Q4_K's and Q5_K's searched asymmetric grids land below Q4_0's
    and Q5_0's. An all-zero block stays zero."""
    w = weights(16, 1024, seed=3)
    dq = QuantizedWeight.quantize(w, fmt).dequantize()
    normal = torch.ones_like(w, dtype=torch.bool)
    normal[0, :32] = False
    rel = ((dq - w)[normal].pow(2).mean().sqrt() / w[normal].pow(2).mean().sqrt()).item()
    assert rel < max_rel_rmse
    assert bool((dq[1, 32:64] == 0).all())
    assert (dq[0, :32] - w[0, :32]).abs().max() <= 0.6 * w[0, :32].abs().max() / 7  # the outlier block: within its grid


# ---- the linear layer ----

def takes_amx(q: QuantizedWeight, m: int) -> bool:
    """Whether linear_quant multiplies q (one row group) with m rows of x on its AMX path."""
    return _core._cpu_amx() and m >= _core.QUANT_AMX_MIN_ROWS and q.layouts[0].endswith("x8")


def check_linear(q: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = q.linear(x, bias)
    if takes_amx(q, x.shape[0]):
        return check_amx_linear(q, x, bias, y)
    fmt = q.plain().parts[0][0]
    block = 32 if fmt.block_elems == 32 else 256
    qx = quantize_activations(x, block)
    wd = q.dequantize().double().numpy()
    b = np.zeros(q.n) if bias is None else bias.double().numpy()
    exact = qx @ wd.T + b
    # integer block sums are exact; per block two products and a conversion round, then one
    # addition per block; Q4_K, Q5_K and Q5_1 sum their scaled levels and their offsets apart
    terms = np.abs(qx) @ np.abs(wd).T + np.abs(b)
    offsets = level_offsets(fmt.name, q.plain().parts[0][1].numpy(), q.k)
    if offsets is not None:
        terms += 2 * np.abs(qx) @ offsets.T  # |d sc q| <= |w| + |off|
    nb = q.k // block
    gamma = (nb + 6) * U / (1 - (nb + 6) * U)
    err = np.abs(y.double().numpy() - exact)
    assert (err <= gamma * terms).all(), f"max excess {(err - gamma * terms).max()}"
    return y


def check_amx_linear(q: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """The AMX path: x and the dequantized weights (each computed by one fused multiply-add, as
    the fp32 dequantization does) rounded to bf16 (nearest even), their products exact in fp32,
    then K fp32 additions and the bias's: only the additions' rounding separates y from the fp64
    product of the rounded values."""
    xb = x.bfloat16().double().numpy()
    wb = q.dequantize().bfloat16().double().numpy()
    b = np.zeros(q.n) if bias is None else bias.double().numpy()
    exact = xb @ wb.T + b
    terms = np.abs(xb) @ np.abs(wb).T + np.abs(b)
    gamma = (q.k + 2) * U / (1 - (q.k + 2) * U)
    err = np.abs(y.double().numpy() - exact)
    assert (err <= gamma * terms).all(), f"max excess {(err - gamma * terms).max()}"
    return y


@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_matches_fp64_reference_at_every_row_count(fmt, quant_cpu_isa):
    n, k = 37, 768  # 37: not a multiple of any tile
    q = QuantizedWeight.quantize(weights(n, k, seed=4), fmt)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, k, generator=g)
    x[3, 100] = 50.0  # an activation outlier
    full = check_linear(q, x)
    for m in (1, 2, 3, 4, 5, 7, 8, 13):
        part = check_linear(q, x[:m].clone())
        # batch invariance: a row's output does not depend on the other rows of the batch
        assert torch.equal(part, full[:m]), f"M={m}"


@pytest.mark.parametrize("fmt", X8)
@pytest.mark.parametrize("odd_blocks", [False, True])
def test_interleaved_linear_matches_fp64_reference_at_every_row_count(fmt, odd_blocks, quant_cpu_isa):
    """The interleaved layouts (8 rows side by side), every row count of x up to the tile (4; 8 in
    the avx512 VNNI build) and
    past it, 5 groups of rows (one thread's share is not a whole number of tiles). Rows of an
    even and an odd number of blocks (the one-row path of the avx512 VNNI build sums blocks in
    pairs: an odd count ends with a block alone)."""
    block = QUANT_FORMATS[fmt].block_elems
    even, odd = (4, 3) if block == 256 else (24, 25)  # 1024 / 768 or 768 / 800 weights a row
    n, k = 40, (odd if odd_blocks else even) * block
    plain = QuantizedWeight.quantize(weights(n, k, seed=4), fmt)
    q = plain.interleaved()
    assert q.layouts == [fmt + "x8"]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, k, generator=g)
    x[3, 100] = 50.0
    bias = torch.randn(n, generator=g)
    full = check_linear(q, x, bias)
    parts = {m: check_linear(q, x[:m].clone(), bias) for m in (1, 2, 3, 4, 5, 7, 8, 13, 15, 16, 17, 31, 33, 48, 63)}
    for m, part in parts.items():
        # within each path (with AMX: 1-15 rows the 8-bit one, 16 and more AMX) the same bits as
        # the most rows that take it
        same = full if takes_amx(q, m) == takes_amx(q, x.shape[0]) else parts[15]
        assert torch.equal(part, same[:m]), f"M={m}"


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_k"])
@pytest.mark.parametrize("m", [1, 5])
def test_thread_counts_give_the_same_bits(fmt, m, quant_cpu_isa):
    """Threads share the output columns in chunks of ~16 KiB of weights and take over a slower
    thread's remaining share: which thread computes a column, and how many threads there are,
    does not change its bits (plain and interleaved layouts)."""
    n, k = 2048, 1024
    plain = QuantizedWeight.quantize(weights(n, k, seed=12), fmt)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(13))
    old = torch.get_num_threads()
    try:
        for q in (plain, plain.interleaved()):
            outs = []
            for threads in (1, 2, 3, 5):
                torch.set_num_threads(threads)
                outs.extend(q.linear(x) for _ in range(3))
            for y in outs[1:]:
                assert torch.equal(y, outs[0]), q.layouts
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_concurrent_callers_get_their_own_results(fmt, quant_cpu_isa):
    """Two application threads multiplying at once, each its own x and width, each on a team of
    two: every result is the one the call gives alone. (In the avx512 VNNI build each thread of a
    call spreads x for itself, in a buffer of its own, once a call: a spread made for another
    caller's x, or for an earlier call, must never be taken.)"""
    import threading

    layers = [QuantizedWeight.quantize(weights(64, k, seed=20 + i), fmt).interleaved() for i, k in enumerate((768, 1024))]
    g = torch.Generator().manual_seed(21)
    xs = [[torch.randn(1, q.k, generator=g) for _ in range(8)] for q in layers]
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        alone = [[q.linear(x) for x in row] for q, row in zip(layers, xs)]
        got: list[list[torch.Tensor]] = [[], []]
        errors: list[BaseException] = []

        def work(i: int) -> None:
            try:
                torch.set_num_threads(2)
                for _ in range(50):
                    for x in xs[i]:
                        got[i].append(layers[i].linear(x))
            except BaseException as e:  # re-raised below, in the test's thread
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.set_num_threads(old)
    assert not errors, errors
    for i in range(2):
        assert len(got[i]) == 50 * len(xs[i])
        for j, y in enumerate(got[i]):
            assert torch.equal(y, alone[i][j % len(xs[i])]), (i, j)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_linear_small_outputs_and_bias(fmt, n, quant_cpu_isa):
    k = 512
    q = QuantizedWeight.quantize(weights(n, k, seed=6), fmt)
    g = torch.Generator().manual_seed(7)
    check_linear(q, torch.randn(3, k, generator=g), torch.randn(n, generator=g))
    check_linear(q, torch.randn(1, k, generator=g), torch.randn(n, generator=g))


def test_linear_mixed_formats_write_their_column_ranges(quant_cpu_isa):
    """Row groups of different formats (as a GGUF file's q, k in Q4_K and v in Q6_K) each fill
    their own columns of one output."""
    k = 512
    parts = [QuantizedWeight.quantize(weights(12, k, seed=8), "q4_k"),
             QuantizedWeight.quantize(weights(5, k, seed=9), "q6_k"),
             QuantizedWeight.quantize(weights(3, k, seed=10), "q8_0")]
    fused = QuantizedWeight.cat(parts)
    assert fused.formats == ["q4_k", "q6_k", "q8_0"] and fused.shape == (20, k)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(11))
    y = fused.linear(x)
    assert torch.equal(y, torch.cat([p.linear(x) for p in parts], dim=1))
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    ids = torch.tensor([[19, 0], [12, 16]])
    assert torch.equal(fused.embedding(ids), fused.dequantize()[ids])


@pytest.mark.parametrize("fmt", X8)
def test_interleaving_keeps_every_value(fmt):
    """interleaved() and back is the identity on the bytes; values, embedding rows and the
    format reported stay those of the plain layout; sizes are the plain format's (Q4_K and Q5_K:
    plus their unpacked scales, 148 and 180 bytes per 256 weights against 144 and 176; Q4_Z: less
    its pad byte, 19 bytes per 32 weights against 20)."""
    k = 512
    q = QuantizedWeight.quantize(weights(24, k, seed=20), fmt)
    x8 = q.interleaved()
    assert x8.layouts == [fmt + "x8"] and x8.formats == [fmt] and x8.shape == q.shape
    assert x8.nbytes == {"q4_k": 24 * k // 256 * 148, "q5_k": 24 * k // 256 * 180,
                         "q4_z": 24 * k // 32 * 19}.get(fmt, q.nbytes)
    assert torch.equal(x8.plain().parts[0][1], q.parts[0][1])
    assert torch.equal(x8.dequantize(), q.dequantize())
    ids = torch.tensor([[23, 0], [9, 16]])
    assert torch.equal(x8.embedding(ids), q.dequantize()[ids])
    # a decode step's int32 ids (one C++ call, no int64 copy): the same rows, plain or interleaved
    ids32 = torch.tensor([23, 0, 9, 16, 9], dtype=torch.int32)
    assert torch.equal(x8.embedding(ids32), q.dequantize()[ids32.long()])
    assert torch.equal(q.embedding(ids32), q.dequantize()[ids32.long()])
    assert x8.interleaved() is x8 and q.plain() is q


def test_q4_0x8_byte_layout():
    """Q4_0x8 as documented in cpu_quant.h: per 32 weights the 8 rows' fp16 scales, then 4 chunks
    c of 32 bytes whose byte 4j + t holds row j's levels at 8c + t (low nibble), 8c + 4 + t (high)."""
    q = QuantizedWeight.quantize(weights(8, 64, seed=21), "q4_0")
    plain = q.parts[0][1].numpy().reshape(8, 2, 18)
    levels = np.concatenate([plain[..., 2:] & 15, plain[..., 2:] >> 4], axis=-1)  # [row, block, 32]
    x8 = q.interleaved().parts[0][1].numpy().reshape(2, 144)
    for b in range(2):
        assert np.array_equal(x8[b, :16].reshape(8, 2), plain[:, b, :2])
        for c in range(4):
            for j in range(8):
                for t in range(4):
                    assert x8[b, 16 + 32 * c + 4 * j + t] == levels[j, b, 8 * c + t] | (levels[j, b, 8 * c + 4 + t] << 4)


def test_only_whole_groups_of_8_rows_interleave(quant_cpu_isa):
    """A row group that is not a multiple of 8 rows stays as it is; a fused weight of several
    groups keeps each group's columns."""
    k = 512
    parts = [QuantizedWeight.quantize(weights(16, k, seed=22), "q4_k"),
             QuantizedWeight.quantize(weights(5, k, seed=23), "q6_k"),
             QuantizedWeight.quantize(weights(8, k, seed=24), "q5_0")]
    fused = QuantizedWeight.cat(parts).interleaved()
    assert fused.layouts == ["q4_kx8", "q6_k", "q5_0x8"] and fused.formats == ["q4_k", "q6_k", "q5_0"]
    assert parts[1].interleaved() is parts[1]
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(25))
    assert torch.equal(fused.linear(x), torch.cat([parts[0].interleaved().linear(x), parts[1].linear(x),
                                                    parts[2].interleaved().linear(x)], dim=1))


def test_interleaved_layouts_reject_bad_input():
    q = QuantizedWeight.quantize(weights(16, 256, seed=26), "q4_0")
    x8 = q.interleaved()
    fmt = INTERLEAVED_LAYOUTS["q4_0"]
    with pytest.raises(ValueError, match=r"q4_0x8 holds groups of 8 rows, got 12 rows"):
        QuantizedWeight([(fmt, x8.parts[0][1][:12])], 256)
    x, y = torch.zeros(1, 256), torch.zeros(1, 16)
    with pytest.raises(ValueError, match=r"N: q4_0x8 holds groups of 8 rows, got 12"):
        _core._linear_quant(y.data_ptr(), 16, x.data_ptr(), 256, 1, x8.data_ptr(), fmt.type_id, 12, 256, 0, 1)
    src, dst = torch.zeros(8, 256), torch.zeros(8, 144, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"type: q4_0x8 is an interleaved layout: quantize to q4_0, then interleave_rows"):
        _core._quantize_rows(fmt.type_id, src.data_ptr(), dst.data_ptr(), 8, 256, 1)
    with pytest.raises(ValueError, match=r"type: q4_0x8 has no interleaved layout"):
        _core._interleave_rows(202, dst.data_ptr(), dst.data_ptr(), 8, 32)
    with pytest.raises(ValueError, match=r"interleaved: q4_0 is not an interleaved layout"):
        _core._deinterleave_rows(2, dst.data_ptr(), dst.data_ptr(), 8, 32)
    with pytest.raises(ValueError, match=r"rows: must be a multiple of 8, got 12"):
        _core._interleave_rows(2, dst.data_ptr(), dst.data_ptr(), 12, 32)


def test_quantized_linear_rejects_bad_input():
    q = QuantizedWeight.quantize(weights(8, 256, seed=12), "q4_0")
    with pytest.raises(ValueError, match=r"x: expected shape \[M, 256\], got \(2, 128\)"):
        q.linear(torch.zeros(2, 128))
    with pytest.raises(ValueError, match=r"bias: expected shape \(8,\), got \(7,\)"):
        q.linear(torch.zeros(2, 256), torch.zeros(7))
    with pytest.raises(ValueError, match=r"K: q4_k rows must hold a positive multiple of 256 weights, got 96"):
        _core._quant_row_bytes(12, 96)
    with pytest.raises(ValueError, match=r"unknown quantization type id 3 \(known: 2 = q4_0, 6 = q5_0, 7 = q5_1, 8 = q8_0, "
                                         r"12 = q4_k, 13 = q5_k, 14 = q6_k, 100 = q4_z; interleaved: 202 = q4_0x8, "
                                         r"206 = q5_0x8, 207 = q5_1x8, 208 = q8_0x8, 212 = q4_kx8, 213 = q5_kx8, 214 = q6_kx8, 300 = q4_zx8\)"):
        _core._quant_format(3)
    out = torch.full((2, 256), 7.0)
    ids = torch.tensor([0, 8])
    with pytest.raises(ValueError, match=r"ids\[1\]: 8 is out of range \[0, 8\)"):
        _core._dequantize_gather(2, q.parts[0][1].data_ptr(), 8, 256, ids.data_ptr(), 2, out.data_ptr())
    assert bool((out == 7.0).all())  # nothing written
    ids32 = ids.to(torch.int32)
    with pytest.raises(ValueError, match=r"ids\[1\]: 8 is out of range \[0, 8\)"):
        _core._dequantize_gather_i32(2, q.parts[0][1].data_ptr(), 8, 256, ids32.data_ptr(), 2, out.data_ptr())
    assert bool((out == 7.0).all())
    with pytest.raises(ValueError, match=r"ids\[1\]: -1 is out of range \[0, 8\)"):
        q.embedding(torch.tensor([3, -1]))
    with pytest.raises(ValueError, match=r"ids\[2\]: 9 is out of range \[0, 8\)"):
        q.interleaved().embedding(torch.tensor([3, 7, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"ids\[0\]: 16 is out of range \[0, 16\)"):
        QuantizedWeight.cat([q, q]).embedding(torch.tensor([16]))


def test_from_blocks_checks_the_byte_count():
    data = torch.zeros(8 * 18 * 2, dtype=torch.uint8)
    q = QuantizedWeight.from_blocks("q4_0", data, (8, 64))
    assert q.shape == (8, 64) and q.nbytes == 288
    with pytest.raises(ValueError, match=r"q4_0 weights of shape \(8, 96\): expected 432 uint8 bytes, got 288"):
        QuantizedWeight.from_blocks("q4_0", data, (8, 96))


# Two rows of 256 weights (an integer formula, exact in fp32 on every CPU) quantized by
# llama.cpp's own llama-quantize (the llama.cpp vendored in llama-cpp-python 0.3.36, file type
# Q4_K_M, no importance matrix): the Q6_K bytes of a v projection and the Q4_K bytes of a gate
# projection holding these rows.
def _golden_rows() -> torch.Tensor:
    i = np.arange(256, dtype=np.int64)
    rows = []
    for r in range(2):
        v = ((i * 7919 + r * 104729) % 1000 - 500).astype(np.float32) / np.float32(500) * np.float32(0.02)
        rows.append(v + np.where((i // 32) % 3 == 0, np.float32(0.004), np.float32(0)).astype(np.float32))
    return torch.from_numpy(np.stack(rows))


LLAMA_QUANTIZE_Q6_K = (
    "47f2a75bf0a5590eb3671cb16510b56a1fc4781dc1661aee9330e5993ee2873baae5300b4691da2560bbf6418cd7126d"
    "2a6fb2084d92e82d72b80d52085d91e6d82d62b7fc41175ca1e63b71c60b5095d6210b4691db2661acf7328dc7025d38"
    "8ed2378de2379ce2479cf2076cb0166bc01b65c01b65b01b65b00d57a20d57a2b7a4e42011111d5d4e4a4abbb7b4e4e0"
    "2c1d1151424646b6bbb8e8ec2c1d11111d21626266b7878bc8c8dc1d1d2162626db98888c4c7d71312126e6d6db9b888"
    "888270976e688387946e966983809a926100dc2186db3085ea0f54b90065ba1f64c90eb3681cb16610b5691ec3782cd1"
    "863b1964aef9348fca145faae5300b4690db0752acf7419ce6318b0550aff9449ed9d7116c2661bff9449ed9236eb803"
    "4d0864affa3570ca05509be5200b4690dc17620db7520ca7510cd6812fda842fd974f247acf2075cb0156bc0157bd025"
    "8bd010212d2d7e7a7a8a878794d41020212d5d4e4a4abbb7b4e4e020111d1d4e4a4aadb9784844070713d2d2eeadadb9"
    "784888cbcbdf1f1e22626165b58488c8cbdf8f896e66996f838d676c67968580689b6000")
LLAMA_QUANTIZE_Q4_K = (
    "ab02170dfffffcfff3fffff1efde1fac605e4d2c1a09e8d7c5a49382705f4d3c2b0af8d7c6b5a382716f5e3d2b1af9e8"
    "3d2c1bf9e8c7b5a49371605f4e2c1b0ae8d7c6a49382705f4e3d2b0af9d7c6b50af8d7c6b5a382716f5e3d2b1af9e7d6"
    "b5a49281605e4d2c1a09e8d7c5b49382d7c5b49382705f4d3c1b0af8e7c6b5a382716f4e3d2b0af9e8d6b5a49371605e"
    "ad02160dfbfefffef0fffff1ef9b0fcb2c1af9e8d6b5a49281605f4d2c1b09e8d7c5b49381705f4e3d2b0af9e7c6b5a3"
    "f8d7c6b5a382716f5e3d2b1af9e7d6b5a49281605e4d2c1a09e8d7c5b4938270c5a49382605f4d2c1b0af8e7c6b4a382"
    "716f4e3c2b0af9e7d6b5a49271605e3d9281605e4d2c1a09f8e7c5b4a382706f4d3c2b09f8e7d6b4a392716f5e3c2b1a")


# The same rows through llama.cpp's reference quantizers quantize_row_q5_K_ref and
# quantize_row_q5_1_ref (ggml-quants.c of the same llama.cpp, called from a C program linked
# with its libggml-base).
LLAMA_Q5_K = (
    "52012f0dfffffcfff2fffff2eeef1fac94b5a5adad296b4a5a5252d694b5b5a5ad296b4a4a5a52d69495b5a5ad292b6a"
    "d0ad8a583503d0ae8b583603e1be9b693613e1be9c694714f2cf9c794724f2cf7b4826f3c0ae7b5826f3d0af8c593704"
    "d1be8c593604e1bf9d6a4715e2bf9d6a14e1bf9c6a4714f2cf9d7a4725f2c0ad7a5825f3d0ae8b583603d1be8b593604"
    "be8b693604e1be8b693604f1cf9c7a4714e2cf9c6a4715f2dfad7a5825f3d0ad5201370dfdfffffff3fffef1efad0fdd"
    "ada92b6b4a5a5256d494b5a5ada9296b4a5a5252d694b5a5a5ad296b4a4a5a524825f3c0ad7b5825f3d0ae8b593604d1"
    "be8c593604e1bf9c6a4714e2bf9d6a47e1be9c694714e2cf9c7a4724f2cf9d7a4825f3d0ad8a583503d0ae8b593603e1"
    "8b593604d1be8b593604e1bf9c693714e2cf9c6a4715f2cfad7a4825f3c0ad7b3502d0bd8a583503e0be9b683613e1ce"
    "9b694614f1ceac794724f2cfac7a5724")
LLAMA_Q5_1 = (
    "271519a47ee007fe604d1bf8c5a3704e2bf9c6a3715e2c09271517a5c00ffcc03d1ae8c593604d1bf8c5a3704e2bf9c6"
    "01150fa51ff8811f1be8c593604d1bf8c5a3704e2bf9c6a3231501a4f8033ff0d7b4826f3c0ae7b592603d1ae8c59360"
    "2315ffa4037fe007a4815f3c09d7b4826f3c0ae7b592603d2315f7a47ee00ffc715e2c09d6a4815f3c09d7b4826f3c0a"
    "2315d3a3c00ffc814e2bf9c6a3715e2c09d6a4815f3c09d70115a6a41ff8811f1be8c593604d1bf8c5a3704e2bf9c6a3"
    "011519a40ffcc00fe8c593604d1bf8c5a3704e2bf9c6a371231517a5fc811ff8b4826f3c0ae7b592603d1ae8c593604d"
    "23150fa5813ff003815f3c09d7b4826f3c0ae7b592603d1a231501a43ff0077e5e2c09d6a4815f3c09d7b4826f3c0ae7"
    "2315ffa4e007fec02bf9c6a3715e2c09d6a4815f3c09d7b40115b6a40ffcc00fe8c593604d1bf8c5a3704e2bf9c6a371"
    "2715e3a3f8811ff8c593604d1bf8c5a3704e2bf9c6a3715e0115f0a4033ff00393604d1bf8c5a3704e2bf9c6a3714e2c")


@pytest.mark.parametrize("fmt,expected", [("q6_k", LLAMA_QUANTIZE_Q6_K), ("q4_k", LLAMA_QUANTIZE_Q4_K),
                                          ("q5_k", LLAMA_Q5_K), ("q5_1", LLAMA_Q5_1)])
def test_k_quants_equal_llama_quantize_bit_for_bit(fmt, expected):
    """Q4_K's, Q5_K's and Q6_K's scale searches (and Q5_1's grid) reproduce llama.cpp's reference
    quantizers exactly."""
    q = QuantizedWeight.quantize(_golden_rows(), fmt)
    assert q.parts[0][1].numpy().tobytes().hex() == expected
