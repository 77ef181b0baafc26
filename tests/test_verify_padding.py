"""Padded verify batches of speculative decoding (what the GPU's verify CUDA graphs run),
exercised on the CPU: every sequence padded to 1 + d rows and the batch to the next pad size
gives the outputs of decoding without speculation, the padding writes no KV and owns no block
or slot, and the batches that cannot be padded run as they are."""

from __future__ import annotations

import pytest

from speculative_common import generate, greedy, make_prompts, seeded_params
from pyengine import Engine, KvCacheConfig, SchedulerConfig, SpeculativeConfig


def make_engine(model_dir, spec, *, max_batch_size=4, max_num_tokens=64, overlap=False, max_seq_len=160) -> Engine:
    return Engine(model_dir, max_seq_len=max_seq_len, seed=0, overlap=overlap, speculative_config=spec,
                  kv_cache_config=KvCacheConfig(max_tokens=4096, tokens_per_block=8),
                  scheduler_config=SchedulerConfig(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens))


def padded(engine: Engine, drafts: list[int], sizes: list[int]) -> list[tuple]:
    """Turns padding on (as the GPU's graphs would); returns the list that records each padded
    verify forward as (sequences, padded sequences, drafts, each sequence's rows)."""
    runner = engine._runner
    runner.decode_pad_sizes = sizes
    runner.verify_pad_drafts = drafts
    runner.token_buffer = True  # as on a GPU: generation rows read the last tokens from the runner's buffer
    seen = []
    forward_verify = runner._forward_verify

    def recording(num_tokens, num_seqs, num_logits, size, d):
        qsl = runner.query_start_loc[: num_seqs + 1].tolist()
        seen.append((num_seqs, size, d, [b - a for a, b in zip(qsl, qsl[1:])]))
        out = forward_verify(num_tokens, num_seqs, num_logits, size, d)
        assert out.logits.shape[0] == num_logits == num_tokens
        return out

    runner._forward_verify = recording
    return seen


@pytest.fixture(scope="module")
def reference(copying_dir):
    return [o.token_ids for o in generate(make_engine(copying_dir, None), make_prompts(), greedy())]


SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


@pytest.mark.parametrize("overlap", [False, True])
def test_padded_verify_batches_give_the_outputs_without_speculation(copying_dir, reference, overlap):
    engine = make_engine(copying_dir, SPEC, overlap=overlap)
    seen = padded(engine, [2, 4], [3, 4])
    outs = generate(engine, make_prompts(), greedy())
    assert [o.token_ids for o in outs] == reference
    assert seen, "no verify batch ran padded"
    for num_seqs, size, d, lens in seen:
        assert size == (3 if num_seqs <= 3 else 4)
        assert d == (2 if max(lens) <= 3 else 4)  # the most drafts a sequence carries, rounded up
    # the padding the test means to exercise: sequences shorter than the padded rows, and
    # padding sequences
    assert any(min(lens) < 1 + d for _, _, d, lens in seen)
    assert any(size > num_seqs for num_seqs, size, _, _ in seen)


def test_padded_verify_batches_with_a_draft_model_and_seeded_sampling(copying_dir, draft_dir):
    spec = SpeculativeConfig(method="draft_model", draft_model=draft_dir, num_speculative_tokens=3,
                             adaptive_draft_length=False)
    plain = [o.token_ids for o in generate(make_engine(copying_dir, spec), make_prompts(), seeded_params())]
    engine = make_engine(copying_dir, spec)
    seen = padded(engine, [1, 2, 3], [4])
    assert [o.token_ids for o in generate(engine, make_prompts(), seeded_params())] == plain
    assert seen


def verify_batches(engine: Engine) -> list[int]:
    """Records the most drafts a sequence carries of every verify batch the runner is given."""
    runner = engine._runner
    most = []
    forward = runner.forward

    def recording(num_tokens, num_seqs, num_logits, extra_rows=None):
        if engine._bm.num_generation_seqs == num_seqs < num_tokens:
            qsl = runner.query_start_loc[: num_seqs + 1].tolist()
            most.append(max(b - a for a, b in zip(qsl, qsl[1:])) - 1)
        return forward(num_tokens, num_seqs, num_logits, extra_rows)

    runner.forward = recording
    return most


def test_verify_batches_that_cannot_be_padded_run_as_they_are(copying_dir, reference):
    """More drafts than the largest pad count, or padded rows past max_num_tokens: as they are."""
    engine = make_engine(copying_dir, SPEC)
    seen = padded(engine, [2], [4])
    most = verify_batches(engine)
    assert [o.token_ids for o in generate(engine, make_prompts(), greedy())] == reference
    assert sum(m > 2 for m in most) > 0 and sum(m <= 2 for m in most) > 0
    assert len(seen) == sum(m <= 2 for m in most)  # padded exactly when 2 drafts or fewer
    engine = make_engine(copying_dir, SPEC, max_num_tokens=12)
    seen = padded(engine, [4], [4])  # every batch pads to 4 sequences x 5 rows > 12 tokens
    most = verify_batches(engine)
    assert [o.token_ids for o in generate(engine, make_prompts(), greedy())] == reference
    assert most and seen == []
