"""Shared fixtures: tiny real checkpoints, the Hugging Face reference, and the
pool-conservation check that runs after every test that creates an engine."""

from __future__ import annotations

import platform
import weakref
from pathlib import Path

import pytest
import torch

import pyengine.core._core as _core
from pyengine import Engine, cpu_info
from pyengine.layers.cpu_features import set_cpu_isa
from pyengine.testing.checkpoints import build_tiny_checkpoint, build_truncated_checkpoint

torch.set_num_threads(2)

# The CPU kernels' instruction-set levels of this architecture (pyengine/cpu_isa.h).
ISA_LEVELS = ("generic", "neon") if platform.machine() in ("aarch64", "arm64") else ("generic", "avx2", "avx512")
_isa_levels_ran: dict[str, int] = {}
_isa_levels_missing: set[str] = set()


def _at_kernel_build(build: str, vnni: bool | None, amx: bool | None = None):
    """Sets the CPU kernels to `build` (a level; "<level>+vnni" for the quantized kernels' VNNI
    build, "<level>+amx" for their AMX path with VNNI) for one test and restores the previous
    setting after; a level, a VNNI or an AMX this CPU lacks is skipped, saying so (never silently
    run at another level). vnni / amx None leave that setting as it is."""
    level = build.partition("+")[0]
    supported = _core._supported_cpu_isas()
    if level not in supported:
        _isa_levels_missing.add(level)
        pytest.skip(f"CPU level {level} is not available on this CPU (it has {', '.join(supported)})")
    flag = _core._cpu_vnni_flag(level)
    if vnni and flag not in _core._cpu_feature_flags():
        _isa_levels_missing.add(build)
        pytest.skip(f"{build}: this CPU lacks {flag}")
    previous = _core._cpu_isa()
    previous_vnni = None if vnni is None else _core._set_cpu_vnni(vnni)
    previous_amx = None if amx is None else _core._set_cpu_amx(amx)
    set_cpu_isa(level)
    try:
        if amx and not _core._cpu_amx():
            _isa_levels_missing.add(build)
            pytest.skip(f"{build}: this CPU (or the OS) lacks AMX-BF16")
        _isa_levels_ran[build] = _isa_levels_ran.get(build, 0) + 1
        yield build
    finally:
        set_cpu_isa(previous)
        if previous_vnni is not None:
            _core._set_cpu_vnni(previous_vnni)
        if previous_amx is not None:
            _core._set_cpu_amx(previous_amx)


@pytest.fixture(params=ISA_LEVELS)
def cpu_isa(request):
    """Runs the test with every CPU kernel at one instruction-set level."""
    yield from _at_kernel_build(request.param, None)


# The quantized kernels' builds: every level, the x86 levels again with their VNNI, and avx512
# with its AMX path (batches of 16 rows or more).
QUANT_KERNEL_BUILDS = (ISA_LEVELS + tuple(f"{lvl}+vnni" for lvl in ISA_LEVELS if _core._cpu_vnni_flag(lvl))
                       + tuple(f"{lvl}+amx" for lvl in ISA_LEVELS if lvl == "avx512"))


@pytest.fixture(params=QUANT_KERNEL_BUILDS)
def quant_cpu_isa(request):
    """As cpu_isa, for the quantized kernels: each level without VNNI or AMX, then "<level>+vnni"
    with VNNI, then "avx512+amx" with both, skipped (saying so) where the CPU lacks the level, its
    VNNI or AMX."""
    build = request.param
    yield from _at_kernel_build(build, build.endswith(("+vnni", "+amx")), build.endswith("+amx"))


def pytest_report_header(config):
    return f"pyengine CPU: {cpu_info()}"


def pytest_terminal_summary(terminalreporter):
    if _isa_levels_ran or _isa_levels_missing:
        ran = ", ".join(f"{lvl} ({n} tests)" for lvl, n in _isa_levels_ran.items()) or "none"
        line = f"CPU kernel tests ran at instruction-set levels: {ran}"
        if _isa_levels_missing:
            line += f"; not available on this CPU: {', '.join(sorted(_isa_levels_missing))}"
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """build(name, **kwargs) -> model dir, built once per session."""
    built: dict[str, Path] = {}

    def build(name: str, **kwargs) -> Path:
        if name not in built:
            built[name] = build_tiny_checkpoint(tmp_path_factory.mktemp(name) / "model", **kwargs)
        return built[name]

    return build


@pytest.fixture(scope="session")
def llama_dir(checkpoint_factory) -> Path:
    return checkpoint_factory("llama_gqa", model_type="llama", num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="session")
def copying_dir(checkpoint_factory) -> Path:
    """A tiny Llama whose small initial weights make it repeat itself: prompt lookup's drafts
    are accepted about two times in three, rejected otherwise (speculative decoding's tests)."""
    return checkpoint_factory("llama_copying", model_type="llama", num_heads=4, num_kv_heads=2,
                              initializer_range=0.02)


@pytest.fixture(scope="session")
def draft_dir(copying_dir, tmp_path_factory) -> Path:
    """The copying model's first layer (of 2) as its draft model: its drafts are accepted about
    one time in three."""
    return build_truncated_checkpoint(copying_dir, tmp_path_factory.mktemp("draft") / "model", 1)


_engines: list[weakref.ref] = []
_original_init = Engine.__init__


def _tracking_init(self, *args, **kwargs):
    _original_init(self, *args, **kwargs)
    _engines.append(weakref.ref(self))


Engine.__init__ = _tracking_init  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def pools_are_conserved():
    """After each test: every engine it created, once drained, has all its blocks and sequence slots back."""
    _engines.clear()
    yield
    for ref in _engines:
        engine = ref()
        if engine is None or engine._closed:
            continue
        engine.check_resources()  # invariants hold even with requests left
        if engine.has_unfinished_requests():  # abort the leftovers and drain them
            for rec in list(engine._requests.records.values()):
                engine.abort_request(rec.request_id)
            while engine.has_unfinished_requests():
                engine.step()
        engine.check_resources()
        engine.shutdown()  # no worker thread outlives its test
    _engines.clear()
