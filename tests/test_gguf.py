"""Engine("model.gguf"): GGUF files written from the tiny checkpoints the way llama.cpp's
converter writes them (pyengine/testing/gguf_export.py) load to the same config, tokenizer and
weights as the checkpoint itself -- the same greedy tokens, float and quantized -- and damaged or
unsupported files fail start-up in the right phase, naming the tensor or value."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

gguf = pytest.importorskip("gguf")

from gguf_blocks import assert_file_holds_quantize_on_load_blocks  # noqa: E402
from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig, StartupError  # noqa: E402
from pyengine.gguf import load_tokenizer, load_weights, model_config, read_header  # noqa: E402
from pyengine.gguf.weights import unpermute_rows  # noqa: E402
from pyengine.layers.rotary import rope_inv_freq  # noqa: E402
from pyengine.models import LlamaFamilyModel, ModelConfig  # noqa: E402
from pyengine.models.loader import load_tensors  # noqa: E402
from pyengine.quant import QuantizedWeight  # noqa: E402
from pyengine.testing.checkpoints import CORPUS, llama3_rope_scaling  # noqa: E402
from pyengine.testing.gguf_export import export_gguf, permute_qk  # noqa: E402

# K-quants need rows of 256: hidden 256, intermediate 512.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, num_layers=2)
PROMPTS: list[Any] = [[5, 9, 44, 71, 100, 3, 8], list(range(10, 70)), "The lighthouse keeper wrote"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SUPPORTED = "F32, F16, BF16, Q8_0, Q5_0, Q5_1, Q4_0, Q4_K, Q5_K, Q6_K"


def make_engine(model: Path, **kw: Any) -> Engine:
    return Engine(model, max_seq_len=kw.pop("max_seq_len", 256),
                  kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=1024, free_memory_fraction=None),
                  scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=128), **kw)


def greedy(model: Path, prompts: list[Any] = PROMPTS, params: SamplingParams = GREEDY, **kw: Any) -> list[Any]:
    with make_engine(model, **kw) as engine:
        return [(o.prompt_token_ids, o.token_ids, o.text) for o in engine.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def ckpt(checkpoint_factory):
    """The tiny checkpoints: llama (GQA), qwen2 (q/k/v biases), qwen3 (q/k norms, tied embeddings);
    llama_ffn640: down_proj's rows of 640 do not hold Q4_K's blocks of 256 (Q5_0 instead)."""
    return {
        "llama": checkpoint_factory("gguf_llama", model_type="llama", **SHAPE),
        "llama_ffn640": checkpoint_factory("gguf_llama_ffn640", model_type="llama", **{**SHAPE,
                                                                                      "intermediate_size": 640}),
        "qwen2": checkpoint_factory("gguf_qwen2", model_type="qwen2", **SHAPE),
        "qwen3": checkpoint_factory("gguf_qwen3", model_type="qwen3", tie_word_embeddings=True, **SHAPE),
    }


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """gguf_file(model_dir, outtype, **export kwargs) -> a GGUF file, written once per module."""
    root = tmp_path_factory.mktemp("gguf")
    made: dict[str, Path] = {}

    def make(model_dir: Path, outtype: str = "f32", **kw: Any) -> Path:
        key = f"{model_dir.parent.name}-{outtype}-{sorted(kw.items())}"
        if key not in made:
            made[key] = export_gguf(model_dir, root / f"{len(made)}-{outtype}.gguf", outtype, **kw)
        return made[key]

    return make


def startup_error(model: Path, phase: str, **kw: Any) -> str:
    with pytest.raises(StartupError) as info:
        make_engine(model, **kw)
    assert info.value.phase == phase, str(info.value)
    return str(info.value)


def rewrite(src: Path, dst: Path, set_keys: dict[str, tuple[Any, Any]] | None = None,
            drop_keys: tuple[str, ...] = ()) -> Path:
    """A copy of the GGUF file `src` with metadata keys set (key -> (value, GGUFValueType)) or dropped."""
    set_keys = dict(set_keys or {})
    reader = gguf.GGUFReader(str(src))
    arch = set_keys.pop("general.architecture", (reader.fields["general.architecture"].contents(),))[0]
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys or key in set_keys:
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for key, (value, vtype) in set_keys.items():
        writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file(path=str(dst))
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def mapped(path: Path) -> bool:
    """Whether this process still maps the file."""
    with open("/proc/self/maps") as f:
        return any(str(path) in line for line in f)


# ---- (a) float files: the same greedy tokens as the checkpoint -----------------------------------

@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_f32_gguf_gives_the_checkpoints_tokens(ckpt, gguf_file, model_type):
    path = gguf_file(ckpt[model_type], "f32")
    assert greedy(path, exact_fp32=True) == greedy(ckpt[model_type], exact_fp32=True)


@pytest.mark.parametrize("dtype,outtype", [("float16", "f16"), ("bfloat16", "bf16")])
def test_half_gguf_gives_the_checkpoints_tokens(checkpoint_factory, gguf_file, dtype, outtype):
    """F16 / BF16 tensors read as the checkpoint's own half values, computed in float32."""
    model_dir = checkpoint_factory(f"gguf_llama_{dtype}", model_type="llama", dtype=dtype)
    path = gguf_file(model_dir, outtype)
    assert {t.type_name for t in read_header(path).tensors.values()} == {outtype.upper(), "F32"}
    assert greedy(path) == greedy(model_dir)


def test_llama3_rope_scaling_from_rope_freqs(checkpoint_factory, gguf_file):
    """Llama 3.1's RoPE scaling travels as the rope_freqs.weight tensor: the same frequencies up to
    float rounding, the same tokens past original_max_position_embeddings."""
    model_dir = checkpoint_factory("gguf_llama3_rope", model_type="llama", rope_theta=500000.0,
                                   rope_scaling=llama3_rope_scaling(original_max_position_embeddings=32))
    path = gguf_file(model_dir)
    hf, ours = ModelConfig.from_model_dir(model_dir), ModelConfig.from_model_dir(path)
    assert ours.rope_scaling["rope_type"] == "llama3" and len(ours.rope_scaling["freq_factors"]) == hf.head_dim // 2
    assert ours.rope_scaling["freq_factors"][0] == 1.0 and ours.rope_scaling["freq_factors"][-1] == 8.0
    torch.testing.assert_close(rope_inv_freq(ours), rope_inv_freq(hf), rtol=1e-6, atol=0)
    assert {**vars(ours), "rope_scaling": None} == {**vars(hf), "rope_scaling": None}
    prompts = [list(range(10, 90)), [7, 8, 9] * 20]
    assert greedy(path, prompts) == greedy(model_dir, prompts)


def test_unpermute_undoes_the_converters_permutation():
    # (rows, n_head, n_head_kv): q of 4 heads, k of 2 heads (GQA), odd head counts; 1-D (biases)
    for rows, n_head, n_kv, cols in [(256, 4, 4, (3,)), (128, 4, 2, (3,)), (12, 3, 3, (5,)), (128, 4, 2, ())]:
        w = torch.arange(rows * (cols[0] if cols else 1), dtype=torch.float32).reshape(rows, *cols)
        permuted = permute_qk(w, n_head, n_kv)
        assert not torch.equal(permuted, w)
        assert torch.equal(permuted[unpermute_rows(rows, rows // n_kv)], w)


# ---- (b) quantized files: the blocks and tokens of quantize-on-load ------------------------------

@pytest.mark.parametrize("model_type,fmt,formats", [
    ("llama", "q8_0", {"q8_0"}),
    ("llama", "q4_0", {"q4_0", "q6_k"}),            # the output projection takes Q6_K
    ("llama", "q4_k", {"q4_k", "q6_k"}),
    ("qwen3", "q4_k", {"q4_k", "q6_k"}),            # tied: the embedding table is the output, Q6_K
    ("llama_ffn640", "q4_k", {"q4_k", "q5_0", "q6_k"}),  # llama.cpp's fallback for rows of 640
    ("llama_ffn640", "q5_k", {"q5_k", "q5_1", "q6_k"}),  # Q5_K's: Q5_1
])
def test_quantized_gguf_holds_the_blocks_of_quantize_on_load(ckpt, gguf_file, model_type, fmt, formats):
    """Every tensor loads byte for byte as Engine(hf_dir, quantization=fmt) quantizes it (llama's
    q/k rows un-permuted inside their blocks), and the greedy tokens are the same."""
    model_dir = ckpt[model_type]
    path = gguf_file(model_dir, fmt)
    seen = assert_file_holds_quantize_on_load_blocks(path, model_dir, fmt)
    assert seen == formats
    assert greedy(path) == greedy(model_dir, quantization=fmt)


def test_startup_report_names_the_files_formats(ckpt, gguf_file):
    """startup_report()["weights"] of a GGUF file: its source, and the same bytes by format and
    output projection as the checkpoint quantized at load (the file holds the same blocks)."""
    path = gguf_file(ckpt["qwen3"], "q4_k")
    with make_engine(path) as engine:
        weights = engine.startup_report()["weights"]
    with make_engine(ckpt["qwen3"], quantization="q4_k") as engine:
        on_load = engine.startup_report()["weights"]
    assert weights["source"] == "gguf" and on_load["source"] == "quantized at load"
    assert weights["plan"] is None and on_load["plan"]["model.embed_tokens.weight"] == "q6_k"
    assert weights["output_projection"] == on_load["output_projection"] == "q6_k"
    assert weights["bytes_by_format"] == on_load["bytes_by_format"]
    assert set(weights["bytes_by_format"]) == {"q4_k", "q6_k", "float32"}


def test_fused_group_of_mixed_types_is_dequantized(ckpt, gguf_file):
    """q, k and v are fused into one matrix: where the file has v in F32 and q, k in Q8_0 (as
    llama-quantize leaves rows that fit no block format), q and k are dequantized, exactly."""
    model_dir = ckpt["llama"]
    path = gguf_file(model_dir, "q8_0", tensor_types={"blk.0.attn_v.weight": "F32"})
    header = read_header(path)
    config = model_config(header)
    names, optional = LlamaFamilyModel.weight_names(config)
    ours = load_weights(header, config, names, torch.float32, optional)
    hf = load_tensors(model_dir, names, torch.float32, optional)
    p0, p1 = "model.layers.0.self_attn.", "model.layers.1.self_attn."
    for x in "qk":
        assert torch.equal(ours[p0 + f"{x}_proj.weight"],
                           QuantizedWeight.quantize(hf[p0 + f"{x}_proj.weight"], "q8_0").dequantize())
    assert torch.equal(ours[p0 + "v_proj.weight"], hf[p0 + "v_proj.weight"])
    assert all(isinstance(ours[p1 + f"{x}_proj.weight"], QuantizedWeight) for x in "qkv")
    with make_engine(path) as engine:  # linears partly float: no one-call decode, the layers one by one
        assert engine._runner.model.partly_quantized and engine._runner.cpu_decode is None
        outs = engine.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [GREEDY.max_tokens] * len(PROMPTS)


@pytest.mark.parametrize("model_type,outtype", [("qwen2", "q8_0"), ("llama", "q4_k")])
def test_header_is_what_gguf_reader_reads(ckpt, gguf_file, model_type, outtype):
    """read_header's shortcuts (tensor table without data views; long arrays in one part or
    skipped) give what gguf.GGUFReader itself reads."""
    path = gguf_file(ckpt[model_type], outtype)
    header, reader = read_header(path), gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert header.array_lengths == {k: len(v) for k, v in fields.items() if isinstance(v, list)}
    assert header.array_lengths["tokenizer.ggml.tokens"] == 512 > 256  # long enough for the shortcut
    # all but the long string array, the tokens (the 512 token types come as one part)
    assert header.metadata == {k: v for k, v in fields.items() if k != "tokenizer.ggml.tokens"}
    assert len(header.metadata["tokenizer.ggml.token_type"]) == 512
    assert [(t.name, t.type_id, t.type_name, t.shape, t.offset, t.nbytes) for t in header.tensors.values()] == \
        [(t.name, int(t.tensor_type), t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)), t.data_offset,
          int(t.n_bytes)) for t in reader.tensors]


# ---- (c) config and (d) tokenizer -----------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_config_equals_the_checkpoints(ckpt, gguf_file, model_type):
    hf = ModelConfig.from_model_dir(ckpt[model_type])
    ours = ModelConfig.from_model_dir(gguf_file(ckpt[model_type], "q8_0"))
    assert ours == hf
    assert (ours.attention_bias, ours.qk_norm, ours.tie_word_embeddings) == \
        {"llama": (False, False, False), "qwen2": (True, False, False), "qwen3": (False, True, True)}[model_type]


def test_mistral_file_says_llama(checkpoint_factory, gguf_file):
    model_dir = checkpoint_factory("gguf_mistral", model_type="mistral", vocab_size=600, tokenizer_vocab_size=512)
    path = gguf_file(model_dir)
    hf, ours = ModelConfig.from_model_dir(model_dir), ModelConfig.from_model_dir(path)
    assert (hf.model_type, ours.model_type) == ("mistral", "llama")
    assert {**vars(ours), "model_type": "mistral"} == vars(hf)
    # The converter pads the vocabulary to the model's 600 with unused "[PAD<id>]" tokens: special
    # tokens here, they decode to no text (pyengine's default skip_special_tokens=True), as in
    # transformers' tokenizer, which lacks them.
    tok, hf_tok = load_tokenizer(read_header(path)), AutoTokenizer.from_pretrained(str(model_dir))
    assert tok.convert_ids_to_tokens([511, 512, 599]) == [hf_tok.convert_ids_to_tokens(511), "[PAD512]", "[PAD599]"]
    ids = [300, 512, 301, 599]
    assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True) == \
        hf_tok.decode([300, 301])
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode([300]) + "[PAD512]" + hf_tok.decode([301]) + \
        "[PAD599]"
    assert greedy(path) == greedy(model_dir)


TEXTS = [CORPUS[:300], CORPUS[-400:], " leading space", "two  spaces\n\nand\ttabs", "<s>specials</s> <pad><unk>",
         "<|endoftext|> is not in this vocabulary", "🤖🚀 Zürich 今天", ""]


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_tokenizer_matches_the_checkpoints(ckpt, gguf_file, model_type):
    hf = AutoTokenizer.from_pretrained(str(ckpt[model_type]))
    with make_engine(gguf_file(ckpt[model_type], "q8_0")) as engine:
        tok = engine.tokenizer
    assert len(tok) == len(hf) == 512
    assert [tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token] == ["<s>", "</s>", "<unk>", "<pad>"]
    for text in TEXTS:
        ids = hf(text)["input_ids"]
        assert tok(text)["input_ids"] == ids, text
        assert tok(text, add_special_tokens=False)["input_ids"] == hf(text, add_special_tokens=False)["input_ids"]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_chat_template_comes_from_the_file_not_its_neighbours(ckpt, tmp_path):
    """The file's tokenizer.chat_template is the tokenizer's; tokenizer files lying next to the GGUF
    file (here: the checkpoint it was written from, since edited) are not read."""
    model_dir = tmp_path / "model"
    shutil.copytree(ckpt["qwen3"], model_dir)
    template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": template}))
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    path = export_gguf(model_dir, model_dir / "model.gguf")
    config_file.write_text(json.dumps({**config, "chat_template": "neighbour", "eos_token": "<unk>"}))
    with make_engine(path) as engine:
        tok = engine.tokenizer
    assert tok.chat_template == template and tok.eos_token == "</s>"
    chat = [{"role": "user", "content": "Who frees the blocks?"}]
    assert tok.apply_chat_template(chat, tokenize=False) == hf.apply_chat_template(chat, tokenize=False) == \
        "<s>user: Who frees the blocks?</s>"
    assert tok(TEXTS[0])["input_ids"] == hf(TEXTS[0])["input_ids"]


# ---- (e) what is refused, and damaged files ---------------------------------------------------------

def test_unsupported_tensor_type_is_named(ckpt, gguf_file):
    path = gguf_file(ckpt["llama"], "q8_0", tensor_types={"blk.1.ffn_down.weight": "Q4_1"})
    message = startup_error(path, "weights")
    assert (f"GGUF file {str(path)!r}: tensor 'blk.1.ffn_down.weight' has type Q4_1, which pyengine does not "
            f"read; supported: {SUPPORTED}") in message


def test_quantized_norm_is_refused(ckpt, gguf_file):
    path = gguf_file(ckpt["llama"], "f32", tensor_types={"output_norm.weight": "Q8_0"})
    assert (f"GGUF file {str(path)!r}: tensor 'output_norm.weight' is Q8_0; pyengine needs it in float (F32, "
            "F16 or BF16)") in startup_error(path, "weights")


def test_missing_tensor_is_named(ckpt, gguf_file):
    path = gguf_file(ckpt["qwen2"], "f32", drop_tensors=("blk.1.attn_v.bias",))
    message = startup_error(path, "weights")
    assert (f"GGUF file {str(path)!r} is missing tensor 'blk.1.attn_v.bias' "
            "(model.layers.1.self_attn.v_proj.bias)") in message


def test_unsupported_architecture_is_named(ckpt, gguf_file, tmp_path):
    path = rewrite(gguf_file(ckpt["llama"]), tmp_path / "gemma.gguf",
                   {"general.architecture": ("gemma2", gguf.GGUFValueType.STRING)})
    message = startup_error(path, "config")
    assert (f"GGUF file {str(path)!r}: unsupported architecture 'gemma2' (general.architecture); supported: "
            "llama, qwen2, qwen3 (Mistral files say llama)") in message


@pytest.mark.parametrize("key,value,vtype,expected", [
    ("qwen3.rope.scaling.type", "yarn", gguf.GGUFValueType.STRING,
     "unsupported RoPE scaling 'yarn' (qwen3.rope.scaling.type, factor 1.0); supported: none, and Llama 3's "
     "frequency scaling (rope_freqs.weight)"),
    ("qwen3.expert_count", 8, gguf.GGUFValueType.UINT32,
     "qwen3.expert_count = 8: mixture-of-experts models are not supported"),
    ("qwen3.feed_forward_length", 1024, gguf.GGUFValueType.UINT32,
     "tensor 'blk.0.ffn_gate.weight' has shape [512, 256] (rows first), expected [1024, 256] from the file's "
     "metadata"),
])
def test_unsupported_metadata_is_named(ckpt, gguf_file, tmp_path, key, value, vtype, expected):
    path = rewrite(gguf_file(ckpt["qwen3"]), tmp_path / "edited.gguf", {key: (value, vtype)})
    phase = "weights" if "shape" in expected else "config"
    assert f"GGUF file {str(path)!r}: {expected}" in startup_error(path, phase)


def test_missing_required_key_is_named(ckpt, gguf_file, tmp_path):
    path = rewrite(gguf_file(ckpt["qwen3"]), tmp_path / "no_ctx.gguf", drop_keys=("qwen3.context_length",))
    assert f"GGUF file {str(path)!r} lacks the required metadata key 'qwen3.context_length'" in \
        startup_error(path, "config")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_truncated_tensor_data_is_named_and_nothing_stays_mapped(ckpt, gguf_file, tmp_path):
    src = gguf_file(ckpt["llama"], "q8_0")
    header = read_header(src)
    last = max(header.tensors.values(), key=lambda t: t.offset)
    assert last.name == "output_norm.weight"  # the converter's order: the checkpoint's, sorted by name
    path = tmp_path / "cut.gguf"
    path.write_bytes(src.read_bytes()[:-100])
    expected = (f"cannot read GGUF file {str(path)!r}: tensor 'output_norm.weight' (bytes {last.offset} to "
                f"{last.offset + last.nbytes}) runs past the end of the file (the file, {header.file_size - 100} "
                "bytes, may be truncated or corrupt: an interrupted download or copy?)")
    with pytest.raises(ValueError) as info:
        read_header(path)
    assert str(info.value) == expected
    assert expected in startup_error(path, "config")  # the header (and the tokenizer) read in phase config
    assert not mapped(path)


@pytest.mark.parametrize("content,reason", [
    (b"", "cannot mmap an empty file"),
    (b"PK\x03\x04" + bytes(range(256)) * 4, "not a GGUF file (it does not start with the bytes 'GGUF')"),
    ("header", None),
])
def test_garbage_or_truncated_header_is_named(ckpt, gguf_file, tmp_path, content, reason):
    path = tmp_path / "bad.gguf"
    path.write_bytes(gguf_file(ckpt["llama"]).read_bytes()[:3000] if content == "header" else content)
    message = startup_error(path, "config")
    prefix = f"cannot read GGUF file {str(path)!r}: "
    assert prefix in message
    if reason is not None:
        assert prefix + reason in message
    assert (f"(the file, {path.stat().st_size} bytes, may be truncated or corrupt: an interrupted download or "
            "copy?)") in message
    if sys.platform.startswith("linux"):
        assert not mapped(path)


def test_arguments_a_gguf_file_rules_out(ckpt, gguf_file, tmp_path):
    path = gguf_file(ckpt["llama"], "q4_k")
    assert (f"quantization='q8_0' does not apply to a GGUF file ({str(path)!r}): its tensors load as the file "
            "stores them") in startup_error(path, "config", quantization="q8_0")
    assert (f"GGUF file {str(path)!r} holds quantized tensors (Q4_K, Q6_K), which compute with float32 "
            "activations on the CPU: dtype must be 'float32', got torch.bfloat16") in startup_error(path, "config",
                                                                                         dtype="bfloat16")
    missing = tmp_path / "nothing.gguf"
    assert f"GGUF file {str(missing)!r} does not exist" in startup_error(missing, "config")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_loaded_engine_keeps_no_mapping_of_the_file(ckpt, gguf_file):
    path = gguf_file(ckpt["qwen2"], "q4_0")
    with make_engine(path) as engine:
        assert not mapped(path)
        assert engine.model_dir == path and engine.model_config.model_type == "qwen2"
        assert os.path.samefile(engine.model_dir, path)
