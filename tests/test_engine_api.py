"""The public API: step() outputs, stop conditions, abort, text, and bad input."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from hf_reference import hf_greedy
from pyengine import Engine, KvCacheConfig, RequestOutput, SamplingParams, SchedulerConfig, StartupError

PROMPTS = [[5, 9, 44, 71, 100, 3, 8], [300, 12, 17], list(range(10, 70)), [42] * 25]


def make_engine(model_dir, **kw) -> Engine:
    return Engine(model_dir, max_seq_len=kw.pop("max_seq_len", 256),
                  kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=kw.pop("max_tokens", 2048)),
                  scheduler_config=SchedulerConfig(max_batch_size=kw.pop("max_batch_size", 4),
                                                   max_num_tokens=kw.pop("max_num_tokens", 64)), **kw)


def drain(engine: Engine) -> dict[int, list[RequestOutput]]:
    by_id: dict[int, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            by_id.setdefault(out.request_id, []).append(out)
    return by_id


def test_step_outputs_stream_each_token_once(llama_dir):
    engine = make_engine(llama_dir)
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)) for p in PROMPTS]
    by_id = drain(engine)
    for rid, prompt in zip(ids, PROMPTS):
        outs = by_id[rid]
        assert [o.finished for o in outs] == [False] * 9 + [True]
        streamed = [t for o in outs for t in o.new_token_ids]
        assert streamed == outs[-1].token_ids == hf_greedy(llama_dir, prompt, 10)
        assert outs[-1].prompt_token_ids == prompt
        assert outs[-1].finish_reason == "length"
        assert "".join(o.new_text for o in outs) == outs[-1].text
        m = outs[-1].metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
        assert m.time_to_first_token is not None and m.time_to_first_token >= 0
        assert m.time_per_output_token(10) == pytest.approx((m.finish_time - m.first_token_time) / 9)
        assert outs[0].metrics.time_per_output_token(1) is None  # not finished yet


def test_text_prompt_and_text_output(llama_dir):
    engine = make_engine(llama_dir)
    tok = engine.tokenizer
    out = engine.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == tok("The quick brown fox")["input_ids"]
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


def test_stop_token_ids_end_the_request(llama_dir):
    expected = hf_greedy(llama_dir, PROMPTS[2], 20)
    stop = expected[6]
    first = expected.index(stop)
    engine = make_engine(llama_dir)
    out = engine.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop]), use_tqdm=False)[0]
    assert out.token_ids == expected[: first + 1]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop


def test_eos_stops_like_transformers(checkpoint_factory):
    """A model whose eos is a token it generates: both engines stop at it."""
    model_dir = checkpoint_factory("llama_gqa", model_type="llama", num_heads=4, num_kv_heads=2)
    expected = hf_greedy(model_dir, PROMPTS[0], 40)
    eos = expected[10]
    patched = model_dir.parent / "eos_patched"
    if not patched.exists():
        shutil.copytree(model_dir, patched)
        cfg = json.loads((patched / "config.json").read_text())
        cfg["eos_token_id"] = eos
        (patched / "config.json").write_text(json.dumps(cfg))
    out = make_engine(patched).generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0]
    ref = hf_greedy(patched, PROMPTS[0], 40, stop_at_eos=True)
    assert out.token_ids == ref == expected[: expected.index(eos) + 1]
    assert out.finish_reason == "stop"
    ignored = make_engine(patched).generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                                            use_tqdm=False)[0]
    assert ignored.token_ids == expected


def test_generate_returns_in_input_order(llama_dir):
    engine = make_engine(llama_dir)
    lens = [30, 3, 17, 8]
    outs = engine.generate(PROMPTS, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens], use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == lens
    assert [o.prompt_token_ids for o in outs] == PROMPTS


@pytest.mark.parametrize("when", ["waiting", "prefilling", "decoding"])
def test_abort_frees_everything_and_leaves_others_unchanged(llama_dir, when):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = make_engine(llama_dir).generate(PROMPTS, params, use_tqdm=False)

    engine = make_engine(llama_dir, max_batch_size=2, max_num_tokens=16)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    victim = {"waiting": ids[3], "prefilling": ids[2], "decoding": ids[0]}[when]
    outs: dict[int, list[RequestOutput]] = {}
    aborted = False
    while engine.has_unfinished_requests():
        if not aborted:
            state = _state_of(engine, victim)
            if state == when:
                assert engine.abort_request(victim) is True
                aborted = True
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert aborted, f"request never reached state {when}"
    final = outs[victim][-1]
    assert final.finished and final.finish_reason == "abort"
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_blocks"]
    for rid, ref in zip(ids, reference):
        if rid != victim:
            assert outs[rid][-1].token_ids == ref.token_ids
    assert engine.abort_request(victim) is False  # already finished
    with pytest.raises(ValueError, match="unknown request_id 12345"):
        engine.abort_request(12345)


def _state_of(engine: Engine, rid: int) -> str:
    m = engine._bm.request_metrics(rid)
    if m["seq_slot"] < 0:
        return "waiting"
    return "decoding" if m["first_token_time"] >= 0 else "prefilling"


@pytest.mark.parametrize("prompt, params, error, match", [
    ([], None, ValueError, "prompt is empty"),
    ([1, 2, 512], None, ValueError, "prompt token id 512 at position 2 is outside the vocabulary"),
    ([1, -1], None, ValueError, "prompt token id -1 at position 1"),
    ([1] * 250, SamplingParams(temperature=0.0, max_tokens=10), ValueError, "250 \\+ max_tokens 10 = 260 exceeds max_seq_len 256"),
    ([1, 2], "greedy", TypeError, "params must be SamplingParams"),
    (3.5, None, TypeError, "prompt must be a str or a sequence of token ids"),
    ([1, 2.5], None, TypeError, "prompt token ids must be ints, got 2.5"),
])
def test_bad_requests_raise_before_any_state_change(llama_dir, prompt, params, error, match):
    engine = make_engine(llama_dir)
    keep = engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    before = engine.stats()
    with pytest.raises(error, match=match):
        engine.add_request(prompt, params)
    assert engine.stats() == before
    outs = drain(engine)
    assert outs[keep][-1].token_ids == hf_greedy(llama_dir, PROMPTS[0], 4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens must be at least 1, got 0"),
    (dict(max_tokens=-3), "max_tokens must be at least 1, got -3"),
    (dict(temperature=-1.0), "temperature must be >= 0, got -1.0"),
    (dict(stop_token_ids=[-2]), "stop_token_ids must be non-negative ints"),
])
def test_bad_sampling_params_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_duplicate_request_id_is_rejected(llama_dir):
    engine = make_engine(llama_dir)
    engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2), request_id=7)
    with pytest.raises(ValueError, match="request_id 7 is already in use"):
        engine.add_request([4, 5], SamplingParams(temperature=0.0, max_tokens=2), request_id=7)
    outs = drain(engine)
    assert list(outs) == [7] and outs[7][-1].prompt_token_ids == [1, 2, 3]


def test_a_failed_generate_queues_nothing(llama_dir):
    engine = make_engine(llama_dir)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, 2], [3, 4], [9999]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert engine.generate([[1, 2]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0].token_ids


def test_unknown_model_type_is_named(llama_dir, tmp_path):
    bad = tmp_path / "gpt2"
    shutil.copytree(llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(StartupError, match="phase 'config': ValueError: unsupported model_type 'gpt2'; "
                                           "supported: llama, mistral, qwen2, qwen3, gemma2, gemma3_text, gemma3, "
                                           "phi3, smollm3$"):
        Engine(bad)


def test_missing_tensor_is_named(llama_dir, tmp_path):
    bad = tmp_path / "missing"
    shutil.copytree(llama_dir, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(StartupError, match="phase 'weights'.*missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        Engine(bad)


def test_wrong_tensor_shape_and_malformed_files(llama_dir, tmp_path):
    bad = tmp_path / "shape"
    shutil.copytree(llama_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(StartupError, match="phase 'weights'.*'model.layers.0.mlp.gate_proj.weight' has shape "
                                           "\\(128, 64\\), expected \\(96, 64\\)"):
        Engine(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(StartupError, match="phase 'config'.*malformed"):
        Engine(bad)
    with pytest.raises(StartupError, match="phase 'config': FileNotFoundError: model directory .* does not exist"):
        Engine(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StartupError, match="phase 'config': FileNotFoundError: no config.json"):
        Engine(tmp_path / "empty")


def test_bad_engine_configuration_is_named(llama_dir):
    with pytest.raises(StartupError, match="phase 'config'.*dtype must be one of"):
        Engine(llama_dir, dtype="int8")
    with pytest.raises(ValueError, match="capacity_scheduler_policy must be one of"):
        SchedulerConfig(capacity_scheduler_policy="fastest")
    with pytest.raises(StartupError, match="phase 'kv_capacity'.*fewer than max_seq_len=1024"):
        Engine(llama_dir, kv_cache_config=KvCacheConfig(max_tokens=64), scheduler_config=SchedulerConfig(max_batch_size=2))
    with pytest.raises(StartupError, match="phase 'config'.*max_seq_len must be in"):
        Engine(llama_dir, max_seq_len=5000)


def test_shutdown_and_context_manager(llama_dir):
    with make_engine(llama_dir) as engine:
        engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    with pytest.raises(RuntimeError, match="shut down"):
        engine.step()
