"""Start-up assembly: named, timed phases; failures that name their phase and leave nothing
behind; the KV capacity measured and computed by the formula; garbage collection."""

from __future__ import annotations

import gc
import math
import threading
import weakref

import pytest
import torch

import pyengine.engine.startup as engine_module
from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig, StartupError, cpu_info
from pyengine.runtime.model_runner import LIVE_KV_POOLS
from pyengine.runtime.kv_capacity import CpuMemoryProbe

PHASES = ["config", "weights", "kv_capacity", "scheduler", "executor"]


def small(model_dir, **kv) -> Engine:
    return Engine(model_dir, max_seq_len=256, kv_cache_config=KvCacheConfig(tokens_per_block=8, **kv),
                  scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=64))


def test_report_lists_every_phase(llama_dir):
    report = small(llama_dir).startup_report()
    assert [p["name"] for p in report["phases"]] == PHASES
    assert all(p["seconds"] >= 0 for p in report["phases"])
    cap = report["kv_capacity"]
    assert cap["source"] == "estimated" and cap["rss_peak"] >= cap["rss_before"] > 0
    info = cpu_info()
    assert report["cpu_kernels"] == {"isa": info.isa, "reason": info.reason, "supported": list(info.supported),
                                     "vnni": info.vnni, "amx": info.amx}
    # fp32: up to 64 rows where the GEMM takes batches from 13 rows (avx2, avx512), else linear_f32's 16
    assert report["cpu_one_call_decode_max_rows"] == (64 if info.isa in ("avx2", "avx512") else 16)


def _nothing_left_behind(threads_before: int) -> None:
    gc.collect()
    assert len(LIVE_KV_POOLS) == 0, "a KV pool outlived the failed start-up"
    assert threading.active_count() == threads_before


@pytest.mark.parametrize("phase", PHASES)
def test_a_failure_in_each_phase_names_it_and_leaves_nothing(llama_dir, monkeypatch, phase):
    gc.collect()
    assert len(LIVE_KV_POOLS) == 0
    threads = threading.active_count()
    with monkeypatch.context() as m:
        kwargs = {}
        if phase == "config":
            kwargs = dict(dtype="float64")
            match = "phase 'config': ValueError: dtype must be one of"
        elif phase == "weights":
            m.setattr(engine_module, "load_tensors", _raiser(OSError("disk on fire")))
            match = "phase 'weights': OSError: disk on fire"
        elif phase == "kv_capacity":
            m.setattr(CpuMemoryProbe, "measure", _raiser(RuntimeError("estimator exploded")))
            match = "phase 'kv_capacity': RuntimeError: estimator exploded"
        elif phase == "scheduler":
            m.setattr(engine_module, "Sampler", _raiser(MemoryError("no memory for the sampler")))
            match = "phase 'scheduler': MemoryError: no memory for the sampler"
        else:
            real = engine_module.ModelRunner
            calls = []

            def second_fails(*args, **kw):  # pass 1's runner works; the real one does not
                calls.append(1)
                if len(calls) == 2:
                    raise MemoryError("cannot allocate the KV pool")
                return real(*args, **kw)
            m.setattr(engine_module, "ModelRunner", second_fails)
            match = "phase 'executor': MemoryError: cannot allocate the KV pool"
        with pytest.raises(StartupError, match=match) as info:
            Engine(llama_dir, max_seq_len=256, scheduler_config=SchedulerConfig(max_batch_size=4), **kwargs)
        assert info.value.phase == phase
        del info
    _nothing_left_behind(threads)
    engine = small(llama_dir)  # the next one works
    assert engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0].token_ids


def _raiser(error):
    def raise_(*args, **kwargs):
        raise error
    return raise_


def test_an_impossible_capacity_fails_in_its_phase(llama_dir):
    with pytest.raises(StartupError, match="phase 'kv_capacity'.*cannot cover the sequence slot pool"):
        small(llama_dir, max_memory_bytes=1000)
    with pytest.raises(StartupError, match="phase 'kv_capacity'.*fewer than max_seq_len=256"):
        Engine(llama_dir, max_seq_len=256, kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=128),
               scheduler_config=SchedulerConfig(max_batch_size=4))
    gc.collect()
    assert len(LIVE_KV_POOLS) == 0


def test_engine_is_garbage_collected_after_shutdown(llama_dir):
    engine = small(llama_dir)
    engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    ref = weakref.ref(engine)
    engine.shutdown()
    del engine
    gc.collect()
    assert ref() is None
    with small(llama_dir) as engine:
        ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None
    assert len(LIVE_KV_POOLS) == 0


def _bytes_per_block(model_dir, kv_dtype: torch.dtype, tpb: int = 8) -> int:
    from pyengine.models import ModelConfig
    c = ModelConfig.from_model_dir(model_dir)
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * torch.empty((), dtype=kv_dtype).element_size() * tpb


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float16"])
def test_capacity_follows_the_formula(llama_dir, kv_dtype, monkeypatch):
    torch_dtype = getattr(torch, kv_dtype)
    bpb = _bytes_per_block(llama_dir, torch_dtype)
    seat_cap = 4 * math.ceil(256 / 8)

    def check(engine, cap_bytes=None, cap_tokens=None):
        r = engine.startup_report()["kv_capacity"]
        assert r["bytes_per_block"] == bpb and r["source"] == "estimated"
        budget = int(r["available_bytes"] * r["free_memory_fraction"])
        for c in (cap_bytes, None if cap_tokens is None else math.ceil(cap_tokens / 8) * bpb):
            if c is not None:
                budget = min(budget, c)
        assert r["budget_bytes"] == budget
        assert r["num_blocks"] == min(budget // bpb, seat_cap)
        assert engine._runner.kv_pool.numel() * engine._runner.kv_pool.element_size() == r["num_blocks"] * bpb
        return r

    from pyengine.runtime.host_memory import available_bytes
    fraction = 60 * bpb / available_bytes()  # about 60 blocks: the fraction binds
    r = check(small(llama_dir, dtype=kv_dtype, free_memory_fraction=fraction))
    assert 40 < r["num_blocks"] < seat_cap
    r = check(small(llama_dir, dtype=kv_dtype, max_memory_bytes=50 * bpb + 7), cap_bytes=50 * bpb + 7)
    assert r["num_blocks"] == 50
    r = check(small(llama_dir, dtype=kv_dtype, max_tokens=8 * 40 - 3), cap_tokens=8 * 40 - 3)
    assert r["num_blocks"] == 40
    r = check(small(llama_dir, dtype=kv_dtype))  # only the seat cap
    assert r["num_blocks"] == seat_cap
    # skipping the estimate: max_tokens as is
    r = small(llama_dir, dtype=kv_dtype, max_tokens=8 * 33, free_memory_fraction=None).startup_report()["kv_capacity"]
    assert (r["source"], r["num_blocks"], r["available_bytes"]) == ("configured", 33, None)
    monkeypatch.setenv("PYENGINE_SKIP_KV_ESTIMATION", "1")
    r = small(llama_dir, dtype=kv_dtype, max_tokens=8 * 35).startup_report()["kv_capacity"]
    assert (r["source"], r["num_blocks"]) == ("configured", 35)
    with pytest.raises(StartupError, match="PYENGINE_SKIP_KV_ESTIMATION is set but KvCacheConfig.max_tokens is not"):
        small(llama_dir, dtype=kv_dtype)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_reduced_precision_kv_cache_stays_close(llama_dir, kv_dtype):
    prompts = [list(range(10, 70)), [5, 9, 44, 71]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = small(llama_dir).generate(prompts, params, use_tqdm=False)
    low = small(llama_dir, dtype=kv_dtype).generate(prompts, params, use_tqdm=False)
    agree = sum(a == b for r, l in zip(ref, low) for a, b in zip(r.token_ids, l.token_ids))
    assert agree >= 0.75 * 32


def test_bad_kv_cache_configs_are_named():
    with pytest.raises(ValueError, match="free_memory_fraction=None needs max_tokens"):
        KvCacheConfig(free_memory_fraction=None)
    with pytest.raises(ValueError, match="free_memory_fraction must be in \\(0, 1\\] or None, got 1.5"):
        KvCacheConfig(free_memory_fraction=1.5)
    with pytest.raises(ValueError, match="max_memory_bytes must be a positive int or None, got 0"):
        KvCacheConfig(max_memory_bytes=0)


def test_start_up_returns_the_freed_heap_last(llama_dir, monkeypatch):
    """A CPU engine's start-up ends by handing glibc's free heap pages back (malloc_trim): after
    every phase, so that what the KV capacity probe's and the step cost model's dummy batches
    freed is not left counted in the process's resident memory."""
    calls = []
    real = engine_module.release_free_heap
    monkeypatch.setattr(engine_module, "release_free_heap", lambda: calls.append(len(phases_seen)) or real())
    phases_seen: list = []
    real_phase = engine_module._phase

    def phase(phases, name):
        phases_seen.append(name)
        return real_phase(phases, name)

    monkeypatch.setattr(engine_module, "_phase", phase)
    engine = small(llama_dir)
    assert phases_seen == [p["name"] for p in engine.startup_report()["phases"]]
    assert calls == [len(phases_seen)]  # a float model: once, after the last phase
    engine.shutdown()
