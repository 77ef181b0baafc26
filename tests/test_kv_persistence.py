"""KV cache persistence end to end: save -> a new engine -> load gives the outputs and the
prefix reuse of a warm engine; every bad file raises and leaves the pool as it was; a crash
during save leaves the previous file whole."""

from __future__ import annotations

import os
import random
import re
import struct

import pytest

from pyengine import Engine, KvCacheConfig, KvCacheFileError, SamplingParams, SchedulerConfig, StartupError
from pyengine.engine import kv_persistence

TPB = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
_rng = random.Random(3)
SYSTEM = [_rng.randrange(3, 512) for _ in range(40)]
FIRST = [SYSTEM + [_rng.randrange(3, 512) for _ in range(n)] for n in (5, 13, 21)]
FOLLOW_UPS = [FIRST[0] + [7, 8, 9], SYSTEM + [11] * 9, FIRST[2][:50]]


def make_engine(model_dir, max_tokens: int = 1024, max_seq_len: int = 128, **kv) -> Engine:
    return Engine(model_dir, max_seq_len=max_seq_len,
                  kv_cache_config=KvCacheConfig(tokens_per_block=kv.pop("tokens_per_block", TPB),
                                                max_tokens=max_tokens, **kv),
                  scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=128))


def run(engine: Engine, prompts) -> tuple[list[list[int]], list[int]]:
    outs = engine.generate(prompts, PARAMS, use_tqdm=False)
    return [o.token_ids for o in outs], [o.metrics.num_reused_tokens for o in outs]


@pytest.fixture(scope="module")
def saved(llama_dir, tmp_path_factory):
    """A file saved after FIRST, and what the warm engine then gives for FOLLOW_UPS."""
    path = tmp_path_factory.mktemp("kv") / "cache.pekv"
    engine = make_engine(llama_dir)
    for p in FIRST:  # one at a time: a known recency order
        run(engine, [p])
    blocks = engine.stats()["num_reusable_blocks"]
    report = engine.save_kv_cache(path)
    warm = [run(engine, [p]) for p in FOLLOW_UPS]
    engine.shutdown()
    return path, report, blocks, [w[0][0] for w in warm], [w[1][0] for w in warm]


def test_save_load_gives_the_warm_engines_outputs_and_reuse(llama_dir, saved):
    path, report, blocks, warm_tokens, warm_reused = saved
    assert report["blocks"] == blocks > 0
    assert report["bytes"] == os.path.getsize(path)
    engine = make_engine(llama_dir)
    loaded = engine.load_kv_cache(path)
    assert loaded["blocks_loaded"] == blocks and loaded["blocks_skipped"] == 0
    assert engine.stats()["num_reusable_blocks"] == blocks
    results = [run(engine, [p]) for p in FOLLOW_UPS]
    assert [r[0][0] for r in results] == warm_tokens
    assert [r[1][0] for r in results] == warm_reused
    assert warm_reused == [40, 40, 48]  # whole blocks of the shared prefix (SYSTEM is 40 tokens)
    # and the same tokens as an engine that computed everything
    cold = make_engine(llama_dir, enable_block_reuse=False)
    assert [run(cold, [p])[0][0] for p in FOLLOW_UPS] == warm_tokens


def test_loading_twice_skips_what_is_cached(llama_dir, saved):
    path, _, blocks, _, _ = saved
    engine = make_engine(llama_dir)
    engine.load_kv_cache(path)
    again = engine.load_kv_cache(path)
    assert again["blocks_loaded"] == 0 and again["blocks_skipped"] == blocks
    assert engine.stats()["num_reusable_blocks"] == blocks


def _bad_copies(path) -> dict[str, tuple[bytes, str]]:
    data = path.read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x40
    version = bytearray(data)
    version[8:12] = struct.pack("<I", 99)
    return {
        "truncated_in_a_record": (data[: len(data) // 2], "truncated in record"),
        "truncated_before_the_trailer": (data[:-16], "truncated in the trailer"),
        "flipped_byte": (bytes(flipped), "checksum mismatch in record"),
        "wrong_version": (bytes(version), "format version 99; this pyengine reads version 1"),
        "not_a_cache_file": (b"hello world, not a cache" * 4, "not a pyengine KV cache file (bad magic)"),
        "corrupt_header": (data[:16] + b"X" + data[17:], "header checksum mismatch"),
        "empty": (b"", "truncated in the header"),
    }


@pytest.mark.parametrize("case", ["truncated_in_a_record", "truncated_before_the_trailer", "flipped_byte",
                                  "wrong_version", "not_a_cache_file", "corrupt_header", "empty"])
def test_a_damaged_file_raises_and_leaves_the_pool_unchanged(llama_dir, saved, tmp_path, case):
    path, _, _, warm_tokens, _ = saved
    content, message = _bad_copies(path)[case]
    bad = tmp_path / "bad.pekv"
    bad.write_bytes(content)
    engine = make_engine(llama_dir)
    run(engine, [FIRST[1]])
    before = engine.stats()
    with pytest.raises(KvCacheFileError, match=re.escape(message)) as e:
        engine.load_kv_cache(bad)
    assert str(bad) in str(e.value)
    assert engine.stats() == before
    tokens, reused = run(engine, [FOLLOW_UPS[1]])
    assert tokens == [warm_tokens[1]] and reused == [40]  # FIRST[1]'s blocks are still there, nothing else


@pytest.mark.parametrize("kv, message", [
    ({"dtype": "float16"}, "fingerprint mismatch in 'kv_dtype': the file has 'float32', this engine has 'float16'"),
    ({"tokens_per_block": 16}, "fingerprint mismatch in 'tokens_per_block': the file has 8, this engine has 16"),
])
def test_another_configuration_is_refused(llama_dir, saved, kv, message):
    path = saved[0]
    engine = make_engine(llama_dir, **kv)
    before = engine.stats()
    with pytest.raises(KvCacheFileError, match=re.escape(message)):
        engine.load_kv_cache(path)
    assert engine.stats() == before


@pytest.mark.parametrize("kwargs, message", [
    (dict(quantize_lm_head=False), "fingerprint mismatch in 'quantize_lm_head': the file has None, this engine has False"),
    (dict(lm_head_quantization="q4_0"),
     "fingerprint mismatch in 'lm_head_quantization': the file has None, this engine has 'q4_0'"),
])
def test_another_embedding_or_output_format_is_refused(llama_dir, tmp_path, kwargs, message):
    """quantize_lm_head=False keeps a quantized model's embedding table in float, and a tied
    model's table is its output projection, whose format lm_head_quantization sets: other hidden
    states, other K/V than those of the default's table (the layers are quantized alike)."""
    path = tmp_path / "q8.pekv"
    kv = KvCacheConfig(tokens_per_block=TPB, max_tokens=1024)
    saver = Engine(llama_dir, dtype="float32", quantization="q8_0", max_seq_len=128, kv_cache_config=kv)
    run(saver, [FIRST[0]])
    saver.save_kv_cache(path)
    saver.shutdown()
    engine = Engine(llama_dir, dtype="float32", quantization="q8_0", max_seq_len=128, kv_cache_config=kv, **kwargs)
    before = engine.stats()
    with pytest.raises(KvCacheFileError, match=re.escape(message)):
        engine.load_kv_cache(path)
    assert engine.stats() == before
    engine.shutdown()


def test_another_model_is_refused(checkpoint_factory, saved):
    other = checkpoint_factory("llama_gqa_seed1", model_type="llama", num_heads=4, num_kv_heads=2, seed=1)
    engine = make_engine(other)
    before = engine.stats()
    with pytest.raises(KvCacheFileError, match="fingerprint mismatch in 'model_files'"):
        engine.load_kv_cache(saved[0])
    assert engine.stats() == before


def test_a_crash_during_save_leaves_the_previous_file(llama_dir, tmp_path, monkeypatch):
    path = tmp_path / "cache.pekv"
    engine = make_engine(llama_dir)
    run(engine, [FIRST[0]])
    engine.save_kv_cache(path)
    previous = path.read_bytes()
    run(engine, [FIRST[2]])
    real, calls = kv_persistence._write_record, []

    def crash(*args):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("simulated crash")
        real(*args)

    monkeypatch.setattr(kv_persistence, "_write_record", crash)
    with pytest.raises(OSError, match="simulated crash"):
        engine.save_kv_cache(path)
    assert path.read_bytes() == previous
    assert os.listdir(tmp_path) == ["cache.pekv"]


def test_a_smaller_pool_loads_the_most_recent_blocks(llama_dir, saved):
    path, _, blocks, warm_tokens, _ = saved
    engine = make_engine(llama_dir, max_tokens=8 * TPB, max_seq_len=64)  # the smallest pool max_seq_len allows
    assert blocks > 8
    loaded = engine.load_kv_cache(path)
    assert (loaded["blocks_loaded"], loaded["blocks_skipped"]) == (8, blocks - 8)
    # FIRST[2] ran last: SYSTEM's 5 blocks (freed last, with it) and its own next ones came first
    tokens, reused = run(engine, [FIRST[2][:50]])
    assert tokens == [warm_tokens[2]] and reused == [48]


def test_load_from_at_start_up(llama_dir, saved, tmp_path):
    path, _, blocks, warm_tokens, warm_reused = saved
    engine = make_engine(llama_dir, load_from=path)
    assert engine._parts.kv_loaded["blocks_loaded"] == blocks
    assert engine.stats()["num_reusable_blocks"] == blocks
    assert run(engine, [FOLLOW_UPS[0]]) == ([warm_tokens[0]], [warm_reused[0]])
    with pytest.raises(StartupError, match="phase 'executor'.*fingerprint mismatch in 'tokens_per_block'"):
        make_engine(llama_dir, tokens_per_block=16, load_from=path)
    with pytest.raises(TypeError, match="load_from must be a path or None, got 3"):
        KvCacheConfig(load_from=3)


def run_salted(engine: Engine, prompt: list[int], salt: str | None) -> tuple[list[int], int]:
    engine.add_request(prompt, PARAMS, cache_salt=salt)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    return done[0].token_ids, done[0].metrics.num_reused_tokens


def test_a_salted_chain_is_reused_with_its_salt_only(llama_dir, tmp_path):
    path = tmp_path / "salted.pekv"
    first = make_engine(llama_dir)
    tokens, _ = run_salted(first, FIRST[0], "alice")
    first.save_kv_cache(path)
    engine = make_engine(llama_dir)
    assert engine.load_kv_cache(path)["blocks_loaded"] == first.stats()["num_reusable_blocks"]
    assert run_salted(engine, FIRST[0], None)[1] == 0
    assert run_salted(engine, FIRST[0], "alice") == (tokens, 40)


def test_save_and_load_need_an_idle_engine(llama_dir, saved, tmp_path):
    engine = make_engine(llama_dir)
    engine.add_request(FIRST[0], PARAMS)
    with pytest.raises(RuntimeError, match="save_kv_cache needs an idle engine: 1 requests are in flight"):
        engine.save_kv_cache(tmp_path / "x.pekv")
    with pytest.raises(RuntimeError, match="load_kv_cache needs an idle engine"):
        engine.load_kv_cache(saved[0])
    assert not (tmp_path / "x.pekv").exists()
    while engine.has_unfinished_requests():
        engine.step()
