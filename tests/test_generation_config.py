"""generation_config.json: its end-of-sequence ids stop requests, its sampling defaults fill the
fields a request leaves unset (explicit values win, even when equal to SamplingParams' defaults),
and generation_config="ignore" reads none of it."""

from __future__ import annotations

import copy
import json
import logging
import pickle
import shutil

import pytest
from transformers import GenerationConfig

from hf_reference import hf_greedy
from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig, StartupError
from pyengine.engine.generation_config import generation_defaults, read_generation_config

P1, P2 = [5, 9, 44, 71, 100, 3, 8], list(range(10, 40))
NEW = 16


def make_engine(model_dir, **kw) -> Engine:
    return Engine(model_dir, max_seq_len=kw.pop("max_seq_len", 128),
                  kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=1024),
                  scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=64), **kw)


def with_generation_config(src, dst, **fields):
    """A copy of the checkpoint `src` whose generation_config.json holds `fields`."""
    shutil.copytree(src, dst)
    (dst / "generation_config.json").unlink(missing_ok=True)
    GenerationConfig(**fields).save_pretrained(str(dst))
    return dst


def first_new(tokens: list[int], start: int, avoid: set[int]) -> int:
    """Index of the first token at or after `start` that appears neither earlier in `tokens` nor in `avoid`."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i] and tokens[i] not in avoid)


@pytest.fixture(scope="module")
def two_eos_dir(llama_dir, tmp_path_factory):
    """generation_config.json lists two end-of-sequence ids, a and b: P1's greedy continuation
    reaches a (before b), P2's reaches b (before a). config.json's eos id (2) occurs in neither."""
    g1, g2 = hf_greedy(llama_dir, P1, NEW), hf_greedy(llama_dir, P2, NEW)
    assert 2 not in g1 and 2 not in g2
    i = first_new(g1, 2, set())
    a = g1[i]
    j = first_new(g2, 2, {a} | set(g1[:i]))
    b = g2[j]
    assert b not in g1[:i + 1] and a not in g2[:j + 1]
    d = with_generation_config(llama_dir, tmp_path_factory.mktemp("two_eos") / "model", bos_token_id=1,
                               eos_token_id=[a, b])
    return d, (a, i, g1), (b, j, g2)


def test_each_generation_config_eos_id_stops_a_request(two_eos_dir):
    d, (a, i, g1), (b, j, g2) = two_eos_dir
    engine = make_engine(d)
    assert engine.startup_report()["generation_config"]["eos_token_ids"] == [2, a, b]
    o1, o2 = engine.generate([P1, P2], SamplingParams(temperature=0.0, max_tokens=NEW), use_tqdm=False)
    assert o1.token_ids == g1[:i + 1] and o1.finish_reason == "stop" and o1.stop_reason == a
    assert o2.token_ids == g2[:j + 1] and o2.finish_reason == "stop" and o2.stop_reason == b
    # ignore_eos still ignores all of them
    o1 = engine.generate(P1, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)[0]
    assert o1.token_ids == g1 and o1.finish_reason == "length"
    engine.check_resources()


def test_ignore_reads_no_generation_config(two_eos_dir):
    d, (a, i, g1), (b, j, g2) = two_eos_dir
    engine = make_engine(d, generation_config="ignore")
    assert engine.startup_report()["generation_config"] == {"source": None, "eos_token_ids": [2], "sampling": {}}
    o1, o2 = engine.generate([P1, P2], SamplingParams(temperature=0.0, max_tokens=NEW), use_tqdm=False)
    assert (o1.token_ids, o2.token_ids) == (g1, g2)
    assert o1.finish_reason == o2.finish_reason == "length"


def test_generation_config_path_instead_of_the_models(two_eos_dir, llama_dir):
    d, (a, i, g1), _ = two_eos_dir
    engine = make_engine(llama_dir, generation_config=d)  # the directory holding it
    assert engine.generate(P1, SamplingParams(temperature=0.0, max_tokens=NEW), use_tqdm=False)[0].token_ids == g1[:i + 1]
    engine = make_engine(llama_dir, generation_config=d / "generation_config.json")
    assert engine.startup_report()["generation_config"]["source"] == str(d / "generation_config.json")
    with pytest.raises(StartupError, match="generation_config '.*nowhere': no such file"):
        make_engine(llama_dir, generation_config=d / "nowhere")


@pytest.fixture(scope="module")
def defaults_dir(llama_dir, tmp_path_factory):
    """Sampling defaults: greedy, a repetition penalty (< 1: repeats favoured), 6 tokens, top_k 0 (= disabled)."""
    return with_generation_config(llama_dir, tmp_path_factory.mktemp("defaults") / "model", temperature=0.0,
                                  repetition_penalty=0.2, max_new_tokens=6, top_k=0, top_p=0.8, do_sample=True)


def test_sampling_defaults_fill_unset_fields_only(defaults_dir):
    engine = make_engine(defaults_dir)
    ref = make_engine(defaults_dir, generation_config="ignore")
    assert engine.startup_report()["generation_config"]["sampling"] == {
        "temperature": 0.0, "top_k": -1, "top_p": 0.8, "repetition_penalty": 0.2, "max_tokens": 6}

    def both(params: SamplingParams, expected_params: SamplingParams):
        got = engine.generate(P2, params, use_tqdm=False)[0]
        want = ref.generate(P2, expected_params, use_tqdm=False)[0]
        assert got.token_ids == want.token_ids
        return got

    # nothing set: every default applies (greedy, penalty 0.2, 6 tokens)
    out = both(SamplingParams(), SamplingParams(temperature=0.0, repetition_penalty=0.2, max_tokens=6, top_p=0.8))
    assert len(out.token_ids) == 6
    # no params at all: the same
    assert engine.generate(P2, use_tqdm=False)[0].token_ids == out.token_ids
    # the defaults change the result (so the comparisons above can fail)
    plain = ref.generate(P2, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0].token_ids
    assert plain != out.token_ids
    # explicit values win, including explicit values equal to SamplingParams' own defaults
    both(SamplingParams(repetition_penalty=1.0), SamplingParams(temperature=0.0, repetition_penalty=1.0, max_tokens=6,
                                                                top_p=0.8))
    sampled = both(SamplingParams(temperature=1.0, top_p=1.0, seed=7, max_tokens=12),
                   SamplingParams(temperature=1.0, top_p=1.0, seed=7, max_tokens=12, repetition_penalty=0.2))
    assert len(sampled.token_ids) == 12
    # a field assigned after construction counts as set
    p = SamplingParams(max_tokens=9)
    p.repetition_penalty = 1.0
    both(p, SamplingParams(temperature=0.0, repetition_penalty=1.0, max_tokens=9, top_p=0.8))
    engine.check_resources()


def test_default_max_tokens_is_capped_by_max_seq_len(llama_dir, tmp_path):
    d = with_generation_config(llama_dir, tmp_path / "model", max_new_tokens=500, temperature=0.0, do_sample=True)
    engine = make_engine(d, max_seq_len=40)
    out = engine.generate(P2, use_tqdm=False)[0]  # 30 prompt tokens: 10 left
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="max_seq_len"):  # an explicit max_tokens is the caller's to get right
        engine.add_request(P2, SamplingParams(max_tokens=11))
    engine.check_resources()


def test_sampling_params_tell_set_from_unset():
    p = SamplingParams(temperature=1.0)
    assert p.is_set("temperature") and not p.is_set("top_p")
    assert SamplingParams(16).is_set("max_tokens")  # positional
    q = p.with_defaults({"temperature": 0.0, "top_p": 0.5})
    assert (q.temperature, q.top_p) == (1.0, 0.5)
    assert not q.is_set("top_p")  # a default, not the caller's value
    assert copy.copy(p).is_set("temperature") and not copy.deepcopy(p).is_set("top_p")
    assert not pickle.loads(pickle.dumps(p)).is_set("top_p")
    rebuilt = SamplingParams(**{**p.__dict__, "seed": 3})  # every field given: every field set
    assert rebuilt.seed == 3 and rebuilt.is_set("top_p") and rebuilt == SamplingParams(temperature=1.0, seed=3)
    with pytest.raises(ValueError, match="no field 'nucleus'"):
        p.with_defaults({"nucleus": 0.5})
    with pytest.raises(ValueError, match="top_p must be in"):
        p.with_defaults({"top_p": 0.0})


def test_generation_config_files_are_checked(tmp_path, llama_dir):
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match=r"generation_config.json: temperature=-1 is not a valid default"):
        read_generation_config(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="malformed .*generation_config.json"):
        read_generation_config(path)
    path.write_text(json.dumps({"eos_token_id": [5, "x"]}))
    with pytest.raises(ValueError, match=r"eos_token_id must be a non-negative int .* got \[5, 'x'\]"):
        read_generation_config(path)
    d = tmp_path / "bad_model"
    shutil.copytree(llama_dir, d)
    (d / "generation_config.json").write_text(json.dumps({"top_p": 2.0}))
    with pytest.raises(StartupError, match="phase 'config'.*top_p=2.0 is not a valid default"):
        make_engine(d)


def test_eos_ids_merge_config_generation_config_and_tokenizer(tmp_path, caplog):
    class Tok:
        eos_token_id = 7

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 2, 900]}))
    with caplog.at_level(logging.WARNING):
        g = generation_defaults("auto", tmp_path, [2], Tok(), vocab_size=512)
    assert g.eos_token_ids == [2, 3, 7]
    assert "900 is outside the vocabulary" in caplog.text
    assert generation_defaults("ignore", tmp_path, [2], Tok(), vocab_size=512).eos_token_ids == [2, 7]
