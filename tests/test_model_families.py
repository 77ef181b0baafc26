"""The families beyond Llama's -- Gemma 2, Gemma 3 (text), Phi-3 / Phi-4-mini (partial RoPE,
LongRoPE), SmolLM3 (layers without RoPE) -- and Qwen2 with a sliding window on some layers only:
greedy outputs equal transformers' token for token in fp32 (whole prompts, chunked prefill, prefix
reuse), stay within the tolerances of tests/test_correctness.py on the default fp32 path and in
bf16, and configs pyengine cannot run are named.

Tiny models (tests/conftest.py's checkpoint_factory), a sliding window of 16 tokens and a LongRoPE
switch point of 64, with prompts on both sides of each."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors import safe_open

from hf_reference import (FP32_NEAR_TIE, MAX_FLIP_FRACTION, NEAR_TIE_NOISES, fp32_first_divergence, hf_greedy, hf_model,
                          near_tie_check)
from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig, StartupError
from pyengine.layers.norm import gemma_rms_norm
from pyengine.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from pyengine.models.phi3 import Phi3Model
from pyengine.testing.checkpoints import longrope_scaling

WINDOW = 16
SWITCH = 64  # LongRoPE's original_max_position_embeddings
NEW_TOKENS = 16
# within and beyond the window; 50 and 64 cross the switch point while generating, 100 starts past it
PROMPT_LENGTHS = (5, 50, 64, 100)
MAX_SEQ_LEN = 160

VARIANTS = {
    # the window on layers 2 and 3 only (max_window_layers=2)
    "qwen2_window_top_layers": dict(model_type="qwen2", num_layers=4, sliding_window=WINDOW, max_window_layers=2),
    # hidden 48: sqrt(48) is no power of two (the normalizer's rounding); q size 64 != hidden
    "gemma2": dict(model_type="gemma2", hidden_size=48, head_dim=16, num_layers=2, sliding_window=WINDOW,
                   query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=5.0),
    "gemma3": dict(model_type="gemma3_text", head_dim=16, num_layers=2, sliding_window=WINDOW, query_pre_attn_scalar=24,
                   rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 4.0}, rope_local_theta=1e4,
                   final_logit_softcapping=5.0),
    # Phi-4-mini's shape of RoPE: 3/4 of each head, LongRoPE
    "phi3_longrope": dict(model_type="phi3", partial_rotary_factor=0.75, original_max_position_embeddings=SWITCH,
                          rope_scaling=longrope_scaling(12)),
    # Phi-3-mini-4k's: whole heads, one window for every layer (the one-call decode path runs it)
    "phi3_window": dict(model_type="phi3", sliding_window=32),
    # every second layer without RoPE, those with the window; q/k/v/o and MLP biases
    "smollm3": dict(model_type="smollm3", num_layers=4, no_rope_layer_interval=2, sliding_window=WINDOW,
                    attention_bias=True, mlp_bias=True),
}


def make_prompts(lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def make_engine(model_dir, *, dtype="float32", exact_fp32=True, max_num_tokens=512, tokens_per_block=8,
                reuse=False, max_batch_size=8) -> Engine:
    return Engine(model_dir, dtype=dtype, max_seq_len=MAX_SEQ_LEN, exact_fp32=exact_fp32,
                  kv_cache_config=KvCacheConfig(tokens_per_block=tokens_per_block, max_tokens=4096,
                                                enable_block_reuse=reuse),
                  scheduler_config=SchedulerConfig(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens))


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def generate(engine: Engine, prompts, params=GREEDY):
    return engine.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def family(checkpoint_factory):
    """variant -> (model dir, transformers' greedy continuations of make_prompts())."""
    cache = {}

    def get(variant: str):
        if variant not in cache:
            model_dir = checkpoint_factory(f"family_{variant}", **VARIANTS[variant])
            cache[variant] = (model_dir, [hf_greedy(model_dir, p, NEW_TOKENS) for p in make_prompts()])
        return cache[variant]

    return get


# ---- fp32: token for token ----

@pytest.mark.parametrize("chunked", [False, True], ids=["whole_prompts", "chunked_prefill"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_exact_fp32_greedy_equals_transformers(variant, chunked, family):
    """exact_fp32: every token equals transformers' generate(), for prompts shorter and longer than
    the window and on both sides of LongRoPE's switch point; chunked: prompts split in chunks of
    at most 16 tokens (a LongRoPE prompt longer than the switch point starts in short-factor
    chunks, recomputed once a chunk passes it)."""
    model_dir, expected = family(variant)
    engine = make_engine(model_dir, max_num_tokens=16 if chunked else 512)
    assert engine._runner.cpu_decode is None
    for prompt, r, ref in zip(make_prompts(), generate(engine, make_prompts()), expected):
        assert r.token_ids == ref, f"prompt of {len(prompt)} tokens diverges"


SYSTEM = make_prompts((40,), seed=7)[0]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_exact_fp32_with_prefix_reuse(variant, family):
    """Requests sharing a 40-token prefix (5 blocks) take its KV blocks from earlier requests, and
    their tokens still equal transformers'. LongRoPE: the blocks pass between the two sets of
    factors -- a 52-token prompt computes them short and recomputes them long when it grows past
    the switch point, an 80-token prompt reuses them as they are, a 43-token one recomputes them
    short; then a 46- and a 70-token prompt share them in one batch (two sub-batches per step,
    each after its own recompute)."""
    model_dir, _ = family(variant)
    longrope = "original_max_position_embeddings" in VARIANTS[variant]
    rng = random.Random(1)
    tail = [[rng.randrange(3, 512) for _ in range(n)] for n in ((12, 40, 3, 6, 30) if longrope else (12, 40, 3))]
    prompts = [SYSTEM + t for t in tail]
    expected = [hf_greedy(model_dir, p, NEW_TOKENS) for p in prompts]
    engine = make_engine(model_dir, reuse=True)
    outs = []
    for batch in ([prompts[0]], [prompts[1]], [prompts[2]], prompts[3:]) if longrope else ([prompts[0]], prompts[1:]):
        outs += generate(engine, batch)
    for p, o, ref in zip(prompts, outs, expected):
        assert o.token_ids == ref, f"prompt of {len(p)} tokens diverges"
    assert [o.metrics.num_reused_tokens for o in outs[1:3]] == [40, 40]
    assert engine.stats()["total_reused_tokens"] >= 40 * (len(prompts) - 1)


def test_longrope_recomputes_the_prefix_once_it_switches(family, monkeypatch):
    """The recompute is what makes a sequence crossing the switch point equal transformers' (whose
    generate() drops its cache there): without it, the tokens after the switch differ."""
    model_dir, expected = family("phi3_longrope")
    calls = []
    redo = Phi3Model._redo_prefixes

    def counting(self, seqs, prefix, want, meta, kv_caches, tpb):
        before = self._slot_phase.clone()
        redo(self, seqs, prefix, want, meta, kv_caches, tpb)
        calls.append(int((before != self._slot_phase).sum()))

    monkeypatch.setattr(Phi3Model, "_redo_prefixes", counting)
    prompts = make_prompts()
    crossing = [i for i, p in enumerate(prompts) if len(p) <= SWITCH < len(p) + NEW_TOKENS - 1]
    assert crossing
    outs = generate(make_engine(model_dir), [prompts[i] for i in crossing])
    assert [o.token_ids for o in outs] == [expected[i] for i in crossing]
    assert sum(calls) == SWITCH * len(crossing)  # each sequence's first 64 positions, once
    monkeypatch.setattr(Phi3Model, "_redo_prefixes", lambda *args: None)
    outs = generate(make_engine(model_dir), [prompts[i] for i in crossing])
    assert all(o.token_ids != expected[i] for o, i in zip(outs, crossing))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prompt_logprobs_equal_transformers(variant, family):
    """Logits, not only their argmax: prompt logprobs equal transformers' log-softmax (the final
    soft-capping, which never changes a greedy token, shows here)."""
    model_dir, _ = family(variant)
    prompt = make_prompts((70,), seed=3)[0]
    out = generate(make_engine(model_dir),
                   [prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3))[0]
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(str(model_dir))(torch.tensor([prompt])).logits[0].double(), -1)
    for i, d in enumerate(out.prompt_logprobs[1:], start=1):
        for token, logprob in d.items():
            assert abs(logprob - float(ref[i - 1, token])) < 1e-4, (i, token)
        assert set(ref[i - 1].topk(3).indices.tolist()) <= set(d)


# ---- the default fp32 path and bf16: within the tolerances of tests/test_correctness.py ----

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fp32_greedy_equals_transformers(variant, family):
    """The default fp32 path (pyengine's linear kernels for small batches; for phi3_window all layers
    in one C++ call): greedy tokens equal transformers' up to a near-tie (hf_reference.FP32_NEAR_TIE)."""
    model_dir, expected = family(variant)
    engine = make_engine(model_dir, exact_fp32=False)
    assert (engine._runner.cpu_decode is not None) == engine._runner.model.fused_cpu_decode_ok
    for prompt, r, ref in zip(make_prompts(), generate(engine, make_prompts()), expected):
        divergence = fp32_first_divergence(model_dir, prompt, r.token_ids, ref)
        assert divergence is None or divergence[1] <= FP32_NEAR_TIE, \
            f"prompt of {len(prompt)} tokens diverges at (index, gap) {divergence}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bf16_greedy_is_close_to_transformers(variant, family):
    """bf16: at every generated position the engine's token is transformers' fp32 argmax or a
    near-tie that bf16 rounding can flip (see test_correctness.test_bf16_greedy_is_close_to_transformers)."""
    model_dir, _ = family(variant)
    prompts = make_prompts()
    results = generate(make_engine(model_dir, dtype="bfloat16", exact_fp32=False), prompts)
    assert all(len(r.token_ids) == NEW_TOKENS for r in results)
    if "original_max_position_embeddings" in VARIANTS[variant]:
        beyond, flips, positions = longrope_near_tie_check(model_dir, prompts, [r.token_ids for r in results])
    else:
        beyond, flips, positions = near_tie_check(model_dir, prompts, [r.token_ids for r in results])
    assert beyond == [], f"(prompt length, position, gap, noise) beyond a bf16 near-tie: {beyond}"
    assert flips <= MAX_FLIP_FRACTION * positions, f"{flips} of {positions} tokens are not the fp32 argmax"


def longrope_near_tie_check(model_dir, prompts, outputs):
    """hf_reference.near_tie_check for LongRoPE, whose logits depend on the forward's length: the tokens
    generate() produced at a length up to the switch point are scored by a forward that stops there
    (short factors), the others by one over the whole sequence (long factors)."""
    beyond, flips, positions = [], 0, 0
    for p, generated in zip(prompts, outputs):
        n_short = min(max(SWITCH - len(p) + 1, 0), len(generated))  # token j comes from length len(p) + j
        gaps, noise = [], []
        for start, stop in ((0, n_short), (n_short, len(generated))):
            if start < stop:
                ids = torch.tensor([p + generated[: stop - 1]])
                rows = slice(len(p) - 1 + start, len(p) - 1 + stop)
                with torch.inference_mode():
                    ref = hf_model(str(model_dir))(ids).logits[0, rows].double()
                    noisy = hf_model(str(model_dir), torch.bfloat16)(ids).logits[0, rows].double()
                scale = ref.abs().amax(dim=-1)
                chosen = ref.gather(-1, torch.tensor(generated[start:stop])[:, None])[:, 0]
                gaps += ((ref.amax(dim=-1) - chosen) / scale).tolist()
                noise += ((noisy - ref).abs().amax(dim=-1) / scale).tolist()
        beyond += [(len(p), i, round(g, 4), round(n, 4)) for i, (g, n) in enumerate(zip(gaps, noise))
                   if g > NEAR_TIE_NOISES * n]
        flips += sum(g > 0 for g in gaps)
        positions += len(gaps)
    return beyond, flips, positions


# ---- what the model exposes ----

def _model(engine):
    return engine._runner.model


@pytest.mark.parametrize("variant,windows,rope,softcap,one_call", [
    ("qwen2_window_top_layers", [0, 0, WINDOW, WINDOW], [True] * 4, 0.0, True),
    ("gemma2", [WINDOW, 0], [True] * 2, 5.0, False),
    ("gemma3", [WINDOW, 0], [True] * 2, 0.0, False),
    ("phi3_longrope", [0, 0], [True] * 2, 0.0, False),
    ("phi3_window", [32, 32], [True] * 2, 0.0, True),
    ("smollm3", [0, WINDOW, 0, WINDOW], [True, False, True, False], 0.0, False),  # (o_proj and MLP biases)
])
def test_per_layer_attributes(variant, windows, rope, softcap, one_call, checkpoint_factory):
    model_dir = checkpoint_factory(f"family_{variant}", **VARIANTS[variant])
    model = _model(make_engine(model_dir, exact_fp32=False))
    assert model.layer_sliding_windows == windows
    assert model.layer_uses_rope == rope
    assert model.attn_softcap == softcap
    assert model.fused_cpu_decode_ok == one_call


def test_gemma_embedding_and_norm_round_as_transformers(checkpoint_factory):
    """bf16: the embedding's normalizer is cast to bf16 first (sqrt(48) = 6.928 -> 6.9375) and the
    product rounded once; the norm scales by (1 + w) in fp32 and rounds once -- bit for bit."""
    model_dir = checkpoint_factory("family_gemma2", **VARIANTS["gemma2"])
    model = _model(make_engine(model_dir, dtype="bfloat16", exact_fp32=False))
    hf = hf_model(str(model_dir), torch.bfloat16)
    ids = torch.arange(3, 40)
    with torch.inference_mode():
        ours = model.embed_tokens(ids.to(torch.int32))
        theirs = hf.model.embed_tokens(ids[None])[0]
        assert float(model.normalizer) == 6.9375
        assert torch.equal(ours, theirs)
        x = torch.randn(7, 48).to(torch.bfloat16)
        norm = hf.model.layers[0].pre_feedforward_layernorm
        assert torch.equal(gemma_rms_norm(x, model.layers[0]["pre_ff_norm"], model.config.rms_norm_eps), norm(x))


@pytest.mark.parametrize("variant", ["gemma2", "gemma3", "phi3_longrope", "smollm3"])
def test_every_norm_weight_is_perturbed(variant, checkpoint_factory):
    """The builder perturbs every norm (Gemma's four per layer, q/k norms, the final one): a loader
    that ignores one cannot match transformers by accident."""
    model_dir = checkpoint_factory(f"family_{variant}", **VARIANTS[variant])
    init = 0.0 if variant.startswith("gemma") else 1.0
    names = []
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if "norm" in name:
                names.append(name)
                assert not torch.all(f.get_tensor(name) == init), name
    per_layer = {"gemma2": 4, "gemma3": 6, "phi3_longrope": 2, "smollm3": 2}[variant]
    assert len(names) == per_layer * VARIANTS[variant].get("num_layers", 2) + 1


# ---- configs ----

def _config(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def _edited(model_dir, tmp_path, change) -> object:
    bad = tmp_path / "model"
    shutil.copytree(model_dir, bad)
    cfg = _config(bad)
    change(cfg)
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


CONFIG_ERRORS = {
    "phi3 llama3 rope": ("phi3_longrope", lambda c: c["rope_parameters"].update(rope_type="llama3"),
                         "unsupported rope_type 'llama3' for phi3; supported: 'default', 'longrope'"),
    "phi3 longrope factors": ("phi3_longrope", lambda c: c["rope_parameters"].update(short_factor=[1.0] * 8),
                              "rope_parameters' short_factor has 8 entries, expected 6 (half the rotary dimensions)"),
    "gemma3 yarn rope": ("gemma3", lambda c: c["rope_parameters"]["full_attention"].update(rope_type="yarn"),
                         "unsupported rope_type 'yarn' for gemma3_text; supported: 'default', 'linear', 'llama3'"),
    "gemma3 flat rope": ("gemma3", lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 1.0}),
                         "rope_parameters of gemma3_text are given per layer type"),
    "qwen2 longrope": ("qwen2_window_top_layers", lambda c: c["rope_parameters"].update(rope_type="longrope"),
                       "unsupported rope_type 'longrope' for qwen2; supported: 'default', 'linear', 'llama3'"),
    "smollm3 partial rotary": ("smollm3", lambda c: c.update(partial_rotary_factor=0.5),
                               "unsupported partial_rotary_factor 0.5 for smollm3 (only phi3 rotates part of "
                               "each head)"),
    "gemma2 activation": ("gemma2", lambda c: c.update(hidden_activation="gelu"),
                          "unsupported hidden_act 'gelu' for gemma2; supported: 'gelu_pytorch_tanh'"),
    "gemma3 bidirectional": ("gemma3", lambda c: c.update(use_bidirectional_attention=True),
                             "use_bidirectional_attention=True (gemma3_text): pyengine runs causal decoders only"),
    "layer type": ("qwen2_window_top_layers", lambda c: c["layer_types"].__setitem__(0, "linear_attention"),
                   "unsupported layer type 'linear_attention' in layer_types; supported: 'sliding_attention', "
                   "'full_attention'"),
    "layer count": ("gemma2", lambda c: c["layer_types"].append("full_attention"),
                    "layer_types has 3 entries for 2 layers"),
    "llama3 without its factors": ("smollm3", lambda c: c.update(rope_parameters={"rope_type": "llama3",
                                                                                  "rope_theta": 1e4}),
                                   "rope_type 'llama3' needs 'factor', 'low_freq_factor', 'high_freq_factor'"),
}


@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_config_errors_name_the_problem(case, tmp_path, checkpoint_factory):
    variant, change, message = CONFIG_ERRORS[case]
    bad = _edited(checkpoint_factory(f"family_{variant}", **VARIANTS[variant]), tmp_path, change)
    with pytest.raises(ValueError) as info:
        ModelConfig.from_model_dir(bad)
    assert message in str(info.value)
    with pytest.raises(StartupError, match="phase 'config'") as info:
        Engine(bad)
    assert message in str(info.value)


def test_unknown_model_type_lists_every_family():
    with pytest.raises(ValueError) as info:
        ModelConfig.from_dict({"model_type": "gpt2"})
    assert str(info.value) == ("unsupported model_type 'gpt2'; supported: llama, mistral, qwen2, qwen3, gemma2, "
                               "gemma3_text, gemma3, phi3, smollm3")
    assert set(SUPPORTED_MODEL_TYPES) >= {"gemma2", "gemma3_text", "gemma3", "phi3", "smollm3"}


def test_layer_types_are_derived_as_transformers_does():
    """Without layer_types (configs older than transformers 5), each family's own rule."""
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=2)
    qwen = ModelConfig.from_dict({**base, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
                                  "max_window_layers": 4})
    assert qwen.layer_sliding_windows == [0, 0, 0, 0, 8, 8]
    off = ModelConfig.from_dict({**base, "model_type": "qwen2", "use_sliding_window": False, "sliding_window": 8})
    assert off.layer_sliding_windows == [0] * 6 and off.sliding_window is None
    gemma2 = ModelConfig.from_dict({**base, "model_type": "gemma2", "sliding_window": 8})
    assert gemma2.layer_sliding_windows == [8, 0] * 3
    gemma3 = ModelConfig.from_dict({**base, "model_type": "gemma3_text", "sliding_window": 8,
                                    "sliding_window_pattern": 3})
    assert gemma3.layer_sliding_windows == [8, 8, 0] * 2
    smol = ModelConfig.from_dict({**base, "model_type": "smollm3", "use_sliding_window": True, "sliding_window": 8,
                                  "no_rope_layer_interval": 3})
    assert smol.layer_uses_rope == [True, True, False] * 2
    assert smol.layer_sliding_windows == [0, 0, 8] * 2
    mistral = ModelConfig.from_dict({**base, "model_type": "mistral", "sliding_window": 8})
    assert mistral.layer_sliding_windows == [8] * 6 and mistral.sliding_layers is None


def test_gemma3_multimodal_checkpoint_runs_its_text_model(checkpoint_factory):
    """A "gemma3" checkpoint (Gemma3ForConditionalGeneration, as transformers saves it: the text model
    under language_model.model.*, a vision tower pyengine does not load): its text generation equals
    transformers' token for token."""
    model_dir = checkpoint_factory("family_gemma3_multimodal", model_type="gemma3", **{
        k: v for k, v in VARIANTS["gemma3"].items() if k != "model_type"})
    assert ModelConfig.from_model_dir(model_dir).weight_prefix == "language_model.model."
    prompts = make_prompts((5, 30))
    outs = generate(make_engine(model_dir), prompts)
    assert [o.token_ids for o in outs] == [hf_greedy(model_dir, p, NEW_TOKENS) for p in prompts]


def test_gemma3_defaults_and_multimodal_config():
    """A multimodal "gemma3" config runs its text_config, which (as published) leaves most fields
    to Gemma3TextConfig's defaults; the RoPEs come from rope_theta / rope_local_base_freq /
    rope_scaling (linear), the window pattern from sliding_window_pattern."""
    d = {"model_type": "gemma3", "eos_token_id": [1, 106], "text_config": {
        "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}}
    c = ModelConfig.from_dict(d)
    assert (c.model_type, c.vocab_size, c.num_heads, c.num_kv_heads, c.head_dim) == ("gemma3", 262208, 8, 4, 256)
    assert (c.query_pre_attn_scalar, c.tie_word_embeddings, c.eos_token_ids) == (256.0, True, [1, 106])
    assert (c.rope_theta, c.rope_scaling["rope_type"], c.rope_scaling["factor"]) == (1e6, "linear", 8.0)
    assert (c.sliding_rope_theta, c.sliding_rope_scaling) == (1e4, None)
    assert c.layer_sliding_windows[:6] == [1024] * 5 + [0] and c.qk_norm
    assert c.weight_prefix == "model.language_model."
    assert c.attn_logit_softcapping is None and c.final_logit_softcapping is None


def test_phi3_config_as_published():
    """Phi-4-mini's fields: rope_scaling of type "longrope" (older: "su"), partial_rotary_factor at the
    top level, original_max_position_embeddings beside it (it overrides rope_scaling's)."""
    d = dict(model_type="phi3", vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
             num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=131072,
             original_max_position_embeddings=4096, partial_rotary_factor=0.75, rope_theta=10000.0,
             sliding_window=262144, tie_word_embeddings=True,
             rope_scaling={"type": "su", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48,
                           "original_max_position_embeddings": 1})
    c = ModelConfig.from_dict(d)
    assert (c.head_dim, c.rotary_dim, c.partial_rotary_factor) == (128, 96, 0.75)
    assert c.rope_scaling["rope_type"] == "longrope"
    assert c.rope_scaling["original_max_position_embeddings"] == 4096
    assert c.layer_sliding_windows == [262144] * 32
