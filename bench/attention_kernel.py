"""Micro-benchmark of the CPU paged-attention kernel.

Decode: batch 32 x context {1024, 4096}, head_dim 64, 3 KV heads x 3 query heads per group,
bf16 and fp32 caches; reports achieved KV bandwidth (bytes of K+V read / time) and compares with
torch.nn.functional.scaled_dot_product_attention on the same KV gathered contiguously (the
gather itself is not timed). Prefill: one 2048-token causal chunk.

Usage: python bench/attention_kernel.py [--threads N] [--iters N]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pyengine.layers.attention import paged_attention

HEAD_DIM = 64
KV_HEADS = 3
GROUP = 3
TPB = 16


def bench(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]  # median


def build(batch, ctx, q_len, cache_dtype, gen):
    nb_seq = (ctx + TPB - 1) // TPB
    num_blocks = batch * nb_seq
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_tables = perm.view(batch, nb_seq).contiguous()
    k_cache = torch.randn(num_blocks, KV_HEADS, TPB, HEAD_DIM, generator=gen).to(cache_dtype)
    v_cache = torch.randn(num_blocks, KV_HEADS, TPB, HEAD_DIM, generator=gen).to(cache_dtype)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32)
    # contiguous copies for SDPA: [batch, kv_heads, ctx, head_dim]
    idx = block_tables.long()
    k_contig = k_cache[idx].permute(0, 2, 1, 3, 4).reshape(batch, KV_HEADS, nb_seq * TPB, HEAD_DIM)
    v_contig = v_cache[idx].permute(0, 2, 1, 3, 4).reshape(batch, KV_HEADS, nb_seq * TPB, HEAD_DIM)
    k_contig = k_contig[:, :, :ctx].contiguous()
    v_contig = v_contig[:, :, :ctx].contiguous()
    return k_cache, v_cache, qsl, seq_lens, block_tables, k_contig, v_contig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    H = KV_HEADS * GROUP
    scale = HEAD_DIM ** -0.5
    print(f"threads={torch.get_num_threads()}  head_dim={HEAD_DIM}  kv_heads={KV_HEADS}  "
          f"q_heads={H}  tokens_per_block={TPB}")

    print("\n== decode (batch 32, one query row per sequence) ==")
    print(f"{'cache':6} {'ctx':>5} | {'kernel ms':>9} {'GB/s':>7} | {'sdpa ms':>8} {'GB/s':>7} "
          f"| {'speedup':>7} | max|diff|")
    for cache_dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        for ctx in (1024, 4096):
            batch = 32
            kc, vc, qsl, sl, bt, kk, vv = build(batch, ctx, 1, cache_dtype, gen)
            q = torch.randn(batch, H, HEAD_DIM, generator=gen).to(cache_dtype)
            out = torch.empty_like(q)
            kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * kc.element_size()

            def run_kernel():
                paged_attention(q, kc, vc, qsl, sl, bt, scale, out=out)

            q4 = q.view(batch, H, 1, HEAD_DIM)

            def run_sdpa():
                return F.scaled_dot_product_attention(q4, kk, vv, scale=scale, enable_gqa=True)

            t_k = bench(run_kernel, args.iters)
            t_s = bench(run_sdpa, args.iters)
            diff = (out.float() - run_sdpa().view(batch, H, HEAD_DIM).float()).abs().max().item()
            print(f"{name:6} {ctx:5d} | {t_k * 1e3:9.3f} {kv_bytes / t_k / 1e9:7.2f} | "
                  f"{t_s * 1e3:8.3f} {kv_bytes / t_s / 1e9:7.2f} | {t_s / t_k:6.2f}x | {diff:.2e}")

    print("\n== prefill (one 2048-token causal chunk from position 0) ==")
    print(f"{'cache':6} {'q':>5} | {'kernel ms':>9} {'GFLOP/s':>8} | {'sdpa ms':>8} {'GFLOP/s':>8} "
          f"| {'speedup':>7} | max|diff|")
    for cache_dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        n = 2048
        kc, vc, qsl, sl, bt, kk, vv = build(1, n, n, cache_dtype, gen)
        q = torch.randn(n, H, HEAD_DIM, generator=gen).to(cache_dtype)
        out = torch.empty_like(q)
        flops = 4 * H * HEAD_DIM * n * (n + 1) / 2  # causal QK^T + PV

        def run_kernel():
            paged_attention(q, kc, vc, qsl, sl, bt, scale, out=out)

        q4 = q.permute(1, 0, 2).unsqueeze(0)  # [1, H, n, D]

        def run_sdpa():
            return F.scaled_dot_product_attention(q4, kk, vv, scale=scale, is_causal=True,
                                                  enable_gqa=True)

        iters = max(3, args.iters // 3)
        t_k = bench(run_kernel, iters, warmup=1)
        t_s = bench(run_sdpa, iters, warmup=1)
        diff = (out.float() - run_sdpa()[0].permute(1, 0, 2).float()).abs().max().item()
        print(f"{name:6} {n:5d} | {t_k * 1e3:9.2f} {flops / t_k / 1e9:8.1f} | "
              f"{t_s * 1e3:8.2f} {flops / t_s / 1e9:8.1f} | {t_s / t_k:6.2f}x | {diff:.2e}")


if __name__ == "__main__":
    main()
