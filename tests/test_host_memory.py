"""Host memory figures with and without /proc (pyengine/runtime/host_memory.py): a system
without /proc (macOS, some containers) still sizes the KV cache."""

from __future__ import annotations

import builtins
import os

import pytest

from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig
from pyengine.runtime import host_memory

HAVE_PROC = os.path.exists("/proc/meminfo") and os.path.exists("/proc/self/status")


def fake_proc(tmp_path, meminfo: str, status: str):
    (tmp_path / "self").mkdir()
    (tmp_path / "meminfo").write_text(meminfo)
    (tmp_path / "self" / "status").write_text(status)
    return tmp_path


def test_proc_files_are_read_in_bytes(tmp_path, monkeypatch):
    proc = fake_proc(tmp_path, "MemTotal:  1000 kB\nMemFree: 10 kB\nMemAvailable:   523 kB\n",
                     "Name:\tpython\nVmHWM:\t  900 kB\nVmRSS:\t  700 kB\n")
    monkeypatch.setattr(host_memory, "PROC", str(proc))
    assert host_memory.available_bytes() == 523 * 1024
    assert host_memory.rss_bytes() == 700 * 1024
    assert host_memory.peak_rss_bytes() == 900 * 1024


def test_a_proc_file_without_the_field_is_an_error(tmp_path, monkeypatch):
    proc = fake_proc(tmp_path, "MemTotal: 1000 kB\n", "VmRSS: 1 kB\n")
    monkeypatch.setattr(host_memory, "PROC", str(proc))
    with pytest.raises(OSError, match=f"MemAvailable not in {proc}/meminfo"):
        host_memory.available_bytes()


def hide_psutil(monkeypatch):
    real_import = builtins.__import__

    def no_psutil(name, *args, **kwargs):
        if name == "psutil":
            raise ImportError("no psutil here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_psutil)


@pytest.mark.skipif(not HAVE_PROC, reason="compares the fallbacks with /proc's figures")
def test_without_proc_the_fallbacks_agree_with_proc(tmp_path, monkeypatch):
    with_proc = (host_memory.available_bytes(), host_memory.rss_bytes(), host_memory.peak_rss_bytes())
    monkeypatch.setattr(host_memory, "PROC", str(tmp_path / "absent"))
    hide_psutil(monkeypatch)
    available, rss, peak = host_memory.available_bytes(), host_memory.rss_bytes(), host_memory.peak_rss_bytes()
    # sysconf's available pages are the free ones (no reclaimable cache): never more than MemAvailable
    assert 0 < available <= with_proc[0] * 1.05
    # without a current figure the resident set is bounded by the all-time high-water mark
    assert rss == peak >= with_proc[1] * 0.95
    assert host_memory.reset_peak_rss() is False


def test_without_proc_or_sysconf_the_error_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(host_memory, "PROC", str(tmp_path / "absent"))
    hide_psutil(monkeypatch)

    def no_sysconf(name):
        raise ValueError(f"unrecognized configuration name {name!r}")

    monkeypatch.setattr(os, "sysconf", no_sysconf)
    with pytest.raises(OSError, match=r"cannot tell the available memory.*install psutil, or size the KV cache "
                                      r"with KvCacheConfig\(max_tokens=\.\.\.\)"):
        host_memory.available_bytes()


def test_an_engine_sizes_its_kv_cache_without_proc(llama_dir, tmp_path, monkeypatch):
    """The start-up measurement runs on the fallbacks and generates the same tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=6)
    config = dict(scheduler_config=SchedulerConfig(max_batch_size=2), max_seq_len=128,
                  kv_cache_config=KvCacheConfig(free_memory_fraction=0.01))
    with Engine(llama_dir, **config) as engine:
        expected = engine.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids
    monkeypatch.setattr(host_memory, "PROC", str(tmp_path / "absent"))
    hide_psutil(monkeypatch)
    with Engine(llama_dir, **config) as engine:
        report = engine.startup_report()["kv_capacity"]
        assert report["source"] == "estimated" and report["num_blocks"] > 0
        assert report["rss_peak"] >= report["rss_after"] > 0
        assert engine.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids == expected
