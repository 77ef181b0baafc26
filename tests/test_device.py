"""The device argument and the GPU-only options, checked where they are given (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

import pyengine.core._core as _core
from pyengine import Engine, KvCacheConfig, SchedulerConfig, StartupError
from pyengine.layers import attention as kernels
from pyengine.runtime.device import resolve_device


def engine_kwargs(**kw):
    return dict(max_seq_len=64, kv_cache_config=kw.pop("kv", KvCacheConfig(max_tokens=256)),
                scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=64), **kw)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_fails_in_the_config_phase(llama_dir):
    with pytest.raises(StartupError, match=r"phase 'config'.*device='cuda': torch sees no CUDA device") as info:
        Engine(llama_dir, device="cuda", **engine_kwargs())
    assert isinstance(info.value.error, ValueError)


@pytest.mark.parametrize("device", ["tpu", "cuda:x", 3.5])
def test_unknown_devices_are_named(llama_dir, device):
    with pytest.raises(StartupError, match=r"device must be 'cpu', 'cuda' or 'cuda:N', got"):
        Engine(llama_dir, device=device, **engine_kwargs())


def test_cpu_device_and_report(llama_dir):
    engine = Engine(llama_dir, device=torch.device("cpu"), **engine_kwargs())
    report = engine.startup_report()
    assert report["device"] == "cpu"
    assert report["cuda_graph_batch_sizes"] == []  # graphs are a GPU matter
    assert resolve_device("cpu") == torch.device("cpu")


def test_fp8_cache_needs_cuda(llama_dir):
    with pytest.raises(StartupError, match=r"phase 'config'.*float8_e4m3' needs device='cuda'"):
        Engine(llama_dir, dtype="bfloat16", **engine_kwargs(kv=KvCacheConfig(max_tokens=256, dtype="float8_e4m3")))


def test_kv_scales_are_checked():
    with pytest.raises(ValueError, match=r"k_scale=2.0 applies to a float8_e4m3 cache only"):
        KvCacheConfig(k_scale=2.0)
    with pytest.raises(ValueError, match=r"v_scale must be a positive finite number, got -1.0"):
        KvCacheConfig(dtype="float8_e4m3", v_scale=-1.0)
    assert KvCacheConfig(dtype="float8_e4m3", k_scale=0.5).k_scale == 0.5


def test_graph_options_are_checked_on_any_device(llama_dir):
    with pytest.raises(StartupError, match=r"cuda_graphs must be a bool, got 'yes'"):
        Engine(llama_dir, cuda_graphs="yes", **engine_kwargs())
    with pytest.raises(StartupError, match=r"cuda_graph_batch_sizes entry 5 is not an int in \[1, 4\]"):
        Engine(llama_dir, cuda_graph_batch_sizes=[1, 5], **engine_kwargs())


def test_cpu_kernels_reject_fp8_and_scales():
    q = torch.zeros(1, 2, 16)
    cache = torch.zeros(2, 2, 8, 16)
    idx = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="the CPU kernels have no fp8 cache, so the scales must be 1.0"):
        kernels.paged_attention(q, cache, cache, idx, idx[:1], idx.view(1, 2), 1.0, k_scale=2.0)
    with pytest.raises(ValueError, match="cache_dtype: float8_e4m3 is a CUDA-only KV cache type"):
        _core._paged_attention(q.data_ptr(), 32, q.data_ptr(), 32, 0, cache.data_ptr(), cache.data_ptr(), 3,
                               idx.data_ptr(), idx.data_ptr(), idx.data_ptr(), 1, 1, 2, 2, 2, 16, 8, 2, 1.0, 0, 1)
    with pytest.raises(ValueError, match="src_dtype: float8_e4m3 is a CUDA-only KV cache type"):
        _core._store_kv(q.data_ptr(), q.data_ptr(), 32, 32, 3, cache.data_ptr(), cache.data_ptr(), 0,
                        idx.data_ptr(), 1, 2, 16, 8, 2)


def test_builds_without_cuda_say_so():
    if _core._cuda_kernels_built():
        pytest.skip("this build has the CUDA kernels (tests/test_cuda_build.py covers it)")
    assert _core._cuda_architectures() == ""
