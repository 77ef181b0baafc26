"""bf16 weights packed for torch's oneDNN GEMM (pyengine/layers/packed_gemm.py): the packed
product is F.linear's, the model packs exactly its linear weights (once each, a tied head
included) and uses them only past the rows pyengine's own bf16 kernel takes, and a forward
with packed weights gives the logits of one without."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pyengine import Engine, KvCacheConfig, SamplingParams, StartupError
from pyengine.layers import packed_gemm
from pyengine.runtime import host_memory


@pytest.fixture
def native_bf16(monkeypatch):
    """torch's bf16 GEMM (what packing is for; forced, so that a CPU without bf16 instructions
    tests it too, emulated); skipped, saying why, where oneDNN cannot pack."""
    monkeypatch.setenv("PYENGINE_BF16_MATMUL", "native")
    if not packed_gemm.packing_works():
        pytest.skip("this torch build / CPU cannot pack bf16 weights for oneDNN: the engine keeps F.linear")


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_f_linear(native_bf16, rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(960, 576, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, 576, generator=g).bfloat16()
    b = torch.randn(960, generator=g).bfloat16() if bias else None
    ref = F.linear(x, w, b)
    out = packed_gemm.packed_linear(x, packed_gemm.pack(w), b)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    # one bf16 rounding of the same fp32 sums apart at most (equal on the CPUs measured)
    torch.testing.assert_close(out.float(), ref.float(), rtol=8e-3, atol=1e-2)
    # a non-contiguous x gives the same
    wide = torch.cat([x, x], dim=1)[:, :576]
    assert torch.equal(packed_gemm.packed_linear(wide, packed_gemm.pack(w), b), out)


def test_pack_refuses_what_it_cannot_pack():
    assert packed_gemm.pack(torch.zeros(4, 8)) is None  # fp32
    assert packed_gemm.pack(torch.zeros(8, dtype=torch.bfloat16)) is None  # 1-D


def linear_bytes(model) -> int:
    weights = [layer[n] for layer in model.layers for n in ("qkv", "o", "gate_up", "down")]
    return sum(w.nbytes for w in weights) + model.lm_head.nbytes


def test_the_model_packs_its_linear_weights(native_bf16, llama_dir, checkpoint_factory):
    engine = Engine(llama_dir, dtype="bfloat16", max_seq_len=128)
    model = engine._runner.model
    assert len(model.packed) == 4 * len(model.layers) + 1  # untied head
    assert engine.startup_report()["packed_weight_bytes"] == linear_bytes(model) > 0
    tied_dir = checkpoint_factory("llama_tied", model_type="llama", tie_word_embeddings=True)
    tied = Engine(tied_dir, dtype="bfloat16", max_seq_len=128)._runner.model
    assert tied.lm_head is tied.embed and len(tied.packed) == 4 * len(tied.layers) + 1
    for kwargs in ({"pack_bf16_weights": False}, {"dtype": "float32"}):
        kwargs = {"dtype": "bfloat16", **kwargs}
        other = Engine(llama_dir, max_seq_len=128, **kwargs)
        assert other._runner.model.packed == {} and other.startup_report()["packed_weight_bytes"] == 0
    with pytest.raises(StartupError, match="phase 'config': TypeError: pack_bf16_weights must be a bool or None, "
                                           "got 1"):
        Engine(llama_dir, pack_bf16_weights=1)


def test_by_default_only_what_fits_a_quarter_of_the_memory_is_packed(native_bf16, llama_dir, monkeypatch):
    """pack_bf16_weights=None (the default) packs while the copy takes at most a quarter of the
    available memory; True packs anyway."""
    size = linear_bytes(Engine(llama_dir, dtype="bfloat16", max_seq_len=128)._runner.model)
    kv = KvCacheConfig(max_tokens=2048)  # (a configured pool: no memory probe)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 4 * size)
    assert Engine(llama_dir, dtype="bfloat16", max_seq_len=128, kv_cache_config=kv)._runner.model.packed
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 4 * size - 1)
    assert not Engine(llama_dir, dtype="bfloat16", max_seq_len=128, kv_cache_config=kv)._runner.model.packed
    forced = Engine(llama_dir, dtype="bfloat16", max_seq_len=128, kv_cache_config=kv, pack_bf16_weights=True)
    assert forced.startup_report()["packed_weight_bytes"] == size


@torch.inference_mode()
def test_packed_and_plain_forwards_give_the_same_logits(native_bf16, llama_dir, monkeypatch):
    """A 12-token prefill (past the rows of pyengine's own bf16 kernel: the packed GEMMs), the
    same model with and without packed weights: logits equal to bf16 rounding, and the same
    argmax wherever the top two are further apart than that."""
    packed = Engine(llama_dir, dtype="bfloat16", max_seq_len=128)
    plain = Engine(llama_dir, dtype="bfloat16", max_seq_len=128, pack_bf16_weights=False)
    calls = []
    real = packed_gemm.packed_linear
    monkeypatch.setattr(packed_gemm, "packed_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    prompt = [(7 * i + 3) % 500 for i in range(12)]
    logits = []
    for engine in (packed, plain):
        out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5,
                                                       prompt_logprobs=5), use_tqdm=False)[0]
        logits.append(out)
    assert calls and all(rows > packed._runner.model.bf16_kernel_max_rows for rows in calls)
    a, b = logits
    positions = 0
    for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):  # token -> logprob, top 5
        top_a = sorted(pa, key=lambda t: -pa[t])
        top_b = sorted(pb, key=lambda t: -pb[t])
        diff = max(abs(pa[t] - pb[t]) for t in pa if t in pb)
        assert diff < 0.05
        if pa[top_a[0]] - pa[top_a[1]] > 2 * diff:
            assert top_a[0] == top_b[0]
        positions += 1
    assert positions == len(prompt) - 1
