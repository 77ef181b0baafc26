"""Structured output: every constraint kind holds on a random-weight model (the constraint does
all the work), a constrained request's tokens do not depend on what it is batched with, on
preemption, the overlap loop, prefix reuse, chunked prefill or a failed step; bad constraints
raise before anything changes."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pyengine import Engine, GuidedDecodingParams, KvCacheConfig, SamplingParams, SchedulerConfig

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "colour", "address"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,6} [0-9]{1,3}(\.[0-9]{2})?"
CHOICES = ["apple", "banana split", "cherry"]
GRAMMAR = 'root ::= "(" expr ")"\nexpr ::= num | num ("+" | "*") num\nnum ::= [1-9] [0-9]?'
PROMPTS = [[5, 9, 44, 71, 100, 3, 8], [300, 12, 17], list(range(10, 50)), [42] * 25]


def make_engine(model_dir, **kw) -> Engine:
    sc = dict(max_batch_size=8, max_num_tokens=kw.pop("max_num_tokens", 256))
    sc.update(kw.pop("scheduler", {}))
    return Engine(model_dir, max_seq_len=kw.pop("max_seq_len", 512),
                  kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=kw.pop("max_tokens", 4096)),
                  scheduler_config=SchedulerConfig(**sc), **kw)


def close_strings_and_objects(ids: list[int], row):
    """json_object puts no bound on keys or strings: a random-weight model, to whom a closing
    quote is one token in hundreds, would write a key of hundreds of tokens. This logits
    processor favours '"' and '}' so that objects end within max_tokens; the mask, applied
    after it, still decides what is allowed."""
    row = row.clone()
    row[list(_CLOSERS)] += 6.0
    return row


_CLOSERS = (1, 1)  # set by the module fixture below from the tokenizer


@pytest.fixture(scope="module", autouse=True)
def closers(llama_dir):
    from transformers import AutoTokenizer
    global _CLOSERS
    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    _CLOSERS = tuple(tok.convert_tokens_to_ids(c) for c in ('"', "}"))


def constrained(kind: str, seed: int, max_tokens: int = 160, **kw) -> SamplingParams:
    if kind == "json_object":
        kw.setdefault("logits_processors", [close_strings_and_objects])
    g = {"json": GuidedDecodingParams(json=SCHEMA), "regex": GuidedDecodingParams(regex=REGEX),
         "choice": GuidedDecodingParams(choice=CHOICES), "grammar": GuidedDecodingParams(grammar=GRAMMAR),
         "json_object": GuidedDecodingParams(json_object=True)}[kind]
    return SamplingParams(temperature=kw.pop("temperature", 1.0), seed=seed, max_tokens=max_tokens,
                          guided_decoding=g, **kw)


def check_valid(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    else:
        assert re.fullmatch(r"\(([1-9][0-9]?)([+*][1-9][0-9]?)?\)", text), text


KINDS = ["json", "json_object", "regex", "choice", "grammar"]


@pytest.mark.parametrize("kind", KINDS)
def test_each_constraint_kind_holds(llama_dir, kind):
    engine = make_engine(llama_dir)
    outs = engine.generate([PROMPTS[i % 4] for i in range(8)], [constrained(kind, seed=i) for i in range(8)],
                           use_tqdm=False)
    for o in outs:
        assert o.finish_reason == "stop" and o.stop_reason == 2, (o.finish_reason, o.text)
        assert o.token_ids[-1] == 2  # the end-of-sequence token, once the grammar is complete
        check_valid(kind, o.text)
    assert len({o.text for o in outs}) > 1  # sampled: the constraint, not the model, decides the form
    engine.check_resources()


def test_greedy_and_ignore_eos(llama_dir):
    """Greedy decoding under a constraint; with ignore_eos the grammar's completion ends the request."""
    engine = make_engine(llama_dir)
    greedy = engine.generate(PROMPTS[0], constrained("choice", 0, temperature=0.0), use_tqdm=False)[0]
    assert greedy.text in CHOICES and greedy.finish_reason == "stop"
    o = engine.generate(PROMPTS[0], constrained("regex", 3, ignore_eos=True), use_tqdm=False)[0]
    assert o.finish_reason == "stop" and o.stop_reason == 2
    check_valid("regex", o.text)
    engine.check_resources()


def alone(model_dir, prompts, params) -> list[list[int]]:
    engine = make_engine(model_dir)
    return [engine.generate(p, sp, use_tqdm=False)[0].token_ids for p, sp in zip(prompts, params)]


def mixed_batch():
    prompts = [PROMPTS[i % 4] for i in range(8)]
    params = [constrained(KINDS[i % 5], seed=10 + i) for i in range(6)]
    params += [SamplingParams(temperature=1.0, seed=30, max_tokens=40, ignore_eos=True),
               SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2)]
    return prompts, params


@pytest.fixture(scope="module")
def expected_alone(llama_dir):
    prompts, params = mixed_batch()
    return alone(llama_dir, prompts, params)


@pytest.mark.parametrize("setup", [
    dict(),
    dict(overlap=True),
    dict(max_num_tokens=16),  # chunked prefill: prompts split over steps
    dict(max_tokens=200, max_seq_len=200, scheduler=dict(capacity_scheduler_policy="max_utilization")),
    dict(max_tokens=200, max_seq_len=200, overlap=True, scheduler=dict(capacity_scheduler_policy="max_utilization")),
])
def test_mixed_batch_equals_each_request_alone(llama_dir, expected_alone, setup):
    prompts, params = mixed_batch()
    engine = make_engine(llama_dir, **setup)
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected_alone
    if "max_utilization" in str(setup):
        assert sum(o.metrics.num_pauses for o in outs) > 0  # preemption happened
    for o, sp in zip(outs, params):
        if sp.guided_decoding is not None:
            check_valid(sp.guided_decoding.kind, o.text)
    engine.check_resources()


def test_prefix_reuse_keeps_constrained_outputs(llama_dir):
    engine = make_engine(llama_dir)
    params = constrained("json", seed=5)
    first = engine.generate(PROMPTS[2], params, use_tqdm=False)[0]
    again = engine.generate(PROMPTS[2], params, use_tqdm=False)[0]
    assert again.metrics.num_reused_tokens > 0 and again.token_ids == first.token_ids


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failed_step_leaves_the_matchers_as_they_were(llama_dir, expected_alone, overlap):
    """A logits processor raises every 5th call: the step fails and is retried; outputs equal
    the failure-free ones (the matchers never saw the failed step's tokens)."""
    prompts, params = mixed_batch()
    calls = {"n": 0}

    def flaky(ids, row):
        calls["n"] += 1
        if calls["n"] % 5 == 0:
            raise RuntimeError("injected")
        return row

    params = [SamplingParams(**{**p.__dict__, "logits_processors": [flaky]}) if i == 0 else p
              for i, p in enumerate(params)]
    engine = make_engine(llama_dir, overlap=overlap)
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    outs, failures = {}, 0
    while engine.has_unfinished_requests():
        try:
            for o in engine.step():
                outs[o.request_id] = o
        except RuntimeError as e:
            assert str(e) == "injected"
            failures += 1
    assert failures > 0
    assert [outs[i].token_ids for i in range(len(prompts))] == expected_alone
    engine.check_resources()


def test_abort_frees_a_constrained_request(llama_dir):
    engine = make_engine(llama_dir)
    rid = engine.add_request(PROMPTS[0], constrained("json", 1))
    engine.step()
    engine.step()
    assert engine.abort_request(rid)
    outs = engine.step()
    assert [o.finish_reason for o in outs if o.request_id == rid] == ["abort"]
    assert not engine._sampler._matchers
    engine.check_resources()


def test_bad_constraints_raise_before_anything_changes(llama_dir):
    engine = make_engine(llama_dir)
    before = engine.stats()
    with pytest.raises(ValueError, match="exactly one constraint, got 2: json, regex"):
        GuidedDecodingParams(json=SCHEMA, regex="a+")
    with pytest.raises(ValueError, match="exactly one constraint, got 0"):
        GuidedDecodingParams()
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        GuidedDecodingParams(choice="yes")
    with pytest.raises(TypeError, match="guided_decoding must be GuidedDecodingParams"):
        SamplingParams(guided_decoding={"json": SCHEMA})
    bad = [(dict(regex="a(b"), r"invalid guided decoding regex 'a\(b': missing \)"),
           (dict(json={"type": "objekt"}), "invalid guided decoding json .*Unsupported type \"objekt\""),
           (dict(json="{not json"), "invalid guided decoding json '{not json': .*Failed to parse JSON"),
           (dict(grammar="root ::= foo"), "invalid guided decoding grammar .*Rule \"foo\" is not defined"),
           (dict(structural_tag="{}"), "invalid guided decoding structural_tag '{}'")]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match):
            engine.add_request(PROMPTS[0], SamplingParams(guided_decoding=GuidedDecodingParams(**kw)))
    assert engine.stats() == before
    engine.check_resources()


def test_an_unsatisfiable_length_ends_by_length(llama_dir):
    """A constraint that cannot complete within max_tokens: finish_reason "length", honestly."""
    engine = make_engine(llama_dir)
    g = GuidedDecodingParams(regex="a{50}")
    o = engine.generate(PROMPTS[0], SamplingParams(max_tokens=5, seed=1, guided_decoding=g), use_tqdm=False)[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 5 and set(o.text) == {"a"}


def test_structural_tag(llama_dir):
    tag = {"type": "structural_tag",
           "format": {"type": "sequence", "elements": [
               {"type": "const_string", "value": "<answer>"},
               {"type": "json_schema", "json_schema": {"type": "object", "properties": {"n": {"type": "integer"}},
                                                       "required": ["n"], "additionalProperties": False}},
               {"type": "const_string", "value": "</answer>"}]}}
    engine = make_engine(llama_dir)
    o = engine.generate(PROMPTS[1], SamplingParams(seed=2, max_tokens=80,
                                                   guided_decoding=GuidedDecodingParams(structural_tag=tag)),
                        use_tqdm=False)[0]
    m = re.fullmatch(r"<answer>(.*)</answer>", o.text, re.S)
    assert m and isinstance(json.loads(m.group(1))["n"], int), o.text


def test_validity_over_hundreds_of_outputs(llama_dir):
    """300 sampled constrained outputs of a random-weight model, all valid."""
    engine = make_engine(llama_dir, scheduler=dict(max_batch_size=32))
    prompts = [PROMPTS[i % 4] for i in range(300)]
    params = [constrained(KINDS[i % 5], seed=1000 + i, max_tokens=200) for i in range(300)]
    outs = engine.generate(prompts, params, use_tqdm=False)
    for o, sp in zip(outs, params):
        assert o.finish_reason == "stop", o.text
        check_valid(sp.guided_decoding.kind, o.text)
    engine.check_resources()


def test_with_stop_strings_logprobs_priorities_and_chat(llama_dir):
    engine = make_engine(llama_dir, scheduler=dict(queue_policy="priority"))
    # a stop string ends a constrained request as any other (the text is cut before it)
    o = engine.generate(PROMPTS[0], constrained("regex", 4, stop=[" "], logprobs=2), use_tqdm=False)[0]
    assert o.finish_reason == "stop" and o.stop_reason == " " and re.fullmatch(r"[A-Z][a-z]{2,6}", o.text)
    assert len(o.logprobs) == len(o.token_ids) and all(len(lp) >= 2 for lp in o.logprobs)
    # logprobs are the model's raw distribution, the chosen token always among them
    assert all(t in lp for t, lp in zip(o.token_ids, o.logprobs))
    rid = engine.add_request(PROMPTS[1], constrained("choice", 5), priority=0.9)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({x.request_id: x for x in engine.step()})
    assert outs[rid].text in CHOICES
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    reply = list(engine.chat([{"role": "user", "content": "Pick a fruit"}], constrained("choice", 6),
                             chat_template=template))[-1]
    assert reply.text in CHOICES
    engine.check_resources()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_constrained_requests_speculate(llama_dir, expected_alone, method, tmp_path_factory):
    """Speculative decoding: a constrained request's drafts are checked against its grammar
    (the matcher advances through them and rolls back): outputs stay valid; with prompt
    lookup's point-mass drafts, seeded outputs are those without speculation."""
    from pyengine import SpeculativeConfig
    from pyengine.testing.checkpoints import build_truncated_checkpoint
    if method == "ngram":
        spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
    else:
        draft = build_truncated_checkpoint(llama_dir, tmp_path_factory.mktemp("guided_draft") / "model", 1)
        spec = SpeculativeConfig(method="draft_model", draft_model=draft, num_speculative_tokens=3)
    prompts, params = mixed_batch()
    engine = make_engine(llama_dir, speculative_config=spec)
    outs = engine.generate(prompts, params, use_tqdm=False)
    if method == "ngram":
        assert [o.token_ids for o in outs] == expected_alone
    for o, sp in zip(outs, params):
        if sp.guided_decoding is not None:
            check_valid(sp.guided_decoding.kind, o.text)
            assert o.finish_reason == "stop"
    guided = [o for o, sp in zip(outs, params) if sp.guided_decoding is not None]
    assert sum(o.metrics.num_draft_tokens for o in guided) > 0
    assert sum(o.metrics.num_accepted_draft_tokens for o in guided) > 0
    engine.check_resources()
    # a grammar that ends the request itself (ignore_eos: its end-of-sequence token does not):
    # tokens accepted after the grammar's end are dropped
    for sp in (constrained("regex", 3, ignore_eos=True), constrained("choice", 0, temperature=0.0)):
        plain = make_engine(llama_dir).generate(PROMPTS[0], sp, use_tqdm=False)[0]
        o = engine.generate(PROMPTS[0], sp, use_tqdm=False)[0]
        assert o.finish_reason == plain.finish_reason == "stop"
        check_valid(sp.guided_decoding.kind, o.text)
        if method == "ngram":
            assert (o.token_ids, o.text, o.stop_reason) == (plain.token_ids, plain.text, plain.stop_reason)
    engine.check_resources()
