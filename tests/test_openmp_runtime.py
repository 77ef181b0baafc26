"""One OpenMP runtime in the process: the extension's kernels and torch's share torch's libgomp
(two runtimes would each keep a pool of spinning worker threads competing for the same cores)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")

PROBE = r"""
import sys
{imports}
import pyengine.core._core as core
print(core._cpu_isa())
libs = sorted({{line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line or "libomp" in line}})
print("\n".join(libs))
"""


@pytest.mark.parametrize("imports", ["import pyengine", "", "import torch"])
def test_one_openmp_runtime_is_loaded(imports):
    """Whatever is imported first (pyengine, its extension directly, or torch), one OpenMP
    library is mapped, and it is torch's."""
    import torch

    done = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports)], capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(os.path.dirname(torch.__file__)))
    assert done.returncode == 0, done.stderr
    libs = done.stdout.split("\n", 1)[1].split()
    torch_lib = os.path.realpath(os.path.join(os.path.dirname(torch.__file__), "lib"))
    assert len(libs) == 1, libs
    if any(f.startswith("libgomp") for f in os.listdir(torch_lib)):  # torch's wheel ships its own
        assert os.path.realpath(os.path.dirname(libs[0])) == torch_lib, libs
