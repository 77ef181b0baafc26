"""The batch manager's metadata buffers (CoreBatchManager.buffers): zero-copy views of the C++
vectors that keep their CoreBatchManager, and so the vectors, alive for as long as a view or a
tensor made from one exists."""

from __future__ import annotations

import array
import gc
import weakref

import torch

from pyengine.core._core import CoreBatchManager


def make_bm() -> CoreBatchManager:
    return CoreBatchManager(max_batch_size=2, max_num_tokens=16, max_seq_len=32, tokens_per_block=4,
                            num_blocks=8)


def test_a_tensor_from_a_buffer_keeps_the_manager_alive():
    bm = make_bm()
    prompt = [11, 12, 13, 14, 15]
    bm.add_request(1, array.array("i", prompt), 2)
    num_tokens, num_seqs, num_logits = bm.schedule(0.0)
    assert (num_tokens, num_seqs, num_logits) == (5, 1, 1)
    input_ids = torch.frombuffer(bm.buffers["input_ids"], dtype=torch.int32)
    positions = torch.frombuffer(bm.buffers["positions"], dtype=torch.int32)
    request_ids = torch.frombuffer(bm.buffers["request_ids"], dtype=torch.int64)
    assert input_ids.numel() == 16 and request_ids.numel() == 2
    assert input_ids[:5].tolist() == prompt
    expected = input_ids.clone()

    alive = weakref.ref(bm)
    del bm
    gc.collect()
    assert alive() is not None  # the tensors hold the manager, and so its C++ vectors
    # Allocate and free some memory: freed vectors would likely be overwritten.
    junk = [bytearray(4096) for _ in range(256)]
    del junk
    assert torch.equal(input_ids, expected)
    assert positions[:5].tolist() == [0, 1, 2, 3, 4]
    assert request_ids[0].item() == 1

    del input_ids, positions, request_ids
    gc.collect()
    assert alive() is None  # the last tensor gone, the manager goes


def test_the_views_are_zero_copy_and_writable():
    bm = make_bm()
    view = bm.buffers["input_ids"]
    assert view.format == "i" and view.itemsize == 4 and not view.readonly and view.shape == (16,)
    assert bm.buffers["logits_request_ids"].format == "q" and bm.buffers["logits_request_ids"].itemsize == 8
    t = torch.frombuffer(bm.buffers["input_ids"], dtype=torch.int32)
    bm.add_request(3, array.array("i", [7, 8, 9]), 2)
    bm.schedule(0.0)
    assert t[:3].tolist() == [7, 8, 9]  # schedule() wrote into the memory the tensor wraps
    t[15] = 42
    assert view[15] == 42  # one memory: the tensor's write shows through another view


def test_a_manager_without_outside_views_is_freed_at_once():
    bm = make_bm()
    bm.buffers  # views made and dropped: the manager holds none of them (no cycle)
    alive = weakref.ref(bm)
    del bm
    assert alive() is None


def test_scheduled_shape_counts_sequences_tokens_and_attention_pairs():
    """The step cost model's regressors of the batch just scheduled: a chunk of c tokens starting
    at position s attends c * s + c * (c + 1) / 2 pairs, a generation row of a sequence of L
    tokens L."""
    bm = CoreBatchManager(max_batch_size=2, max_num_tokens=8, max_seq_len=32, tokens_per_block=4, num_blocks=16)
    bm.add_request(1, array.array("i", [1, 2, 3, 4, 5]), 4)
    assert bm.schedule(0.0) == (5, 1, 1)
    assert bm.scheduled_shape() == (1, 5, 15)  # the whole prompt: 1 + 2 + ... + 5
    bm.update(array.array("i", [9]), 0.0)
    bm.add_request(2, array.array("i", list(range(10, 20))), 4)
    assert bm.schedule(0.0) == (5, 2, 1)
    # request 1's generation row (6 tokens) and the first 4-token chunk of request 2's prompt (1 + ... + 4)
    assert bm.scheduled_shape() == (2, 5, 6 + 10)
    bm.update(array.array("i", [9]), 0.0)
    assert bm.schedule(0.0) == (7, 2, 2)
    # request 1 (7 tokens) and the rest of request 2's prompt: 6 tokens from position 4
    assert bm.scheduled_shape() == (2, 7, 7 + 6 * 4 + 21)
