"""Random paged KV caches and a naive attention reference, shared by the CPU kernel tests
(tests/test_kernels.py) and the CUDA ones (tests/gpu/test_cuda_kernels.py)."""

from __future__ import annotations

import math

import torch

FP8 = torch.float8_e4m3fn


def raw(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as uint8 (indexing writes on float8 tensors are not supported everywhere)."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


def make_paged_kv(specs, num_kv_heads, head_dim, tokens_per_block, cache_dtype, gen, window=0,
                  free_out_of_window=False, extra_blocks=7, device="cpu", k_scale=1.0, v_scale=1.0):
    """Builds a paged cache holding every sequence's KV in shuffled, non-contiguous blocks.

    specs: list of (seq_len, q_len). Unused cache slots and table entries are poisoned (NaN,
    -1; fp8: the e4m3 NaN) so any stray read shows up. An fp8 cache stores value / scale.
    Returns the cache, index tensors and the per-sequence KV as stored (in the cache dtype;
    fp8: dequantized to fp32) for the reference.
    """
    nblocks = [max(1, math.ceil(L / tokens_per_block)) for L, _ in specs]
    num_blocks = sum(nblocks) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    max_blocks = max(nblocks) + 2
    block_tables = torch.full((len(specs), max_blocks), -1, dtype=torch.int32)
    shape = (num_blocks, num_kv_heads, tokens_per_block, head_dim)
    k_cache = torch.full(shape, float("nan"), device=device).to(cache_dtype)
    v_cache = torch.full(shape, float("nan"), device=device).to(cache_dtype)
    kvs = []
    used = 0
    for i, (L, q_len) in enumerate(specs):
        ids = perm[used:used + nblocks[i]]
        used += nblocks[i]
        block_tables[i, :nblocks[i]] = ids
        k = torch.randn(L, num_kv_heads, head_dim, generator=gen).to(device)
        v = torch.randn(L, num_kv_heads, head_dim, generator=gen).to(device)
        if cache_dtype == FP8:
            ks, vs = (k / k_scale).to(FP8), (v / v_scale).to(FP8)
            k_stored, v_stored = ks.float() * k_scale, vs.float() * v_scale
        else:
            ks, vs = k.to(cache_dtype), v.to(cache_dtype)
            k_stored, v_stored = ks, vs
        pos = torch.arange(L, device=device)
        bid = ids.to(device).long()[pos // tokens_per_block]
        off = pos % tokens_per_block
        raw(k_cache)[bid, :, off, :] = raw(ks)
        raw(v_cache)[bid, :, off, :] = raw(vs)
        kvs.append((k_stored, v_stored))
        if window > 0 and free_out_of_window and q_len > 0:
            # blocks no query row of this step can see may already be freed
            first_visible = max(0, L - q_len - window + 1)
            block_tables[i, :first_visible // tokens_per_block] = -1
    seq_lens = torch.tensor([L for L, _ in specs], dtype=torch.int32, device=device)
    qsl = torch.zeros(len(specs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([q for _, q in specs]), 0)
    return k_cache, v_cache, qsl.to(device), seq_lens, block_tables.to(device), kvs


def ref_attention(query, kvs, specs, scale, window, acc_dtype=torch.float64, softcap=0.0):
    """Naive causal (optionally sliding-window) GQA attention, accumulated in `acc_dtype`;
    returns [num_tokens, num_heads, head_dim] in `acc_dtype`. softcap > 0: the scores are
    soft-capped as Hugging Face's Gemma2 does (scale, / softcap, tanh, * softcap) before the mask."""
    num_tokens, num_heads, head_dim = query.shape
    device = query.device
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=acc_dtype, device=device)
    start = 0
    for (L, q_len), (k, v) in zip(specs, kvs):
        if q_len == 0:
            continue
        group = num_heads // k.shape[1]
        q = query[start:start + q_len].to(acc_dtype)
        kk = k.to(acc_dtype).repeat_interleave(group, dim=1)  # [L, H, D]
        vv = v.to(acc_dtype).repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, kk) * scale
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        qpos = torch.arange(L - q_len, L, device=device)[:, None]
        kpos = torch.arange(L, device=device)[None, :]
        mask = kpos <= qpos
        if window > 0:
            mask &= kpos > qpos - window
        s = s.masked_fill(~mask, float("-inf"))
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)
        start += q_len
    return out
