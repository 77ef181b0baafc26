"""Guided decoding on a GPU: the bitmask applied on the device, every constraint kind valid, a
mixed batch equal to each request alone, with CUDA graphs and the overlap loop. Skipped without
a CUDA device (tests/gpu/conftest.py)."""

from __future__ import annotations

import pytest

from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig
from test_guided_decoding import KINDS, PROMPTS, check_valid, closers, constrained  # noqa: F401 (closers: autouse)


def gpu_engine(model_dir, **kw) -> Engine:
    return Engine(model_dir, device="cuda", max_seq_len=512, seed=0, kv_cache_config=KvCacheConfig(max_tokens=8192),
                  scheduler_config=SchedulerConfig(max_batch_size=16, max_num_tokens=512), **kw)


@pytest.fixture(scope="module")
def gpu_llama(checkpoint_factory):
    return checkpoint_factory("gpu_llama_gqa", model_type="llama", hidden_size=256, num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize("kw", [dict(), dict(overlap=True), dict(cuda_graphs=False)])
def test_constrained_outputs_on_the_gpu(gpu_llama, kw):
    prompts = [PROMPTS[i % 4] for i in range(10)]
    params = [constrained(KINDS[i % 5], seed=i) for i in range(10)]
    engine = gpu_engine(gpu_llama, **kw)
    outs = engine.generate(prompts, params, use_tqdm=False)
    for o, sp in zip(outs, params):
        assert o.finish_reason == "stop", o.text
        check_valid(sp.guided_decoding.kind, o.text)
    alone = [engine.generate(p, sp, use_tqdm=False)[0].token_ids for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in outs] == alone
    engine.check_resources()
