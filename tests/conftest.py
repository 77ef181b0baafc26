"""Shared fixtures: tiny real checkpoints, the Hugging Face reference, and the
pool-conservation check that runs after every test that creates an engine."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch

from pyengine import Engine
from pyengine.testing.checkpoints import build_tiny_checkpoint

torch.set_num_threads(2)


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
