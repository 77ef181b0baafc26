"""GPUs older than compute capability 8.0 are refused with an error naming the device, its GPU
and capability (the CUDA kernels need cp.async and the SM80 tensor-core MMA). No GPU needed:
the rule is a function of (major, minor), and the engine's check runs on torch.cuda's answers,
which the last test stands in for."""

from __future__ import annotations

import pytest
import torch

import pyengine.runtime.device as device_mod
from pyengine import Engine, KvCacheConfig, SchedulerConfig, StartupError
from pyengine.runtime.device import check_compute_capability


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)])
def test_ampere_and_newer_pass(capability):
    check_compute_capability("cuda", 0, "some GPU", capability)


@pytest.mark.parametrize("capability", [(7, 5), (7, 0), (6, 1), (3, 7)])
def test_older_gpus_are_refused_by_name(capability):
    major, minor = capability
    with pytest.raises(ValueError, match=rf"device='cuda:1': CUDA device 1 \(Old GPU\) has compute capability "
                                         rf"{major}\.{minor}; pyengine's CUDA kernels need 8\.0 or newer"):
        check_compute_capability("cuda:1", 1, "Old GPU", capability)


def test_an_engine_on_an_old_gpu_fails_in_the_config_phase(llama_dir, monkeypatch):
    # torch.cuda as it answers on a machine with a Tesla T4 as its second GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (7, 5) if index == 1 else (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "Tesla T4" if index == 1 else "NVIDIA H100")
    monkeypatch.setattr(device_mod, "cuda_kernels_built", lambda: True)
    with pytest.raises(StartupError, match=r"phase 'config'.*device='cuda:1': CUDA device 1 \(Tesla T4\) has "
                                           r"compute capability 7\.5") as info:
        Engine(llama_dir, device="cuda:1", max_seq_len=64, kv_cache_config=KvCacheConfig(max_tokens=256),
               scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=64))
    assert isinstance(info.value.error, ValueError)
    assert device_mod.resolve_device("cuda:0") == torch.device("cuda", 0)  # the H100 passes
