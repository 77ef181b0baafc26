"""Micro-benchmark of pyengine's CUDA paged-attention kernels; needs a GPU.

Decode (flash-decoding): batch 64 x context {4k, 8k, 16k}, 16 query / 8 KV heads, head_dim 128,
bf16, tokens_per_block 16, shuffled blocks. Reports achieved bandwidth = (bytes of K+V read +
q + out) / time, as a fraction of (a) the device-to-device copy bandwidth measured in the same
run (a large tensor ``copy_``; read + write bytes / time) and (b) the 4.8 TB/s H200 datasheet
figure. Prefill (tensor cores): one causal chunk of {2k, 8k} tokens starting at position 0,
same heads; TFLOP/s (4 * q * k * head_dim * heads / 2 for the causal half) vs
``torch.nn.functional.scaled_dot_product_attention`` (flash backend where available) on the
same shapes with contiguous K/V. Times are CUDA-event medians after warm-up.

Usage: python bench/attention_cuda.py [--quick] [--iters N]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

# The CUDA kernels' Python entry points (paged_attention, paged_attention_workspace,
# architectures), used below only through this alias.
from pyengine.layers import _attention_cuda as ck

HEADS, KV_HEADS, HEAD_DIM, TPB = 16, 8, 128, 16
DATASHEET_BW = 4.8e12
DEV = "cuda"


def cuda_time(fn, iters, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth(iters):
    n = 2 << 30  # 2 GiB
    src = torch.empty(n, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), iters)
    del src, dst
    return 2 * n / t


def build(batch, ctx, q_len, gen):
    nb = (ctx + TPB - 1) // TPB
    num_blocks = batch * nb
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32).to(DEV)
    block_tables = perm.view(batch, nb).contiguous()
    shape = (num_blocks, KV_HEADS, TPB, HEAD_DIM)
    k_cache = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
    q = torch.randn(batch * q_len, HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=DEV) * q_len
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    return q, k_cache, v_cache, qsl, seq_lens, block_tables


def bench_decode(batch, ctx, iters, gen):
    q, kc, vc, qsl, sl, bt = build(batch, ctx, 1, gen)
    ws = ck.paged_attention_workspace(batch, HEADS, HEAD_DIM, ctx, DEV)
    out = torch.empty_like(q)

    def run():
        ck.paged_attention(q, kc, vc, qsl, sl, bt, HEAD_DIM ** -0.5, max_query_len=1,
                           max_context_len=ctx, workspace=ws, out=out)

    t = cuda_time(run, iters)
    nbytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2 + 2 * q.numel() * 2
    del q, kc, vc
    return t, nbytes / t


def bench_prefill(q_len, iters, gen):
    q, kc, vc, qsl, sl, bt = build(1, q_len, q_len, gen)
    ws = ck.paged_attention_workspace(q_len, HEADS, HEAD_DIM, q_len, DEV)
    out = torch.empty_like(q)

    def run():
        ck.paged_attention(q, kc, vc, qsl, sl, bt, HEAD_DIM ** -0.5, max_query_len=q_len,
                           max_context_len=q_len, workspace=ws, out=out)

    t = cuda_time(run, iters)
    # SDPA on the same values, K/V contiguous [1, heads, len, hd] (GQA expanded)
    pos = torch.arange(q_len, device=DEV)
    bid = bt[0].long()[pos // TPB]
    k = kc[bid, :, pos % TPB].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)[None]
    v = vc[bid, :, pos % TPB].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)[None]
    qq = q.transpose(0, 1)[None].contiguous()
    t_ref = cuda_time(lambda: F.scaled_dot_product_attention(qq, k, v, is_causal=True), iters)
    flops = 4 * q_len * q_len * HEAD_DIM * HEADS / 2
    ref = F.scaled_dot_product_attention(qq, k, v, is_causal=True)[0].transpose(0, 1)
    err = (out.float() - ref.float()).abs().max().item()
    return t, flops / t, t_ref, flops / t_ref, err


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes and iterations")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    results = {"decode": [], "prefill": []}
    iters = args.iters or (10 if args.quick else 50)
    gen = torch.Generator().manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  kernels: {ck.architectures()}")
    peak = copy_bandwidth(iters)
    results["copy_bandwidth"] = peak
    print(f"device-to-device copy bandwidth: {peak / 1e12:.2f} TB/s "
          f"({peak / DATASHEET_BW:.0%} of the {DATASHEET_BW / 1e12:.1f} TB/s datasheet)")

    print("\ndecode (flash-decoding), batch 64, 16q/8kv heads, head_dim 128, bf16, 16 tok/block")
    print(f"{'context':>8} {'time us':>9} {'TB/s':>7} {'vs copy':>8} {'vs 4.8':>7}")
    for ctx in ([4096, 16384] if args.quick else [4096, 8192, 16384]):
        t, bw = bench_decode(64, ctx, iters, gen)
        results["decode"].append({"context": ctx, "seconds": t, "bytes_per_s": bw, "vs_copy": bw / peak,
                                  "vs_datasheet": bw / DATASHEET_BW})
        print(f"{ctx:>8} {t * 1e6:>9.1f} {bw / 1e12:>7.2f} {bw / peak:>8.0%} "
              f"{bw / DATASHEET_BW:>7.0%}")

    print("\nprefill (tensor cores), one causal chunk from position 0, 16q/8kv heads, hd 128")
    print(f"{'chunk':>8} {'time ms':>8} {'TFLOP/s':>8} {'SDPA ms':>8} {'SDPA TF/s':>9} "
          f"{'ratio':>6} {'max err':>8}")
    for q_len in ([2048] if args.quick else [2048, 8192]):
        t, tf, t_ref, tf_ref, err = bench_prefill(q_len, iters, gen)
        results["prefill"].append({"chunk": q_len, "seconds": t, "flops": tf, "sdpa_seconds": t_ref,
                                   "sdpa_flops": tf_ref, "max_err": err})
        print(f"{q_len:>8} {t * 1e3:>8.3f} {tf / 1e12:>8.1f} {t_ref * 1e3:>8.3f} "
              f"{tf_ref / 1e12:>9.1f} {tf / tf_ref:>6.2f} {err:>8.4f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
