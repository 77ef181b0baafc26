"""Padding rows of decode batches (what CUDA graphs run), exercised on the CPU: a batch padded
up to a larger size gives the same outputs, and its padding rows own no seat and no block."""

from __future__ import annotations

import pytest

from pyengine import SamplingParams
from pyengine.runtime.cuda_graphs import check_graph_batch_sizes, default_graph_batch_sizes
from test_overlap import drive, make_engine, mixed_params


def padded_engine(model_dir, overlap: bool, pad_sizes: list[int]):
    engine = make_engine(model_dir, overlap=overlap, max_batch_size=8, max_num_tokens=64)
    engine._runner.decode_pad_sizes = pad_sizes
    engine._runner.token_buffer = True  # as on a GPU: generation rows read the last tokens from the runner's buffer
    rows = []  # (real logits rows, rows sampled) per forward
    forward = engine._runner.forward

    def recording_forward(num_tokens, num_seqs, num_logits, extra_rows=None):
        out = forward(num_tokens, num_seqs, num_logits, extra_rows)
        rows.append((num_logits, out.num_rows))
        return out

    engine._runner.forward = recording_forward
    return engine, rows


@pytest.mark.parametrize("overlap", [False, True])
def test_padded_decode_batches_give_the_same_outputs(llama_dir, overlap):
    params = mixed_params()
    plain, _ = drive(make_engine(llama_dir, overlap=overlap, max_batch_size=8, max_num_tokens=64), params)
    engine, rows = padded_engine(llama_dir, overlap, [3, 8])
    padded, _ = drive(engine, params)
    assert padded == plain
    # Decode batches of 4..7 rows ran as 8, of 1..2 as 3; prefill batches as they were.
    padded_steps = [(n, m) for n, m in rows if m != n]
    assert padded_steps, "no batch was padded"
    for n, m in padded_steps:
        assert m == (8 if n > 3 else 3), (n, m)


def test_padding_rows_write_only_the_scratch_row(llama_dir):
    engine, rows = padded_engine(llama_dir, False, [8])
    runner = engine._runner
    scratch = runner.scratch_slot
    before = runner.last_tokens.clone()
    engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # prefill: not padded
    seat = int(runner.seq_slots[0])
    engine.step()  # decode of 1 row padded to 8
    assert rows[-1] == (1, 8)
    changed = {i for i in range((runner.last_tokens != before).numel()) if runner.last_tokens[i] != before[i]}
    assert changed <= {seat, scratch}
    # the padding rows' logits are the model's for token last_tokens[scratch] at position 0
    # with no KV stored: the pool's block accounting is untouched
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_blocks"] - 1
    while engine.has_unfinished_requests():
        engine.step()


def test_graph_batch_sizes():
    assert default_graph_batch_sizes(1) == [1]
    assert default_graph_batch_sizes(6) == [1, 2, 4, 6]
    assert default_graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert check_graph_batch_sizes([8, 2, 2], 16, 2048) == [2, 8]
    with pytest.raises(ValueError, match=r"cuda_graph_batch_sizes entry 17 is not an int in \[1, 16\]"):
        check_graph_batch_sizes([1, 17], 16, 2048)
    with pytest.raises(ValueError, match=r"entry 0 is not an int in \[1, 4\]"):
        check_graph_batch_sizes([0], 16, 4)
    with pytest.raises(ValueError, match="is empty"):
        check_graph_batch_sizes([], 16, 2048)
