"""Tests of pyengine.testing.checkpoints: tiny real checkpoints built offline."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

try:
    import pyengine.testing.checkpoints as ck
except ImportError:
    # The package's __init__ needs the compiled extension; this module does not, so test
    # the file on its own.
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "_pyengine_checkpoints_standalone",
        Path(__file__).resolve().parents[1] / "pyengine" / "checkpoints.py",
    )
    ck = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = ck
    _spec.loader.exec_module(ck)

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

transformers.utils.logging.set_verbosity_error()


def _load(path: Path, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """One default checkpoint per model type, built once for the module."""
    root = tmp_path_factory.mktemp("ckpts")
    return {mt: ck.build_tiny_checkpoint(root / mt, mt) for mt in ck.MODEL_TYPES}


EXPECTED_CLASS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
}

DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
EXPECTED_ROPE = {
    "gemma3_text": {"full_attention": DEFAULT_ROPE, "sliding_attention": DEFAULT_ROPE},  # one per layer type
    "phi3": {**DEFAULT_ROPE, "partial_rotary_factor": 1.0},
}


@pytest.mark.parametrize("model_type", ck.MODEL_TYPES)
def test_builds_and_reloads(built, model_type):
    path = built[model_type]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == model_type
    assert cfg["architectures"] == [EXPECTED_CLASS[model_type]]
    assert cfg["hidden_size"] == 64 and cfg["num_hidden_layers"] == 2
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2
    assert cfg["vocab_size"] == 512 and cfg["dtype"] == "float32"
    assert cfg["initializer_range"] == ck.DEFAULT_INITIALIZER_RANGE
    assert cfg["rope_parameters"] == EXPECTED_ROPE.get(model_type, DEFAULT_ROPE)
    gemma = model_type.startswith("gemma")
    if gemma:  # sliding and full layers alternate, the window 32 tokens
        assert cfg["sliding_window"] == 32 and cfg["layer_types"] == ["sliding_attention", "full_attention"]
        assert cfg["query_pre_attn_scalar"] == 16
    else:
        assert cfg.get("sliding_window") is None
    if model_type in ("qwen2", "qwen3", "smollm3"):
        assert cfg["use_sliding_window"] is False
        assert set(cfg["layer_types"]) == {"full_attention"}
    if model_type in ("qwen3", "gemma2", "gemma3_text"):
        assert cfg["head_dim"] == 16  # not Qwen3Config's default of 128 (Gemma's 256)
    assert (path / "model.safetensors").is_file()
    assert not (path / "model.safetensors.index.json").exists()

    model = _load(path)
    assert type(model).__name__ == EXPECTED_CLASS[model_type]
    # The reloaded weights are the saved ones, bit for bit, and all of them were used.
    saved = _tensors(path)
    state = model.state_dict()
    for name, t in saved.items():
        assert torch.equal(state[name], t), name
    assert set(saved) == {k for k in state if not k.endswith("inv_freq")}

    # Norm weights and biases were perturbed away from 1 / 0, so a loader must read them.
    norms = [k for k in saved if k.endswith("norm.weight")]
    init = 0 if gemma else 1  # Gemma's norms scale by 1 + w
    assert norms and all(not torch.all(saved[k] == init) for k in norms)
    if model_type in ("qwen3", "gemma3_text"):
        assert any("q_norm" in k for k in norms) and any("k_norm" in k for k in norms)
    biases = [k for k in saved if k.endswith(".bias")]
    if model_type == "qwen2":
        assert {k.split(".")[-2] for k in biases} == {"q_proj", "k_proj", "v_proj"}
        assert all(saved[k].abs().sum() > 0 for k in biases)
    else:
        assert biases == []

    # It runs, and greedy logits have a clear winner (see the module's margin notes).
    ids = torch.randint(4, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.5


def test_build_is_deterministic(built, tmp_path):
    again = ck.build_tiny_checkpoint(tmp_path / "again", "qwen3")
    assert ck.checkpoint_digest(again) == ck.checkpoint_digest(built["qwen3"])
    other = ck.build_tiny_checkpoint(tmp_path / "other", "qwen3", seed=1, with_tokenizer=False)
    a, b = _tensors(built["qwen3"]), _tensors(other)
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


def test_sharded(built, tmp_path):
    path = ck.build_tiny_checkpoint(tmp_path / "sharded", "llama", sharded=True)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(path.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2
    assert not (path / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    whole = _tensors(built["llama"])
    assert set(index["weight_map"]) == set(whole)
    parts = _tensors(path)
    assert set(parts) == set(whole)
    assert all(torch.equal(parts[k], whole[k]) for k in whole)
    model = _load(path)
    assert torch.equal(model.lm_head.weight, whole["lm_head.weight"])


TEXTS = [
    "Hello, world!",
    "The lighthouse keeper wrote in his log every evening.",
    "  leading and trailing spaces, tabs\tand\nnewlines  ",
    "今天天气很好，我们去公园散步吧。",
    "Emoji 🤖🚀🌍 and ZWJ 👩‍👩‍👧 and flags 🇫🇷",
    "Ελληνικά, Привет, naïve café,日本語のテキスト, 한국어",
    "",
]


def test_tokenizer_roundtrip(built):
    tok = transformers.AutoTokenizer.from_pretrained(str(built["llama"]))
    assert len(tok) == 512
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 3)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id
        assert ids.count(tok.bos_token_id) == 1 and tok.unk_token_id not in ids
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    # Merges really compress the training language, and exist across multi-byte chars.
    english = "The work is simple to describe and easy to get subtly wrong."
    assert len(tok.encode(english, add_special_tokens=False)) < 0.7 * len(english.encode())
    multibyte_merges = [
        t for t in tok.get_vocab() if len(t) >= 2 and all(ord(c) >= 0xA1 for c in t)
    ]
    assert multibyte_merges
    # Left padding, pad id 3: usable directly for batched reference runs.
    batch = tok(["a", "a longer text"], padding=True)
    assert batch["input_ids"][0][0] == tok.pad_token_id and batch["attention_mask"][0][0] == 0


def test_tokenizer_is_deterministic_and_sized(tmp_path):
    a = ck.build_tokenizer(tmp_path / "a")
    b = ck.build_tokenizer(tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_text()
    assert a.get_vocab() == b.get_vocab()
    small = ck.build_tokenizer(None, vocab_size=300)
    assert len(small) == 300
    assert small.decode(small.encode(TEXTS[4]), skip_special_tokens=True) == TEXTS[4]
    with pytest.raises(ValueError, match="vocab_size=100"):
        ck.build_tokenizer(None, vocab_size=100)


def test_config_token_ids_match_tokenizer(built):
    for path in built.values():
        cfg = json.loads((path / "config.json").read_text())
        gen = json.loads((path / "generation_config.json").read_text())
        tok = transformers.AutoTokenizer.from_pretrained(str(path))
        assert cfg["bos_token_id"] == gen["bos_token_id"] == tok.bos_token_id
        assert cfg["eos_token_id"] == gen["eos_token_id"] == tok.eos_token_id


def test_tied_embeddings(built, tmp_path):
    path = ck.build_tiny_checkpoint(tmp_path / "tied", "llama", tie_word_embeddings=True)
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True
    saved = _tensors(path)
    assert "lm_head.weight" not in saved and "model.embed_tokens.weight" in saved
    model = _load(path)
    emb = model.get_input_embeddings().weight
    assert model.lm_head.weight.data_ptr() == emb.data_ptr()
    assert torch.equal(emb, saved["model.embed_tokens.weight"])
    # Untied: a separate, different head is saved.
    untied = _tensors(built["llama"])
    assert not torch.equal(untied["lm_head.weight"], untied["model.embed_tokens.weight"])


def test_llama3_rope_scaling(tmp_path):
    scaling = ck.llama3_rope_scaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=256
    )
    path = ck.build_tiny_checkpoint(
        tmp_path / "l3", "llama", rope_scaling=scaling, rope_theta=500000.0, with_tokenizer=False
    )
    rp = json.loads((path / "config.json").read_text())["rope_parameters"]
    assert rp == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
        "rope_theta": 500000.0,
    }
    cfg = transformers.AutoConfig.from_pretrained(str(path))
    assert cfg.rope_parameters["rope_type"] == "llama3"
    model = _load(path)
    default = ck.build_config("llama", rope_theta=500000.0)
    ref = transformers.LlamaForCausalLM(default).model.rotary_emb.inv_freq
    scaled = model.model.rotary_emb.inv_freq
    # High frequencies are kept, the lowest are divided by the factor.
    assert torch.allclose(scaled[0], ref[0])
    assert torch.allclose(scaled[-1], ref[-1] / 8.0)
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        ck.build_config(
            "llama", rope_scaling=ck.llama3_rope_scaling(original_max_position_embeddings=4096)
        )


def test_bad_arguments():
    with pytest.raises(ValueError, match="'gpt2'"):
        ck.build_config("gpt2")
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        ck.build_config("llama", num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="head_dim=32"):
        ck.build_config("qwen2", head_dim=32)
    assert ck.build_config("llama", head_dim=32).head_dim == 32


def test_bfloat16_checkpoint(tmp_path):
    path = ck.build_tiny_checkpoint(tmp_path / "bf16", "qwen2", dtype="bfloat16", with_tokenizer=False)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in _tensors(path).values())


def test_smollm_shape_parameter_count():
    kwargs = {k: v for k, v in ck.SMOLLM_135M_SHAPE.items() if k not in ("seed", "perturb_norms_and_biases")}
    cfg = ck.build_config(**kwargs)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (32000, 576, 1536)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 2048
    assert cfg.initializer_range == 0.02
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert round(n / 1e6, 1) == 124.6


def test_cached_checkpoint(tmp_path, monkeypatch):
    calls = []
    real = ck.build_tiny_checkpoint

    def counting(path, **kw):
        calls.append(kw)
        return real(path, **kw)

    monkeypatch.setattr(ck, "build_tiny_checkpoint", counting)
    kwargs = dict(model_type="llama", num_layers=1, with_tokenizer=False)
    p1 = ck.cached_checkpoint("t", kwargs, root=tmp_path)
    assert p1 == tmp_path / "t" and (p1 / "config.json").is_file()
    p2 = ck.cached_checkpoint("t", dict(kwargs), root=tmp_path)
    assert p2 == p1 and len(calls) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["t"]  # no temp dirs left behind

    # Other arguments under the same name: rebuilt in place.
    p3 = ck.cached_checkpoint("t", dict(kwargs, num_layers=2), root=tmp_path)
    assert p3 == p1 and len(calls) == 2
    assert json.loads((p3 / "config.json").read_text())["num_hidden_layers"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["t"]

    # A half-written checkpoint (no stamp) is never reused.
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text("{}")
    p4 = ck.cached_checkpoint("half", kwargs, root=tmp_path)
    assert len(calls) == 3 and json.loads((p4 / "config.json").read_text())["model_type"] == "llama"

    # A failing build leaves nothing behind.
    with pytest.raises(ValueError):
        ck.cached_checkpoint("bad", dict(kwargs, model_type="gpt2"), root=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["half", "t"]

    monkeypatch.setenv("PYENGINE_CHECKPOINT_CACHE", str(tmp_path / "env"))
    assert ck.default_cache_root() == tmp_path / "env"


def test_cached_checkpoint_with_another_builder(tmp_path):
    """A builder other than build_tiny_checkpoint is named in the stamp: its checkpoint is
    reused by the same builder only, and a name built by another is rebuilt."""
    built = []

    def one_layer(path, **kw):
        built.append(kw)
        return ck.build_tiny_checkpoint(path, model_type="llama", num_layers=1, with_tokenizer=False, **kw)

    kwargs = dict(model_type="llama", num_layers=2, with_tokenizer=False)
    assert ck.cached_checkpoint("t", kwargs, root=tmp_path) == tmp_path / "t"
    p = ck.cached_checkpoint("t", root=tmp_path, builder=one_layer)
    assert len(built) == 1 and json.loads((p / "config.json").read_text())["num_hidden_layers"] == 1
    stamp = json.loads((p / ck._STAMP).read_text())
    assert stamp["builder"].endswith("test_cached_checkpoint_with_another_builder.<locals>.one_layer")
    assert ck.cached_checkpoint("t", root=tmp_path, builder=one_layer) == p and len(built) == 1
    assert ck.is_cached("t", root=tmp_path, builder=one_layer) and not ck.is_cached("t", root=tmp_path)
    assert not ck.is_cached("t", kwargs, root=tmp_path)
