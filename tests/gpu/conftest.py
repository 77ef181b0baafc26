"""GPU tests: skipped, with the reason, where there is no CUDA device or no CUDA build."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import pyengine.core._core as _core

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ helpers (hf_reference, ...)


def pytest_collection_modifyitems(config, items):
    reason = None
    if not torch.cuda.is_available():
        reason = f"no CUDA device (torch {torch.__version__})"
    elif not _core._cuda_kernels_built():
        reason = "pyengine was built without its CUDA kernels"
    if reason is None:
        return
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.skip(reason=reason))
