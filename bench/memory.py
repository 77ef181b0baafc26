"""Process memory after loading a model, each measurement in a fresh process.

- **pyengine**: a subprocess imports pyengine (and loads the model's tokenizer once, so that
  the libraries Engine(...) imports are resident), reads its VmRSS, builds the Engine with a
  small KV pool (``KvCacheConfig(max_tokens=..., free_memory_fraction=None)``: no worst-case
  dummy batch), and reads VmRSS again: the difference is what loading the model costs. It
  also reports the peak during loading (VmHWM), the RSS after ``malloc_trim(0)`` (glibc hands
  back the free memory it keeps in its heaps), the model's weight bytes (quantized blocks
  and float tensors, tied weights once) and the KV pool's bytes.
- **llama.cpp**: the peak RSS of one run of one of its tools (``ru_maxrss`` of that child,
  read in a small helper interpreter that runs it). Its weights are mmap'd from the GGUF
  file; the pages it touched count.

    python bench/memory.py MODEL_DIR [--dtype float32] [--quantization q4_k] [--lm-head-quantization q4_0]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def proc_status(*fields: str, pid: str = "self") -> dict[str, int]:
    """``VmRSS``, ``VmHWM``, ... of /proc/<pid>/status, in bytes."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name = line.split(":", 1)[0]
            if name in fields:
                out[name] = int(line.split()[1]) * 1024
    return out


def mapped_rss(path_prefix: str) -> int:
    """Resident bytes of this process's mappings of files under ``path_prefix`` (/proc/self/smaps):
    e.g. a checkpoint that safetensors still has mmap'd."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and not parts[0].endswith(":"):
                inside = len(parts) >= 6 and parts[5].startswith(path_prefix)
            elif inside and parts[0] == "Rss:":
                total += int(parts[1]) * 1024
    return total


def model_weight_bytes(model) -> dict[str, int]:
    """Bytes of a pyengine model's weights, each tensor once (tied embeddings): ``quantized``
    (llama.cpp blocks), ``float`` (tensors kept in the model's dtype: norms, biases, and the
    unquantized matrices)."""
    from pyengine.quant import QUANT_FORMATS

    by_format = model.weight_bytes_by_format
    quantized = sum(n for f, n in by_format.items() if f in QUANT_FORMATS)
    return {"quantized": quantized, "float": sum(by_format.values()) - quantized}


def _child(args: argparse.Namespace) -> dict:
    """Runs in the fresh subprocess."""
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig
    from pyengine.models import ModelConfig, model_class

    AutoTokenizer.from_pretrained(args.model_dir)  # the tokenizer libraries, resident before the baseline
    gc.collect()
    fields = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    before = proc_status(*fields)
    t0 = time.perf_counter()
    engine = Engine(args.model_dir, dtype=args.dtype, quantization=args.quantization,
                    lm_head_quantization=args.lm_head_quantization, max_seq_len=args.max_seq_len,
                    kv_cache_config=KvCacheConfig(max_tokens=args.max_seq_len, free_memory_fraction=None,
                                                  enable_block_reuse=False),
                    scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=512))
    seconds = time.perf_counter() - t0
    after = proc_status(*fields)
    model = engine._parts.runner.model
    weights = model_weight_bytes(model)
    cap = engine._parts.capacity
    plan = engine._parts.quant_plan
    res = {
        "dtype": args.dtype, "quantization": args.quantization, "lm_head_quantization": args.lm_head_quantization,
        "load_seconds": round(seconds, 2),
        "rss_before": before["VmRSS"], "rss_after_load": after["VmRSS"], "hwm_after_load": after["VmHWM"],
        "rss_anon_before": before["RssAnon"], "rss_anon_after_load": after["RssAnon"],
        "rss_file_before": before["RssFile"], "rss_file_after_load": after["RssFile"],
        # the checkpoint's files still mapped (safetensors mmaps them; a tensor kept as loaded holds the map)
        "checkpoint_mapped_rss": mapped_rss(str(Path(args.model_dir).resolve())),
        "weight_bytes": weights, "kv_pool_bytes": cap.num_blocks * cap.bytes_per_block,
        "kv_pool_tokens": cap.num_blocks * cap.tokens_per_block,
    }
    if plan is not None:
        mc = ModelConfig.from_model_dir(args.model_dir)
        names, _ = model_class(mc).weight_names(mc)
        res["quant_plan"] = plan.summary()
        res["quant_plan_report"] = dict(plan.report)
        res["float_1d_tensors"] = sum(1 for n in names if n not in plan.report)
    gc.collect()
    res["rss_after_gc"] = proc_status("VmRSS")["VmRSS"]
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        res["rss_after_malloc_trim"] = proc_status("VmRSS")["VmRSS"]
    except (OSError, AttributeError):  # not glibc
        res["rss_after_malloc_trim"] = None
    # one short request: the working set the runtime adds once it runs (KV blocks, activations)
    engine.generate([list(range(4, 36))], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                    use_tqdm=False)
    res["rss_after_request"] = proc_status("VmRSS")["VmRSS"]
    engine.shutdown()
    return res


def pyengine_load_rss(model_dir: Path | str, dtype: str = "float32", quantization: str | None = None,
                      threads: int = 2, max_seq_len: int = 512, timeout: float = 1800,
                      lm_head_quantization: str | None = None) -> dict:
    """The resident memory of loading the model into an Engine, measured in a fresh process
    (see the module docstring)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), str(model_dir), "--dtype", dtype,
           "--threads", str(threads), "--max-seq-len", str(max_seq_len), "--json-line"]
    if quantization:
        cmd += ["--quantization", quantization]
    if lm_head_quantization:
        cmd += ["--lm-head-quantization", lm_head_quantization]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=os.pathsep.join(
        [str(REPO_ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"memory measurement failed ({r.returncode}): {' '.join(cmd)}\n"
                           f"{(r.stdout + r.stderr)[-3000:]}")
    res = json.loads(lines[-1])
    res["command"] = " ".join(["python", "bench/memory.py", *cmd[3:]])
    return res


# Runs argv[1:] and prints its peak RSS. A child's ru_maxrss starts from the resident set of the
# process that forked it (the fork's copy of its address space, until exec): forking the tool from
# this small interpreter, not from the benchmark's large process, keeps that floor at a few MB.
_PEAK_HELPER = """
import json, resource, subprocess, sys, time
t0 = time.perf_counter()
r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(json.dumps({"peak_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
                  "returncode": r.returncode, "seconds": round(time.perf_counter() - t0, 2)}))
"""


def peak_rss_of(cmd: list, timeout: float = 1800) -> dict:
    """Runs ``cmd`` (output discarded) from a small helper interpreter and returns its peak
    resident set in bytes (``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`` in the helper,
    whose only child it is), its exit status and its wall time."""
    cmd = [str(c) for c in cmd]
    r = subprocess.run([sys.executable, "-S", "-c", _PEAK_HELPER, *cmd], capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"peak RSS helper failed ({r.returncode}):\n{r.stderr[-2000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["command"] = " ".join([Path(cmd[0]).name] + cmd[1:])
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default=None)
    p.add_argument("--lm-head-quantization", default=None, help="with --quantization: the output projection's format")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-seq-len", type=int, default=512, help="max_seq_len and the KV pool's tokens (default 512)")
    p.add_argument("--json-line", action="store_true", help="print the result as one JSON line (for the caller)")
    args = p.parse_args(argv)
    res = _child(args)
    if args.json_line:
        print(json.dumps(res))
    else:
        print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
