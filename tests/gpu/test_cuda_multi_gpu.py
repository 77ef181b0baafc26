"""device="cuda:1" runs on device 1 while torch's current device is 0: every CUDA entry point
makes its tensors' device current in pyengine's own (static) CUDA runtime for the call, and
gives the previous one back. Needs two CUDA devices (skipped otherwise, and without any:
tests/gpu/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from hf_reference import hf_greedy
from paged_kv import make_paged_kv, ref_attention
from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2,
                                reason=f"needs 2 CUDA devices, {torch.cuda.device_count()} visible")

DEV1 = torch.device("cuda", 1)


@pytest.fixture
def current_device_0():
    previous = torch.cuda.current_device() if torch.cuda.is_available() else 0
    torch.cuda.set_device(0)
    yield
    torch.cuda.set_device(previous)


@pytest.mark.parametrize("specs, dtype", [
    ([(300, 1), (2000, 1)], torch.bfloat16),        # decode: split-K, > 48 KiB of shared memory
    ([(500, 100), (40, 1)], torch.bfloat16),        # prefill: tensor cores
    ([(700, 300), (90, 1)], torch.float32),         # fp32 prefill: split-K
])
def test_kernels_run_on_the_device_of_their_tensors(current_device_0, specs, dtype):
    from pyengine.layers import _attention_cuda as ck

    nh, nkv, hd, tpb = 8, 4, 128, 16
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache, qsl, seq_lens, block_tables, kvs = make_paged_kv(specs, nkv, hd, tpb, dtype, gen, device=DEV1)
    num_tokens = sum(q for _, q in specs)
    query = torch.randn(num_tokens, nh, hd, generator=gen).to(DEV1).to(dtype)
    max_ctx = max(L for L, _ in specs)
    ws = ck.paged_attention_workspace(num_tokens, nh, hd, max_ctx, DEV1)
    out = ck.paged_attention(query, k_cache, v_cache, qsl, seq_lens, block_tables, hd ** -0.5,
                             max_query_len=max(q for _, q in specs), max_context_len=max_ctx, workspace=ws)
    assert torch.cuda.current_device() == 0, "the call left another device current"
    torch.cuda.synchronize(DEV1)
    assert out.device == DEV1
    ref = ref_attention(query, kvs, specs, hd ** -0.5, 0, torch.float32)
    tol = 2e-4 if dtype == torch.float32 else 2.5e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_store_kv_writes_on_the_device_of_its_tensors(current_device_0):
    from pyengine.layers import _attention_cuda as ck

    key = torch.randn(5, 2, 64, device=DEV1, dtype=torch.bfloat16)
    value = torch.randn(5, 2, 64, device=DEV1, dtype=torch.bfloat16)
    k_cache = torch.zeros(4, 2, 16, 64, device=DEV1, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([0, 17, 18, 40, 63], dtype=torch.int32, device=DEV1)
    ck.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(DEV1)
    blocks, offsets = (slots // 16).long(), (slots % 16).long()
    assert torch.equal(k_cache[blocks, :, offsets], key)
    assert torch.equal(v_cache[blocks, :, offsets], value)


def test_an_engine_on_cuda_1_generates_there(current_device_0, checkpoint_factory):
    model_dir = checkpoint_factory("gpu_multi_llama", model_type="llama", hidden_size=256, num_heads=4,
                                   num_kv_heads=2)
    torch.cuda.synchronize(0)
    on_device_0 = torch.cuda.memory_allocated(0)
    engine = Engine(model_dir, dtype="float32", device="cuda:1", max_seq_len=512, seed=0,
                    kv_cache_config=KvCacheConfig(max_tokens=4096),
                    scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=256))
    assert engine._runner.kv_pool.device == DEV1
    prompts = [[5, 9, 33, 7] * 80, [11, 3, 250], list(range(3, 60))]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results = engine.generate(prompts, params, use_tqdm=False)
    assert torch.cuda.current_device() == 0
    assert torch.cuda.memory_allocated(0) == on_device_0, "the engine allocated on device 0"
    for p, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(model_dir, p, 16, device="cuda:1"), f"prompt of {len(p)} tokens"
