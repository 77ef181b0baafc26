"""bench/quant_quality.py's pieces (sequences, KL statistics, llama-perplexity's base file
format and output, the teacher-forced distributions on a tiny model), bench/memory.py's
measurements, and the quantization argument of the benchmark engines (no llama.cpp)."""

from __future__ import annotations

import mmap
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import memory, quant_quality  # noqa: E402


def test_sequences():
    a = quant_quality.make_sequences(3, 10, 1000, bos_id=1, seed=0)
    assert a == quant_quality.make_sequences(3, 10, 1000, bos_id=1, seed=0)
    assert [len(s) for s in a] == [10, 10, 10] and all(s[0] == 1 for s in a)
    assert all(0 <= t < 1000 for s in a for t in s)
    assert a != quant_quality.make_sequences(3, 10, 1000, bos_id=1, seed=1)


def test_kl_and_summary():
    p = torch.log_softmax(torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]), -1)
    q = torch.log_softmax(torch.tensor([[1.0, 2.0, 3.5], [0.0, 0.0, 0.0]]), -1)
    kl = quant_quality.kl_rows(p, q)
    expected = (p.exp() * (p - q)).sum(-1)
    assert torch.allclose(kl.float(), expected, atol=1e-7) and kl[1] == 0 and kl[0] > 0
    s = quant_quality.summarize(np.arange(101, dtype=np.float64), np.array([True] * 75 + [False] * 26))
    assert s["positions"] == 101 and s["mean_kl"] == 50 and s["p99_kl"] == 99 and s["max_kl"] == 100
    assert s["top1_agreement"] == pytest.approx(75 / 101)


def _llama_encode_row(logits: np.ndarray) -> np.ndarray:
    """perplexity.cpp's log_softmax(n_vocab, logits, log_prob, tok), line by line (float32)."""
    f = np.float32
    max_logit, min_logit = f(logits.max()), f(logits.min())
    min_logit = max(min_logit, f(max_logit - f(16)))
    sum_exp = float(np.exp((logits - max_logit).astype(np.float64)).sum())
    log_sum_exp = f(np.log(sum_exp))
    min_log_prob = f(min_logit - max_logit - log_sum_exp)
    scale = f((max_logit - min_logit) / f(65535))
    inv = f(1) / scale
    q = np.where(logits > min_logit, np.rint(inv * (logits - min_logit)), 0).astype(np.uint16)
    return np.concatenate([np.array([scale, min_log_prob], dtype=np.float32).view(np.uint16), q])


def test_encode_logprob_rows_as_llama_perplexity():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 101, generator=g) * 4  # a range wider than 16 in some rows: clipped at max - 16
    logits[1] = torch.randn(101, generator=g) * 0.1
    rows = quant_quality.encode_logprob_rows(torch.log_softmax(logits, -1))
    assert rows.dtype == np.uint16 and rows.shape == (3, 2 * 51 + 4)  # nv = 2 * ceil(V / 2) + 4
    for r in range(3):
        ref = _llama_encode_row(logits[r].numpy().astype(np.float32))
        assert np.allclose(rows[r, :4].view(np.float32), ref[:4].view(np.float32), rtol=1e-5, atol=1e-6)
        assert np.abs(rows[r, 4:105].astype(int) - ref[4:].astype(int)).max() <= 1  # float rounding at .5
    back = quant_quality.decode_logprob_rows(rows, 101)
    lp = torch.log_softmax(logits, -1).numpy()
    kept = lp > lp.max(-1, keepdims=True) - 16
    assert np.abs(back - lp)[kept].max() < 16 / 65535 + 1e-5


def test_kld_base_file(tmp_path):
    seqs = [[1, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6]]
    ref = np.log(np.full((2, 5, 7), 1 / 7, dtype=np.float32))
    rows = quant_quality.write_kld_base(tmp_path / "b.kld", seqs, ref, 7)
    data = (tmp_path / "b.kld").read_bytes()
    assert rows == 6 - 1 - 3  # positions n_ctx/2 .. n_ctx-2
    assert data[:8] == b"_logits_" and struct.unpack("<Iii", data[8:20]) == (6, 7, 2)
    assert list(np.frombuffer(data[20:20 + 48], dtype=np.int32)) == seqs[0] + seqs[1]
    nv = 2 * 4 + 4
    assert len(data) == 20 + 48 + 2 * rows * nv * 2


KLD_OUTPUT = """\
chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p
   1    1033.0803 ±   54.8875       0.00002 ±       -nan       0.00156 ±    0.00002     0.006 ±  0.001 %    86.290 ±  3.101 %

====== Perplexity statistics ======
Mean PPL(Q)/PPL(base)         :   1.000236 ±   0.005197

====== KL divergence statistics ======
Mean    KLD:   0.001561 ±   0.000020
Maximum KLD:   0.002431
99.9%   KLD:   0.002400
99.0%   KLD:   0.002228
Median  KLD:   0.001554
Same top p: 86.290 ± 3.101 %
"""


def test_parse_kld_output():
    r = quant_quality.parse_kld_output(KLD_OUTPUT)
    assert r == {"mean_kl": 0.001561, "max_kl": 0.002431, "p99_kl": 0.002228, "median_kl": 0.001554,
                 "top1_agreement": pytest.approx(0.8629), "ppl_ratio": 1.000236}
    with pytest.raises(ValueError, match="no KL divergence statistics"):
        quant_quality.parse_kld_output(KLD_OUTPUT.split("====== KL")[0])


def test_peak_rss_of_a_child():
    small = memory.peak_rss_of([sys.executable, "-S", "-c", "pass"])
    touch = "b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096])"
    big = memory.peak_rss_of([sys.executable, "-S", "-c", touch])
    assert small["returncode"] == 0 and big["returncode"] == 0
    # the child's own peak, not the (large) benchmark process's it was started from
    assert small["peak_rss"] < 100 * 2**20
    assert 200 * 2**20 < big["peak_rss"] < 300 * 2**20
    assert memory.peak_rss_of([sys.executable, "-S", "-c", "raise SystemExit(3)"])["returncode"] == 3


def test_proc_status_and_mapped_rss(tmp_path):
    st = memory.proc_status("VmRSS", "VmHWM")
    assert st["VmHWM"] >= st["VmRSS"] > 0
    f = tmp_path / "blob.bin"
    f.write_bytes(b"\1" * (8 * 2**20))
    with open(f, "rb") as fh:
        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        sum(m[i] for i in range(0, len(m), 4096))  # touch every page
        assert memory.mapped_rss(str(tmp_path)) >= 8 * 2**20 - 4096
        m.close()
    assert memory.mapped_rss(str(tmp_path)) == 0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from pyengine.testing.checkpoints import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "m", "llama", tie_word_embeddings=True)


def test_quantization_reaches_the_benchmark_engines(tiny_model):
    from bench.common import Request
    from bench.llamacpp import single_stream_engine
    from bench.throughput import PyengineRunner

    e = single_stream_engine(tiny_model, "float32", "q8_0")
    try:
        assert e._parts.quant_plan.summary() == {"q8_0": 15}  # 2 layers x 7 linears + the tied embedding
        w = memory.model_weight_bytes(e._parts.runner.model)
        assert w["quantized"] > 0 and w["float"] > 0  # blocks, and the norms
    finally:
        e.shutdown()
    r = PyengineRunner(tiny_model, "float32", [Request([5, 6, 7], 2)], 1024, quantization="q8_0")
    try:
        assert r.engine._parts.quant_plan is not None and r.run([Request([5, 6, 7], 2)]).generated_tokens == 2
    finally:
        r.close()
    e = single_stream_engine(tiny_model, "float32", "q8_0", lm_head_quantization="q4_0")  # --output-tensor-type
    try:
        assert e.startup_report()["weights"]["output_projection"] == "q4_0"
    finally:
        e.shutdown()
    r = PyengineRunner(tiny_model, "float32", [Request([5, 6, 7], 2)], 1024, quantization="q8_0",
                       lm_head_quantization="q4_0")
    try:
        assert r.engine.startup_report()["weights"]["output_projection"] == "q4_0"
    finally:
        r.close()
    r = PyengineRunner(tiny_model, "float32", [Request([5, 6, 7], 2)], 1024)  # as before: no quantization
    try:
        assert r.engine._parts.quant_plan is None
    finally:
        r.close()


def test_teacher_forced_distributions(tiny_model):
    seqs = quant_quality.make_sequences(3, 12, 512, bos_id=1, seed=0)
    rows: dict[tuple[int, int], torch.Tensor] = {}

    def sink(i, pos, lp):
        rows[(i, pos)] = lp.clone()

    e = quant_quality.make_engine(tiny_model, "float32", None, seqs)
    try:
        quant_quality.teacher_forced(e, seqs, sink)
    finally:
        e.shutdown()
    assert sorted(rows) == [(i, p) for i in range(3) for p in range(11)]
    assert all(torch.allclose(r.exp().sum(), torch.tensor(1.0), atol=1e-5) for r in rows.values())
    # the distribution at a position is the model's after the sequence's own tokens up to there
    from pyengine import SamplingParams

    e = quant_quality.make_engine(tiny_model, "float32", None, seqs)
    try:
        out = e.generate([seqs[1][:5]], SamplingParams(max_tokens=1, temperature=0.0, logprobs=3), use_tqdm=False)[0]
    finally:
        e.shutdown()
    top = out.logprobs[0]
    for tok, lp in top.items():
        assert rows[(1, 4)][tok].item() == pytest.approx(lp, abs=1e-4)
    q = {}
    e = quant_quality.make_engine(tiny_model, "float32", "q8_0", seqs)
    try:
        quant_quality.teacher_forced(e, seqs, lambda i, p, lp: q.__setitem__((i, p), lp.clone()))
    finally:
        e.shutdown()
    kl = torch.stack([quant_quality.kl_rows(rows[k], q[k]) for k in rows])
    assert (kl >= -1e-9).all() and 0 < kl.mean() < 1e-2


def test_quant_decode_step_bytes_and_split(tiny_model):
    """bench/quant_decode.py: the bytes a step reads are the model's stored matrices (all of a
    tied model's 2-D weights: bf16 two bytes a weight, quantized the blocks as laid out); the
    split times the one-call decode's parts and puts them back."""
    from bench import quant_decode
    from bench.common import Request
    from bench.llamacpp import single_stream_engine
    from pyengine.layers import fused_decode

    e = single_stream_engine(tiny_model, "bfloat16")
    try:
        model = e._parts.runner.model
        bf16 = quant_decode.step_weight_bytes(model)
        assert bf16 == 2 * sum(p.numel() for p in _hf_matrices(tiny_model))
    finally:
        e.shutdown()
    run, logits = fused_decode.CpuDecodeLayers.run, fused_decode.CpuDecodeLayers.logits
    for fmt, ratio_below in (("q8_0", 2.0), ("q4_0", 4.0)):
        e = single_stream_engine(tiny_model, "float32", fmt)
        try:
            got = quant_decode.step_weight_bytes(e._parts.runner.model)
            assert got == memory.model_weight_bytes(e._parts.runner.model)["quantized"]
            assert 1.0 < bf16 / got < ratio_below
            with quant_decode.StepSplit() as split:
                tps, secs, n = quant_decode.decode_run(e, Request([5, 6, 7], 6), split)
            assert n == 5 and tps == pytest.approx(n / secs)
            assert 0 < split.seconds["run"] < secs and 0 < split.seconds["logits"] < secs
            assert not e.has_unfinished_requests()
            e.check_resources()  # the finished request's slot and blocks are back
        finally:
            e.shutdown()
    assert (fused_decode.CpuDecodeLayers.run, fused_decode.CpuDecodeLayers.logits) == (run, logits)


def _hf_matrices(model_dir):
    """The checkpoint's 2-D parameters (tied ones once), from its config on the meta device."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return [p for p in model.parameters() if p.dim() == 2]
