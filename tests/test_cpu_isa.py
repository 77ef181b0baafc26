"""The instruction-set level of the CPU kernels: what `pyengine.cpu_info()` reports, and
PYENGINE_CPU_ISA as a user sets it (in a fresh process: the level is decided at the first kernel
call of a process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import pyengine.core._core as _core
from pyengine import cpu_info
from pyengine.layers.cpu_features import CPU_ISA_LEVELS, set_cpu_isa


def run_python(code: str, env_isa: str | None, env_vnni: str | None = None,
               env_amx: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYENGINE_CPU_ISA", "PYENGINE_CPU_VNNI", "PYENGINE_CPU_AMX")}
    if env_isa is not None:
        env["PYENGINE_CPU_ISA"] = env_isa
    if env_vnni is not None:
        env["PYENGINE_CPU_VNNI"] = env_vnni
    if env_amx is not None:
        env["PYENGINE_CPU_AMX"] = env_amx
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_cpu_info_names_the_active_level_and_why():
    info = cpu_info()
    assert info.supported[0] == "generic" and set(info.supported) <= set(CPU_ISA_LEVELS)
    assert info.isa in info.supported
    assert info.isa in str(info) and info.model in str(info)


def test_default_is_the_highest_supported_level():
    done = run_python("import pyengine; i = pyengine.cpu_info(); print(i.isa, i.supported[-1], '|', i.reason)", None)
    assert done.returncode == 0, done.stderr
    top, highest, reason = done.stdout.split(" ", 2)[0], done.stdout.split(" ", 2)[1], done.stdout.split("|")[1]
    assert top == highest
    assert reason.strip() == "the highest level this CPU supports"


def test_environment_forces_a_lower_level():
    done = run_python("import pyengine; i = pyengine.cpu_info(); print(i.isa, '|', i.reason)", "generic")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["generic", "|", "PYENGINE_CPU_ISA=generic"]


@pytest.mark.parametrize("value", ["sse4", "unavailable"])
def test_a_bad_value_fails_engine_start_up_naming_the_levels(llama_dir, value):
    supported = _core._supported_cpu_isas()
    if value == "unavailable":
        missing = [lvl for lvl in CPU_ISA_LEVELS if lvl not in supported]
        value = "neon" if "neon" in missing else missing[-1]
    code = (f"from pyengine import Engine, StartupError\n"
            f"try:\n    Engine({str(llama_dir)!r})\n"
            f"except StartupError as e:\n    print('phase', e.phase, '|', e)\n")
    done = run_python(code, value)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("phase config |"), done.stdout
    assert f"PYENGINE_CPU_ISA={value}" in done.stdout
    assert f"this CPU has {', '.join(supported)}" in done.stdout


def test_vnni_is_used_where_the_level_and_the_cpu_have_it():
    code = ("import pyengine, pyengine.core._core as c\n"
            "for lvl in c._supported_cpu_isas():\n"
            "    c._set_cpu_isa(lvl); print(lvl, pyengine.cpu_info().vnni or '-')\n")
    flags = set(_core._cpu_feature_flags())
    expected = {"generic": "-", "avx2": "avx_vnni" if "avx_vnni" in flags else "-",
                "avx512": "avx512_vnni" if "avx512_vnni" in flags else "-", "neon": "-"}
    for env, want in ((None, expected), ("1", expected), ("0", dict.fromkeys(expected, "-"))):
        done = run_python(code, None, env)
        assert done.returncode == 0, done.stderr
        got = dict(line.split() for line in done.stdout.splitlines())
        assert got == {lvl: want[lvl] for lvl in got}, (env, got)
        assert list(got) == _core._supported_cpu_isas()


def test_set_cpu_vnni_returns_the_previous_setting():
    from pyengine.layers.cpu_features import set_cpu_vnni
    previous = set_cpu_vnni(False)
    try:
        assert cpu_info().vnni == "" and not _core._cpu_vnni()
        assert set_cpu_vnni(True) is False
        assert bool(cpu_info().vnni) == (_core._cpu_vnni_flag(_core._cpu_isa()) in _core._cpu_feature_flags())
    finally:
        set_cpu_vnni(previous)


def test_amx_is_used_at_avx512_where_the_cpu_and_the_os_have_it():
    """The quantized kernels' AMX path: only at level avx512, only with amx_tile, amx_bf16 and
    avx512_bf16 (and Linux's grant of the tile state, which a kernel from 5.16 on gives), off with
    PYENGINE_CPU_AMX=0."""
    code = ("import pyengine, pyengine.core._core as c\n"
            "for lvl in c._supported_cpu_isas():\n"
            "    c._set_cpu_isa(lvl); print(lvl, pyengine.cpu_info().amx or '-')\n")
    flags = set(_core._cpu_feature_flags())
    has = {"amx_tile", "amx_bf16", "avx512_bf16"} <= flags
    expected = {"generic": "-", "avx2": "-", "avx512": "amx_bf16" if has else "-", "neon": "-"}
    for env, want in ((None, expected), ("1", expected), ("0", dict.fromkeys(expected, "-"))):
        done = run_python(code, None, None, env)
        assert done.returncode == 0, done.stderr
        got = dict(line.split() for line in done.stdout.splitlines())
        assert got == {lvl: want[lvl] for lvl in got}, (env, got)


def test_set_cpu_amx_returns_the_previous_setting():
    from pyengine.layers.cpu_features import set_cpu_amx
    previous = set_cpu_amx(False)
    try:
        assert cpu_info().amx == "" and not _core._cpu_amx()
        assert set_cpu_amx(True) is False
        assert bool(cpu_info().amx) == _core._cpu_amx()
        # the kernels' part of the description (its flags list names what the CPU has, used or not)
        kernels_part = str(cpu_info()).split("; flags:")[0]
        assert ("amx_bf16" in kernels_part) == _core._cpu_amx()
    finally:
        set_cpu_amx(previous)


def test_a_bad_amx_value_fails_like_a_bad_vnni_value():
    done = run_python("import pyengine\ntry:\n    pyengine.cpu_info()\nexcept ValueError as e:\n    print(e)\n",
                      None, None, "on")
    assert done.returncode == 0, done.stderr
    assert "PYENGINE_CPU_AMX=on: must be 0 (off) or 1 (on where the CPU has it)" in done.stdout, done.stdout


def test_a_bad_vnni_value_fails_engine_start_up(llama_dir):
    code = (f"from pyengine import Engine, StartupError\n"
            f"try:\n    Engine({str(llama_dir)!r})\n"
            f"except StartupError as e:\n    print('phase', e.phase, '|', e)\n")
    done = run_python(code, None, "yes")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("phase config |"), done.stdout
    assert "PYENGINE_CPU_VNNI=yes: must be 0 (off) or 1 (on where the CPU has it)" in done.stdout


def test_the_cli_reports_a_bad_value_in_one_line(llama_dir):
    env = {k: v for k, v in os.environ.items() if k != "PYENGINE_CPU_ISA"}
    done = subprocess.run([sys.executable, "-m", "pyengine", "generate", "--model", str(llama_dir), "--prompt", "hi"],
                          capture_output=True, text=True, timeout=120, env={**env, "PYENGINE_CPU_ISA": "avx1024"})
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1 and "PYENGINE_CPU_ISA=avx1024" in done.stderr, done.stderr


def test_set_cpu_isa_refuses_unknown_and_unavailable_levels():
    before = _core._cpu_isa()
    with pytest.raises(ValueError, match=r"unknown CPU instruction-set level 'avx3'.*this CPU has generic"):
        set_cpu_isa("avx3")
    missing = [lvl for lvl in CPU_ISA_LEVELS if lvl not in _core._supported_cpu_isas()]
    with pytest.raises(ValueError, match=f"this CPU does not support {missing[0]}; this CPU has generic"):
        set_cpu_isa(missing[0])
    assert _core._cpu_isa() == before  # nothing changed


def test_core_reports_the_cpu_features_and_model_as_proc_cpuinfo_does():
    # The C++ side detects them itself (cpuid / HWCAP); on Linux x86-64 they must match the kernel's view.
    flags = _core._cpu_feature_flags()
    assert len(flags) == len(set(flags))
    if not sys.platform.startswith("linux") or os.uname().machine != "x86_64":
        pytest.skip("compared with /proc/cpuinfo on x86-64 Linux")
    with open("/proc/cpuinfo") as f:
        lines = [line.split(":", 1) for line in f if ":" in line]
    info = {k.strip(): v.strip() for k, v in reversed(lines)}  # the first CPU's values
    known = ["sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
             "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16"]
    assert flags == [f for f in known if f in info["flags"].split()]
    assert _core._cpu_model_name() == info["model name"]


def test_cpu_info_needs_no_proc(monkeypatch):
    """Where /proc is absent (macOS, some containers) cpu_info() reports the same flags and model:
    they come from the C++ core's detection, not from /proc/cpuinfo."""
    import builtins

    from pyengine.layers import cpu_features

    cpu_features.cpu_flags.cache_clear()
    cpu_features.cpu_model.cache_clear()
    expected = cpu_features.cpu_info()
    real_open = builtins.open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_proc)
    cpu_features.cpu_flags.cache_clear()
    cpu_features.cpu_model.cache_clear()
    try:
        info = cpu_features.cpu_info()
    finally:
        cpu_features.cpu_flags.cache_clear()
        cpu_features.cpu_model.cache_clear()
    assert info == expected
    if os.uname().machine == "x86_64":
        assert info.model == _core._cpu_model_name() != ""
        assert ("avx2" in info.flags) == ("avx2" in info.supported)
