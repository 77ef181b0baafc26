"""The weights in one region of huge pages (pyengine/runtime/weight_arena.py): copies hold the
values at aligned offsets, the region is advised MADV_HUGEPAGE, an engine moves every weight
there (a tied head once, a quantized weight's blocks too) and leaves no mapping of the
checkpoint file, and its outputs are those of an engine that computes from the file."""

from __future__ import annotations

from pathlib import Path

import mmap

import pytest
import torch

from pyengine import Engine, SamplingParams, StartupError
from pyengine.quant import QuantizedWeight
from pyengine.runtime.weight_arena import HUGE_PAGE_BYTES, TENSOR_ALIGN_BYTES, WeightArena

THP = Path("/sys/kernel/mm/transparent_hugepage")


def _thp_setting(name: str) -> str | None:
    """The bracketed choice of a THP setting ("always", "madvise", ...); None without THP."""
    try:
        text = (THP / name).read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


def _smaps_field(address: int, field: str) -> list[str]:
    """A field of the mapping holding `address` in /proc/self/smaps, split into words."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == field + ":":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address`."""
    return _smaps_field(address, "VmFlags")


def test_copies_hold_the_values_at_aligned_offsets():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(37, 5, generator=g), torch.randn(3000, generator=g).bfloat16(),
               torch.randint(0, 255, (9, 34), generator=g, dtype=torch.uint8), torch.randn(1, generator=g)]
    arena = WeightArena.reserve(sum(WeightArena.footprint(t) for t in tensors))
    assert arena.nbytes == HUGE_PAGE_BYTES and arena.buffer.data_ptr() % HUGE_PAGE_BYTES == 0
    copies = [arena.copy_in(t) for t in tensors]
    base = arena.buffer.data_ptr()
    offsets = [c.data_ptr() - base for c in copies]
    assert offsets == [0, 4096, 12288, 16384]  # 740 B, 6000 B, 306 B, 4 B, each from a 4 KiB boundary
    assert arena.used == 5 * TENSOR_ALIGN_BYTES
    for t, c in zip(tensors, copies):
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous() and torch.equal(c, t)
        assert c.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    assert arena.as_dict()["bytes"] == 5 * TENSOR_ALIGN_BYTES


def test_the_arena_refuses_what_it_cannot_hold():
    arena = WeightArena.reserve(8192)
    with pytest.raises(ValueError, match=r"contiguous tensor is needed, got shape \(4, 3\) with strides \(1, 4\)"):
        arena.copy_in(torch.zeros(3, 4).t())
    arena.copy_in(torch.zeros(HUGE_PAGE_BYTES - 4096, dtype=torch.uint8))
    with pytest.raises(ValueError, match="8192 bytes do not fit \\(4096 of 2097152 left\\)"):
        arena.copy_in(torch.zeros(8192, dtype=torch.uint8))
    assert arena.used == HUGE_PAGE_BYTES - 4096  # the refused copy took nothing


def test_the_region_is_advised_for_huge_pages():
    arena = WeightArena.reserve(4 * HUGE_PAGE_BYTES)
    assert arena.nbytes == 4 * HUGE_PAGE_BYTES
    arena.buffer.fill_(1)  # touched: the kernel backs it now
    flags = _vm_flags(arena.buffer.data_ptr())
    assert ("hg" in flags) == arena.huge_pages_advised, flags
    assert "hg" in _vm_flags(arena.buffer.data_ptr() + arena.nbytes - 1) or not arena.huge_pages_advised
    huge = arena.huge_page_bytes()
    assert huge % HUGE_PAGE_BYTES == 0
    if _thp_setting("enabled") == "never" or not arena.huge_pages_advised:
        assert huge == 0
    elif _thp_setting("defrag") in ("always", "madvise", "defer+madvise"):
        # a fault in an advised region compacts memory for a huge page if it must
        assert huge > 0, "advised, touched and THP on, yet no huge page backs the region"


def _weight_tensors(model) -> list[torch.Tensor]:
    values = [model.embed, model.norm, model.lm_head] + [w for layer in model.layers for w in layer.values()]
    out = []
    for w in values:
        if isinstance(w, QuantizedWeight):
            out += [data for _, data in w.parts]
        elif isinstance(w, torch.Tensor):
            out.append(w)
    return out


def _greedy(engine: Engine) -> list[tuple[list[int], list]]:
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(20, 60))]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3),
                           use_tqdm=False)
    return [(o.token_ids, o.logprobs) for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_computes_from_the_arena(checkpoint_factory, dtype):
    model_dir = checkpoint_factory("arena_bf16", model_type="llama", num_heads=4, num_kv_heads=2, dtype="bfloat16")
    engine = Engine(model_dir, dtype=dtype, max_seq_len=128)
    model = engine._runner.model
    arena = model.weight_arena
    lo, hi = arena.buffer.data_ptr(), arena.buffer.data_ptr() + arena.nbytes
    tensors = {id(t): t for t in _weight_tensors(model)}.values()
    assert all(lo <= t.data_ptr() < hi for t in tensors)
    assert arena.used == sum(WeightArena.footprint(t) for t in tensors)
    report = engine.startup_report()["weight_memory"]
    assert report["bytes"] == arena.used and report["huge_pages_advised"] == arena.huge_pages_advised
    assert report["huge_page_bytes"] % HUGE_PAGE_BYTES == 0 and report["huge_page_bytes"] <= arena.nbytes
    # nothing reads the checkpoint's file mapping any more (a bf16 model read as bf16 would)
    assert str(model_dir) not in Path("/proc/self/maps").read_text()
    expected = _greedy(engine)
    del engine, model, tensors
    plain = Engine(model_dir, dtype=dtype, max_seq_len=128, huge_page_weights=False)
    assert plain._runner.model.weight_arena is None and plain.startup_report()["weight_memory"] is None
    if dtype == "bfloat16":  # the views of the file that the arena replaces
        assert str(model_dir) in Path("/proc/self/maps").read_text()
    assert _greedy(plain) == expected


def test_zeros_are_aligned_zero_views_that_take_their_share():
    arena = WeightArena.reserve(3 * 4096)
    a = arena.zeros((3, 5), torch.float16)
    b = arena.zeros((7,), torch.float32)
    assert a.shape == (3, 5) and a.dtype == torch.float16 and b.dtype == torch.float32
    assert a.data_ptr() == arena.buffer.data_ptr() and b.data_ptr() == a.data_ptr() + 4096
    assert not a.any() and not b.any() and arena.used == 2 * 4096
    with pytest.raises(ValueError, match=f"{HUGE_PAGE_BYTES} bytes do not fit \\({HUGE_PAGE_BYTES - 8192} of"):
        arena.zeros((HUGE_PAGE_BYTES,), torch.uint8)  # (the region is whole huge pages: 2 MiB here)


def test_the_kv_pool_lies_in_a_huge_page_region(llama_dir):
    """A CPU engine's KV pool (every layer's K and V blocks) is one region advised for huge pages,
    as the weights (decode attention streams the sequence's cached rows each step), resident from
    start-up (no step stalls on its first write to a page)."""
    engine = Engine(llama_dir, max_seq_len=128)
    runner = engine._runner
    pool = runner.kv_pool
    assert pool.data_ptr() % HUGE_PAGE_BYTES == 0
    flags = _vm_flags(pool.data_ptr())
    assert "hg" in flags or not hasattr(mmap, "MADV_HUGEPAGE"), flags
    lo, hi = pool.data_ptr(), pool.data_ptr() + pool.nbytes
    assert all(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for kv in runner.kv_caches for t in kv)
    assert _vm_flags(hi - 1) == flags  # one mapping
    rss = _smaps_field(pool.data_ptr(), "Rss")
    assert rss[1] == "kB" and int(rss[0]) * 1024 >= pool.nbytes, (rss, pool.nbytes)


def test_a_tied_head_is_moved_once(checkpoint_factory):
    model_dir = checkpoint_factory("llama_tied", model_type="llama", tie_word_embeddings=True)
    model = Engine(model_dir, max_seq_len=128)._runner.model
    assert model.lm_head is model.embed
    assert model.weight_arena.used == sum(WeightArena.footprint(t) for t in {id(t): t for t in
                                                                               _weight_tensors(model)}.values())


def test_quantized_blocks_are_moved(checkpoint_factory):
    model_dir = checkpoint_factory("fused_llama", model_type="llama", num_heads=4, num_kv_heads=2)
    engine = Engine(model_dir, dtype="float32", quantization="q8_0", max_seq_len=128)
    model = engine._runner.model
    arena = model.weight_arena
    lo, hi = arena.buffer.data_ptr(), arena.buffer.data_ptr() + arena.nbytes
    qkv = model.layers[0]["qkv"]
    assert isinstance(qkv, QuantizedWeight) and all(lo <= d.data_ptr() < hi for _, d in qkv.parts)
    assert all(lo <= t.data_ptr() < hi for t in _weight_tensors(model))
    moved = _greedy(engine)
    del engine, model, qkv
    plain = Engine(model_dir, dtype="float32", quantization="q8_0", max_seq_len=128, huge_page_weights=False)
    assert _greedy(plain) == moved


def test_huge_page_weights_must_be_a_bool(llama_dir):
    with pytest.raises(StartupError, match="huge_page_weights must be a bool, got 'yes'") as e:
        Engine(llama_dir, huge_page_weights="yes")
    assert e.value.phase == "config" and isinstance(e.value.error, TypeError)


def test_bench_kernels_read_from_huge_pages_as_the_engine_does():
    from bench.common import huge_page_copies

    t = torch.arange(3000, dtype=torch.float32).view(30, 100)
    copies = huge_page_copies(t, 3)
    ptrs = [c.data_ptr() for c in copies]
    assert [p - ptrs[0] for p in ptrs] == [0, 12288, 24576]  # 12,000 bytes each, 4 KiB aligned
    assert ptrs[0] % HUGE_PAGE_BYTES == 0 and all(torch.equal(c, t) for c in copies)
