"""Two attention kernels that each need more than 48 KiB of dynamic shared memory both run in
one process: each gets its own opt-in (csrc/kernels/cuda/smem_opt_in.h). Before, the opt-in was
remembered once for every kernel of one type -- and every attention kernel has the same type --
so the second kernel a process launched failed. Run in a fresh process, so that these are the
first kernels it launches, whatever ran before. Skipped without a CUDA device
(tests/gpu/conftest.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Decode kernels (split-K, SIMT): their two-stage K/V tiles alone take 64 KiB of shared memory
# (tests/gpu/test_cuda_kernels.py's run_case checks each against PyTorch).
CHILD = f"""
import sys
sys.path[:0] = [{str(HERE)!r}, {str(HERE.parent)!r}]
import torch
from test_cuda_kernels import run_case
run_case([(300, 1), (2000, 1)], 16, 8, 128, 16, torch.bfloat16)  # bf16, head_dim 128
run_case([(300, 1), (2000, 1)], 8, 4, 64, 16, torch.float16)     # fp16, head_dim 64
run_case([(300, 1), (700, 1)], 4, 4, 256, 16, torch.float32)     # fp32, head_dim 256
print("all kernels ran")
"""


def test_each_kernel_gets_its_shared_memory_opt_in():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all kernels ran" in done.stdout
