"""bench/common.py's CPU-level emulation: the settings it restarts a benchmark with (os.execve
is replaced here: nothing restarts, nothing is timed)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common  # noqa: E402

AVX2_SETTINGS = {
    "PYENGINE_CPU_ISA": "avx2",
    "PYENGINE_CPU_VNNI": "0",
    "PYENGINE_BF16_MATMUL": "fp32",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "PYENGINE_BENCH_EMULATED_CPU": "avx2",
}


@pytest.fixture
def no_restart(monkeypatch):
    monkeypatch.setattr(common.os, "execve", lambda *args: pytest.fail(f"restarted: {args[:2]}"))


def test_unknown_level_names_the_known_ones(no_restart):
    with pytest.raises(ValueError, match=r"unknown CPU level 'avx9'; one of avx2$"):
        common.emulate_cpu_level("avx9")


def test_no_level_runs_as_it_is(no_restart, monkeypatch):
    monkeypatch.delenv("PYENGINE_BENCH_EMULATED_CPU", raising=False)
    common.emulate_cpu_level(None)
    assert common.emulated_cpu_level() is None


def test_an_unknown_level_in_the_environment_is_named(monkeypatch):
    monkeypatch.setenv("PYENGINE_BENCH_EMULATED_CPU", "avx9")
    with pytest.raises(ValueError, match=r"^PYENGINE_BENCH_EMULATED_CPU='avx9' is not a CPU level; one of avx2 "):
        common.emulated_cpu_level()


def test_restarts_the_same_command_with_the_settings(monkeypatch):
    calls = []
    monkeypatch.setattr(common.os, "execve", lambda exe, argv, env: calls.append((exe, argv, env)))
    for name in AVX2_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYENGINE_TEST_KEPT", "1")
    command = [sys.executable, "-X", "utf8", "bench/throughput.py", "--emulate-cpu", "avx2", "--quick"]
    monkeypatch.setattr(common.sys, "orig_argv", command)
    common.emulate_cpu_level("avx2")
    assert len(calls) == 1
    exe, argv, env = calls[0]
    assert exe == sys.executable
    assert argv == command  # the interpreter's options and the script's arguments as given
    assert {k: env[k] for k in AVX2_SETTINGS} == AVX2_SETTINGS
    assert env["PYENGINE_TEST_KEPT"] == "1" and env["PATH"] == os.environ["PATH"]


def test_a_restarted_process_runs_on(no_restart, monkeypatch):
    for name, value in AVX2_SETTINGS.items():
        monkeypatch.setenv(name, value)
    common.emulate_cpu_level("avx2")
    assert common.emulated_cpu_level() == "avx2"


def test_a_setting_overridden_by_hand_is_restored(monkeypatch):
    calls = []
    monkeypatch.setattr(common.os, "execve", lambda exe, argv, env: calls.append(env))
    for name, value in AVX2_SETTINGS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    common.emulate_cpu_level("avx2")
    assert len(calls) == 1 and calls[0]["ONEDNN_MAX_CPU_ISA"] == "AVX2"


def test_the_option_takes_the_known_levels_only(capsys):
    import argparse

    p = argparse.ArgumentParser(prog="bench")
    common.add_emulate_cpu_option(p)
    assert p.parse_args([]).emulate_cpu is None
    assert p.parse_args(["--emulate-cpu", "avx2"]).emulate_cpu == "avx2"
    with pytest.raises(SystemExit):
        p.parse_args(["--emulate-cpu", "avx9"])
    assert "invalid choice: 'avx9' (choose from 'avx2')" in capsys.readouterr().err
