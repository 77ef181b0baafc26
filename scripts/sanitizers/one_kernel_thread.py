"""pytest plugin for the ThreadSanitizer run of scripts/sanitize.sh: the CPU kernels on one thread.

gcc's OpenMP runtime (libgomp) is not built with TSan, so TSan does not see the barriers that
order an OpenMP parallel region's threads, and reports every kernel's shared reads and writes as
races. The kernels take their thread count from torch.get_num_threads(), which tests/conftest.py
sets to 2; this sets it to 1 before each test. TSan then checks the threads the engine itself
adds: the overlap loop's forward on its worker thread against the caller's thread.
"""

import pytest
import torch


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    torch.set_num_threads(1)
