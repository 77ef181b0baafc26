"""Conversations: messages rendered with the tokenizer's chat template exactly as transformers'
apply_chat_template renders them, streamed replies, the next turn reusing the previous turns'
KV blocks, and clear errors."""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoTokenizer

from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig

# A Qwen-style template: a system prompt, tool schemas, and a variable (enable_thinking).
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if not (loop.first and m.role == 'system') %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CONVERSATION = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the weather in Paris today?"}]
TPB = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_engine(model_dir, **kw) -> Engine:
    return Engine(model_dir, max_seq_len=512, kv_cache_config=KvCacheConfig(tokens_per_block=TPB, max_tokens=2048),
                  scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=128), **kw)


@pytest.fixture(scope="module")
def chat_dir(llama_dir, tmp_path_factory):
    """The tiny Llama with TEMPLATE as its tokenizer's chat template."""
    d = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(llama_dir, d)
    tok = AutoTokenizer.from_pretrained(str(d))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(d))
    return d


def reference_ids(model_dir, messages, **kw) -> list[int]:
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True,
                                        **kw)["input_ids"])


def test_rendering_equals_apply_chat_template(chat_dir):
    engine = make_engine(chat_dir)
    with_tools = reference_ids(chat_dir, CONVERSATION, tools=TOOLS)
    no_thinking = reference_ids(chat_dir, CONVERSATION, tools=TOOLS, enable_thinking=False)
    plain = reference_ids(chat_dir, CONVERSATION)
    assert len({tuple(with_tools), tuple(no_thinking), tuple(plain)}) == 3  # each option changes the text
    for kw, expected in ((dict(tools=TOOLS), with_tools),
                         (dict(tools=TOOLS, chat_template_kwargs={"enable_thinking": False}), no_thinking),
                         ({}, plain)):
        out = engine.generate(CONVERSATION, GREEDY, use_tqdm=False)[0] if not kw else None
        rid = engine.add_request(CONVERSATION, GREEDY, **kw)
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step()})
        assert outs[rid].prompt_token_ids == expected
        if out is not None:
            assert out.prompt_token_ids == expected
            assert out.token_ids == outs[rid].token_ids
    engine.check_resources()


def test_chat_streams_the_reply(chat_dir):
    engine = make_engine(chat_dir)
    outs = list(engine.chat(CONVERSATION, GREEDY))
    assert [o.finished for o in outs] == [False] * 11 + [True]
    assert "".join(o.new_text for o in outs) == outs[-1].text
    ids = reference_ids(chat_dir, CONVERSATION)
    assert outs[-1].prompt_token_ids == ids
    assert outs[-1].token_ids == engine.generate(ids, GREEDY, use_tqdm=False)[0].token_ids
    # a batch of conversations
    many = engine.generate([CONVERSATION, CONVERSATION[1:]], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in many] == [ids, reference_ids(chat_dir, CONVERSATION[1:])]
    engine.check_resources()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_next_turn_reuses_the_previous_turns_blocks(chat_dir):
    engine = make_engine(chat_dir)
    first = list(engine.chat(CONVERSATION, GREEDY))[-1]
    assert first.metrics.num_reused_tokens == 0
    turn2 = CONVERSATION + [{"role": "assistant", "content": first.text},
                            {"role": "user", "content": "And tomorrow?"}]
    second = list(engine.chat(turn2, GREEDY))[-1]
    # the KV the first turn left in the cache: its prompt and every generated token but the last
    # (whose KV was never computed); full blocks of the shared prefix are reused, and at least
    # one prompt token is always computed
    cached = first.prompt_token_ids + first.token_ids[:-1]
    shared = min(common_prefix(second.prompt_token_ids, cached), len(second.prompt_token_ids) - 1)
    assert shared >= len(first.prompt_token_ids) - 1  # the template re-renders turn 1 as it was
    assert second.metrics.num_reused_tokens == shared // TPB * TPB > 0
    # and the reply is what a cold engine gives
    fresh = Engine(chat_dir, max_seq_len=512,
                   kv_cache_config=KvCacheConfig(tokens_per_block=TPB, max_tokens=2048, enable_block_reuse=False),
                   scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=128))
    again = list(fresh.chat(turn2, GREEDY))[-1]
    assert again.metrics.num_reused_tokens == 0 and again.token_ids == second.token_ids


def test_a_tokenizer_without_a_chat_template(llama_dir):
    engine = make_engine(llama_dir)
    before = engine.stats()
    with pytest.raises(ValueError, match=f"the tokenizer in '{llama_dir}' has no chat template: pass chat_template="):
        engine.add_request(CONVERSATION, GREEDY)
    with pytest.raises(ValueError, match="has no chat template"):
        engine.chat(CONVERSATION, GREEDY)
    assert engine.stats() == before
    # an explicit template: per call, or for the engine
    out = list(engine.chat(CONVERSATION, GREEDY, chat_template=TEMPLATE))[-1]
    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    expected = list(tok.apply_chat_template(CONVERSATION, chat_template=TEMPLATE, tokenize=True,
                                            add_generation_prompt=True, return_dict=True)["input_ids"])
    assert out.prompt_token_ids == expected
    engine2 = make_engine(llama_dir, chat_template=TEMPLATE)
    assert engine2.generate(CONVERSATION, GREEDY, use_tqdm=False)[0].prompt_token_ids == expected
    engine.check_resources()


def test_bad_conversations_change_nothing(chat_dir):
    engine = make_engine(chat_dir)
    before = engine.stats()
    cases = [
        ([{"content": "hi"}], ValueError, r"messages\[0\] has no 'role'"),
        ([{"role": "user", "content": "hi"}, "hello"], TypeError, r"messages\[1\] must be a dict"),
        ([{"role": "user"}], ValueError, r"messages\[0\] \(role 'user'\) has no 'content'"),
    ]
    for messages, error, match in cases:
        with pytest.raises(error, match=match):
            engine.add_request(messages, GREEDY)
    with pytest.raises(ValueError, match="apply to a conversation"):
        engine.add_request("plain text", GREEDY, tools=TOOLS)
    with pytest.raises(TypeError, match="tools must be a list of dicts"):
        engine.add_request(CONVERSATION, GREEDY, tools="get_weather")
    with pytest.raises(ValueError, match="may not set 'add_generation_prompt'"):
        engine.add_request(CONVERSATION, GREEDY, chat_template_kwargs={"add_generation_prompt": False})
    with pytest.raises(ValueError, match="cannot render this conversation: .*roles must alternate"):
        engine.add_request(CONVERSATION, GREEDY, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TypeError, match="messages must be a non-empty list"):
        engine.chat([], GREEDY)
    assert engine.stats() == before
    # the engine goes on serving
    assert len(engine.generate(CONVERSATION, GREEDY, use_tqdm=False)[0].token_ids) == 12
    engine.check_resources()
