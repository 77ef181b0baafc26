"""Text output: incremental detokenization, stop strings, streams; abort and sampler state."""

from __future__ import annotations

import pytest

from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig
from pyengine.engine.detokenizer import IncrementalDetokenizer
from pyengine.engine.outputs import find_stop_string, partial_stop_suffix

PROMPT = [5, 9, 44, 71, 100, 3, 8]
MULTIBYTE = "Grüße, 你好世界! 🙂🚀 naïve café"


def make_engine(model_dir, **kw) -> Engine:
    return Engine(model_dir, max_seq_len=256, seed=0,
                  kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=4096),
                  scheduler_config=SchedulerConfig(max_batch_size=kw.pop("max_batch_size", 8),
                                                   max_num_tokens=kw.pop("max_num_tokens", 64)))


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def test_incremental_detokenization_never_breaks_a_character(llama_dir):
    engine = make_engine(llama_dir)
    tok = engine.tokenizer
    ids = tok(MULTIBYTE, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(MULTIBYTE) // 2  # byte-level pieces: characters span tokens
    d = IncrementalDetokenizer(tok)
    pieces = [d.add([t], final=(i == len(ids) - 1)) for i, t in enumerate(ids)]
    assert "".join(pieces) == MULTIBYTE
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # some tokens had to wait for the rest of a character


def test_streamed_text_adds_up_to_the_final_text(llama_dir):
    engine = make_engine(llama_dir)
    outs = list(engine.stream("Grüße 你好", greedy(40)))
    assert "".join(o.new_text for o in outs) == outs[-1].text
    assert outs[-1].text == engine.tokenizer.decode(outs[-1].token_ids, skip_special_tokens=True)
    assert [o.finished for o in outs] == [False] * 39 + [True]


def _greedy_text(engine, n=40):
    return engine.generate([PROMPT], greedy(n), use_tqdm=False)[0]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens_cuts_the_text(llama_dir, include):
    engine = make_engine(llama_dir)
    full = _greedy_text(engine)
    # token boundaries in the greedy text; a stop string straddling two of them
    tok = engine.tokenizer
    bounds = [len(tok.decode(full.token_ids[:i])) for i in range(1, len(full.token_ids) + 1)]
    def straddles(b: int) -> bool:
        window = full.text[b - 2: b + 3]
        return 6 <= b <= len(full.text) - 6 and "\ufffd" not in window and full.text.index(window) == b - 2

    b = next(x for x in bounds if straddles(x))
    stop = full.text[b - 2: b + 3]
    start = b - 2
    out = engine.generate([PROMPT], greedy(40, stop=[stop, "never-appears"], include_stop_str_in_output=include),
                          use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: start + (len(stop) if include else 0)]
    assert len(out.token_ids) < len(full.token_ids)
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    streamed = list(make_engine(llama_dir).stream(PROMPT, greedy(40, stop=stop, include_stop_str_in_output=include)))
    assert "".join(o.new_text for o in streamed) == out.text  # nothing past the cut was ever shown


def test_a_stop_string_completed_at_min_tokens_never_takes_back_streamed_text(llama_dir):
    """Stop strings count from min_tokens on, but a stop string's beginning is held back
    before that too: one that starts in the text of token k-1 and completes with token k =
    min_tokens cuts the text where the stream has not been yet (the text shrank: a stream's
    pieces no longer added up). Found by the soak (tests/test_soak.py)."""
    engine = make_engine(llama_dir)
    texts = [o.text for o in engine.stream(PROMPT, greedy(30))]
    k = next(k for k in range(4, 29) if len(texts[k - 1]) > len(texts[k - 2]) and len(texts[k]) > len(texts[k - 1])
             and "\ufffd" not in texts[k][len(texts[k - 1]) - 1: len(texts[k - 1]) + 1])
    stop = texts[k][len(texts[k - 1]) - 1: len(texts[k - 1]) + 1]  # the last character of token k-1's text + the next
    outs = list(engine.stream(PROMPT, greedy(30, stop=[stop], min_tokens=k + 1)))
    pieces = [o.new_text for o in outs]
    assert all(b.text.startswith(a.text) for a, b in zip(outs, outs[1:]))
    assert "".join(pieces) == outs[-1].text
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop


def test_a_stop_string_that_ended_before_min_tokens_never_takes_back_streamed_text():
    """stop=["th", " t"], min_tokens=3: " t" completes with token 2 (not checked yet) while
    its "t" is held back as a possible "th"; token 3 must not cut the text before " t"
    (it did: "Q " shown, then "Q"). Found by the soak (tests/test_soak.py)."""
    from pyengine.engine.outputs import RequestMetrics, RequestRecord

    class Pieces:  # a tokenizer whose tokens decode to fixed strings
        def decode(self, ids, skip_special_tokens=True):
            return "".join({1: "Q", 2: " t", 3: "x"}[i] for i in ids)

    state = RequestRecord(request_id=0, core_id=0, prompt_token_ids=[1], params=SamplingParams(stop=["th", " t"], min_tokens=3),
                         seed=0, stop_ids=[], detokenizer=IncrementalDetokenizer(Pieces()),
                         metrics=RequestMetrics(arrival_time=0.0))
    shown = []
    for token in (1, 2, 3):
        new_text, stopped = state.append_token(token, None, final=False)
        assert not stopped and state.text.startswith("".join(shown))
        shown.append(new_text)
    assert "".join(shown) == state.text == "Q tx"


def test_stop_string_helpers():
    assert find_stop_string("hello world", 0, ["wor", "lo"]) == (3, "lo")
    assert find_stop_string("hello world", 8, ["wor"]) == (6, "wor")  # ends after start
    assert find_stop_string("hello", 0, ["xyz"]) is None
    assert partial_stop_suffix("the sto", ["stop"]) == 3
    assert partial_stop_suffix("the st", ["xyz", "stop"]) == 2
    assert partial_stop_suffix("the end", ["stop"]) == 0


def test_interleaved_streams_each_get_their_own_outputs(llama_dir):
    engine = make_engine(llama_dir)
    expected = [o.token_ids for o in engine.generate([PROMPT, [300, 12, 17]], greedy(12), use_tqdm=False)]
    a, b = engine.stream(PROMPT, greedy(12)), engine.stream([300, 12, 17], greedy(12))
    got_a, got_b = [], []
    for _ in range(12):
        got_a += next(a).new_token_ids
        got_b += next(b).new_token_ids
    assert [got_a, got_b] == expected
    with pytest.raises(StopIteration):
        next(a)


def test_closing_a_stream_early_aborts_its_request(llama_dir):
    engine = make_engine(llama_dir)
    s = engine.stream(PROMPT, greedy(50))
    first = next(s)
    s.close()
    assert engine.has_unfinished_requests()
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(first.request_id, "abort")]
    assert not engine.has_unfinished_requests()


def test_abort_releases_sampler_state_and_leaves_seeded_neighbours_unchanged(llama_dir):
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=16, ignore_eos=True, repetition_penalty=1.1,
                             logprobs=2) for i in range(4)]
    prompts = [PROMPT, [300, 12, 17], list(range(10, 40)), [42] * 9]
    reference = make_engine(llama_dir).generate(prompts, params, use_tqdm=False)
    engine = make_engine(llama_dir)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    for _ in range(4):
        engine.step()
    assert engine.abort_request(ids[1])
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs[ids[1]].finish_reason == "abort"
    for rid, ref in zip(ids, reference):
        if rid != ids[1]:
            assert outs[rid].token_ids == ref.token_ids
    assert engine._sampler.all_greedy  # every feature counter back to zero


@pytest.mark.parametrize("kwargs, match", [
    (dict(top_p=0.0), "top_p must be in \\(0, 1\\], got 0.0"),
    (dict(top_p=1.5), "top_p must be in \\(0, 1\\], got 1.5"),
    (dict(top_k=0), "top_k must be -1 \\(disabled\\) or a positive int, got 0"),
    (dict(top_k=-5), "top_k must be -1"),
    (dict(min_p=1.5), "min_p must be in \\[0, 1\\], got 1.5"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0, got 0.0"),
    (dict(presence_penalty=2.5), "presence_penalty must be in \\[-2, 2\\], got 2.5"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in \\[-2, 2\\], got -3"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens must be an int in \\[0, max_tokens=10\\], got 20"),
    (dict(seed=-1), "seed must be an int in \\[0, 2\\*\\*63\\), got -1"),
    (dict(stop=[""]), "stop must be a non-empty string"),
    (dict(logprobs=21), "logprobs must be None or an int in \\[0, 20\\], got 21"),
    (dict(prompt_logprobs=-1), "prompt_logprobs must be None or an int in \\[0, 20\\], got -1"),
    (dict(temperature=float("nan")), "temperature must be >= 0, got nan"),
])
def test_bad_sampling_values_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_stop_token_outside_the_vocabulary_is_rejected(llama_dir):
    engine = make_engine(llama_dir)
    with pytest.raises(ValueError, match="stop_token_ids entry 600 is outside the vocabulary \\[0, 512\\)"):
        engine.add_request(PROMPT, SamplingParams(stop_token_ids=[600]))
    assert not engine.has_unfinished_requests()
    assert engine.generate([PROMPT], greedy(3), use_tqdm=False)[0].finish_reason == "length"
