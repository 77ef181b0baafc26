"""The command line, run as a user runs it: `python -m pyengine ...` in a subprocess."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from pyengine import Engine, SamplingParams
from pyengine.cli import DEMO_MODEL_DIR, DEMO_PROMPTS, DEMO_REPETITION_PENALTY, STREAM_PROMPT

PROMPT = "Once upon a time"
SUMMARY = re.compile(r"\n\[(\d+) tokens, finish_reason=(\w+)(?:, stop_reason=(.*))?\]\n\Z")


def pyengine(*args: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyengine", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def generated(done: subprocess.CompletedProcess) -> tuple[str, int, str]:
    """(text, number of tokens, finish_reason) of a `generate` run."""
    assert done.returncode == 0, done.stderr
    m = SUMMARY.search(done.stdout)
    assert m, done.stdout
    return done.stdout[: m.start()], int(m.group(1)), m.group(2)


def assert_one_line_error(done: subprocess.CompletedProcess, *parts: str) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("pyengine: error: ")
    assert "Traceback" not in done.stderr
    for part in parts:
        assert part in lines[0]
    return lines[0]


# ---- errors -------------------------------------------------------------------------------


def test_missing_model_is_one_line_and_exit_2(tmp_path):
    missing = tmp_path / "no-such-model"
    line = assert_one_line_error(pyengine("generate", "--model", str(missing), "--prompt", "hi"),
                                 "start-up failed in phase 'config'", f"model directory {str(missing)!r} does not exist")
    assert line.count("pyengine") == 2  # "pyengine: error:" and "pyengine loads models from a local directory"


def test_hub_id_is_one_line_saying_local_only(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pyengine", "demo", "--model", "meta-llama/Llama-3.2-1B"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert_one_line_error(done, "loads models from local directories only",
                          "does not download from the Hugging Face Hub")


def test_bad_values_are_one_line(llama_dir):
    assert_one_line_error(pyengine("generate", "--model", str(llama_dir), "--prompt", "hi", "--top-p", "2"),
                          "top_p must be in (0, 1], got 2.0")
    assert_one_line_error(pyengine("demo", "--model", str(llama_dir), "--num-requests", "0"),
                          "--num-requests must be at least 1, got 0")


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(tmp_path, where):
    args = ["generate", "--model", str(tmp_path / "no-such-model"), "--prompt", "hi"]
    args = ["--debug", *args] if where == "before" else [*args, "--debug"]
    done = pyengine(*args)
    assert done.returncode not in (0, 2)
    assert done.stderr.startswith("Traceback (most recent call last):"), done.stderr
    assert "pyengine: error:" not in done.stderr
    assert done.stderr.rstrip().splitlines()[-1].startswith("pyengine.StartupError: pyengine start-up "
                                                            "failed in phase 'config': FileNotFoundError: model "
                                                            "directory")


def test_float16_is_accepted(llama_dir):
    _, n, reason = generated(pyengine("generate", "--model", str(llama_dir), "--prompt", PROMPT, "--dtype", "float16",
                                      "--max-tokens", "4"))
    assert (n, reason) == (4, "length")


# ---- generate's sampling flags ------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy(llama_dir) -> tuple[str, list[int]]:
    """The engine's greedy text and tokens for PROMPT (16 tokens), in-process."""
    with Engine(llama_dir) as engine:
        out = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                              use_tqdm=False)[0]
    return out.text, out.token_ids


def test_generate_defaults_to_greedy_and_streams(llama_dir, greedy):
    text, n, reason = generated(pyengine("generate", "--model", str(llama_dir), "--prompt", PROMPT,
                                         "--max-tokens", "16", "--ignore-eos"))
    assert (text, n, reason) == (greedy[0], 16, "length")


def test_generate_sampling_flags(llama_dir, greedy):
    flags = ["generate", "--model", str(llama_dir), "--prompt", PROMPT, "--temperature", "0.9", "--top-p", "0.95",
             "--top-k", "100", "--min-p", "0.01", "--max-tokens", "12", "--ignore-eos"]
    first = generated(pyengine(*flags, "--seed", "7"))
    assert first[1:] == (12, "length")
    assert generated(pyengine(*flags, "--seed", "7", "--no-stream")) == first  # a seed reproduces the sample
    assert generated(pyengine(*flags, "--seed", "8"))[0] != first[0]  # the flags sample: another seed, other text


def test_generate_stop_strings(llama_dir, greedy):
    text = greedy[0]
    # Two ASCII letters or digits that greedy decoding produces in the first half of its text.
    stop = next(text[i:i + 2] for i in range(1, len(text) // 2) if text[i:i + 2].isascii() and text[i:i + 2].isalnum())
    out, n, reason = generated(pyengine("generate", "--model", str(llama_dir), "--prompt", PROMPT, "--max-tokens",
                                        "16", "--stop", "no such string", "--stop", stop))
    assert reason == "stop" and n < 16
    assert out == text[: text.index(stop)]  # cut before the stop string


def test_generate_with_speculative_decoding(llama_dir, greedy, tmp_path):
    """Greedy text is the same with either source of drafts; acceptance goes to stderr."""
    from pyengine.testing.checkpoints import build_truncated_checkpoint
    draft = build_truncated_checkpoint(llama_dir, tmp_path / "draft", 1)
    base = ["generate", "--model", str(llama_dir), "--prompt", PROMPT, "--max-tokens", "16", "--ignore-eos"]
    for extra in (["--speculative-method", "ngram", "--num-speculative-tokens", "2"], ["--draft-model", str(draft)]):
        done = pyengine(*base, *extra)
        assert generated(done) == (greedy[0], 16, "length")
        assert re.search(r"\[speculative decoding: \d+ of \d+ draft tokens accepted\]", done.stderr), done.stderr
    assert_one_line_error(pyengine(*base, "--num-speculative-tokens", "2"),
                          "--num-speculative-tokens needs --speculative-method")
    assert_one_line_error(pyengine(*base, "--speculative-method", "draft_model"),
                          "speculative method 'draft_model' needs draft_model=")


def test_generate_quantized_at_load(llama_dir):
    """--quantization, --lm-head-quantization and --no-quantize-lm-head are Engine's arguments: the
    text is the in-process engine's with the same ones."""
    base = ["generate", "--model", str(llama_dir), "--prompt", PROMPT, "--max-tokens", "12", "--ignore-eos"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for flags, kwargs in [(["--quantization", "q4_0"], dict(quantization="q4_0")),
                          (["--quantization", "q4_0", "--lm-head-quantization", "q8_0"],
                           dict(quantization="q4_0", lm_head_quantization="q8_0")),
                          (["--quantization", "q8_0", "--no-quantize-lm-head"],
                           dict(quantization="q8_0", quantize_lm_head=False))]:
        with Engine(llama_dir, **kwargs) as engine:
            expected = engine.generate([PROMPT], params, use_tqdm=False)[0].text
        assert generated(pyengine(*base, *flags)) == (expected, 12, "length"), flags


def test_quantization_flag_errors_are_one_line(llama_dir):
    base = ["generate", "--model", str(llama_dir), "--prompt", PROMPT]
    assert_one_line_error(pyengine(*base, "--quantization", "q4_1"), "start-up failed in phase 'config'",
                          "unsupported quantization format 'q4_1'", "q4_k_s, q4_k_m, q5_k_s, q5_k_m")
    assert_one_line_error(pyengine(*base, "--lm-head-quantization", "q4_0"),
                          "lm_head_quantization='q4_0' needs quantization=")
    assert_one_line_error(pyengine(*base, "--no-quantize-lm-head"), "quantize_lm_head=False needs quantization=")
    assert_one_line_error(pyengine(*base, "--quantization", "q4_0", "--dtype", "bfloat16"),
                          "dtype must be 'float32', got torch.bfloat16")


# ---- demo ---------------------------------------------------------------------------------


def test_demo_random_labels(tmp_path):
    """--random: today's random-weight model, built in the checkpoint cache, then reused."""
    env = {"PYENGINE_CHECKPOINT_CACHE": str(tmp_path)}
    args = ["demo", "--random", "--num-requests", "10", "--max-tokens", "4"]
    first = pyengine(*args, env=env)
    assert first.returncode == 0, first.stderr
    model_dir = tmp_path / "demo-llama"
    assert f"model, built just now in {model_dir}." in first.stdout
    assert "reused from the cache" not in first.stdout
    second = pyengine(*args, env=env)
    assert second.returncode == 0, second.stderr
    assert f"model, reused from the cache, {model_dir}." in second.stdout
    assert "built just now" not in second.stdout
    assert "RANDOM-WEIGHT" in second.stdout and "trained on" not in second.stdout

    out = second.stdout
    assert "10 requests: the 8 demo prompts, repeated to make up 10; at most 8 run at once" in out
    # Each distinct prompt is shown once, with the ids of its requests (greedy: repeats agree).
    shown = re.findall(r"^--- requests? ([\d, ]+): '(.*)'$", out, flags=re.M)
    assert [p for _, p in shown] == DEMO_PROMPTS
    assert [ids for ids, _ in shown] == ["0, 8", "1, 9"] + [str(i) for i in range(2, 8)]
    assert re.search(r"^10 requests \(8 distinct prompts\), 40 generated tokens in ", out, flags=re.M)
    assert re.findall(r"^    tokens: .*$", first.stdout, flags=re.M) == re.findall(r"^    tokens: .*$", out, flags=re.M)
    assert re.search(r"^    \[streamed 4 tokens in \d+ outputs, .*finish_reason=length\]$", out, flags=re.M)


def test_demo_quantized_names_its_weights(llama_dir):
    done = pyengine("demo", "--model", str(llama_dir), "--num-requests", "2", "--max-tokens", "4",
                    "--quantization", "q4_0", "--lm-head-quantization", "q8_0")
    assert done.returncode == 0, done.stderr
    assert re.search(r"^2 requests \(2 distinct prompts\), \d+ generated tokens in .* tokens/s \(q4_0 weights, output "
                     r"projection q8_0, float32 activations\)$", done.stdout, re.M), done.stdout


def test_demo_random_and_model_exclude_each_other(llama_dir):
    done = pyengine("demo", "--random", "--model", str(llama_dir))
    assert done.returncode == 2 and "not allowed with argument" in done.stderr


# ---- the trained demo model ---------------------------------------------------------------

# Common English words and words of Python's documentation: a continuation in English about
# Python has many of them; a random-weight model's (byte soup) has next to none.
ENGLISH = {"the", "a", "an", "is", "are", "of", "to", "in", "and", "or", "be", "it", "that", "this", "which",
           "for", "with", "as", "by", "on", "not", "if", "from", "statement", "object", "objects", "value",
           "function", "list", "class", "method", "module", "name", "names", "type", "expression", "exception",
           "return", "returns", "string", "used", "can", "must", "when", "new", "argument", "arguments", "its",
           "each", "all", "any", "see", "also", "attribute", "sequence", "block", "code", "called", "item"}


def words(text: str) -> list[str]:
    return text.split()


def english_words(text: str) -> list[str]:
    return [w for w in re.findall(r"[a-z]+", text.lower()) if w in ENGLISH]


def test_demo_model_files_are_shipped_and_small():
    files = {f.name: f.stat().st_size for f in DEMO_MODEL_DIR.iterdir() if f.is_file()}
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "training.json", "README.md"):
        assert name in files, sorted(files)
    assert sum(files.values()) <= 16 * 10**6, files
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    generation = json.loads((DEMO_MODEL_DIR / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]
    from safetensors import safe_open
    with safe_open(str(DEMO_MODEL_DIR / "model.safetensors"), framework="pt") as st:
        dtypes = {st.get_slice(k).get_dtype() for k in st.keys()}
    assert dtypes == {"BF16"}


def test_demo_model_tokenizer_and_chat_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    text = 'The "for" statement is used to iterate over the elements of a sequence.'
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == text  # byte-level: round trip
    assert len(ids) < len(text) / 2.5  # a trained BPE: several characters a token
    chat = tok.apply_chat_template([{"role": "user", "content": "What is a list?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<s><|user|>\nWhat is a list?<|end|>\n<|assistant|>\n"
    chat_ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    chat_ids = chat_ids["input_ids"] if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys") else chat_ids
    for special in ("<|user|>", "<|end|>", "<|assistant|>"):  # each one token of its own
        assert tok.convert_tokens_to_ids(special) in chat_ids


def demo_texts(prompts: list[str], max_tokens: int) -> list[str]:
    """The demo's continuations (greedy, its repetition penalty), in-process."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, repetition_penalty=DEMO_REPETITION_PENALTY)
    with Engine(DEMO_MODEL_DIR) as engine:
        return [out.text for out in engine.generate(prompts, params, use_tqdm=False)]


def training_script():
    """scripts/train_demo_model.py as a module (its corpus functions: the text it trained and measured on)."""
    import importlib.util

    path = DEMO_MODEL_DIR.parents[1] / "scripts" / "train_demo_model.py"
    if not path.is_file():
        pytest.skip(f"not a source checkout: {path} is absent")
    spec = importlib.util.spec_from_file_location("train_demo_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_model_predicts_held_out_documentation():
    """The engine's per-token loss on the pydoc topics held out of training (training.json names
    them), chunked as the training script measured it, equals the script's figure up to the
    bfloat16 rounding of the saved weights, and is far below log(vocabulary), which is about what a
    model that learnt nothing scores."""
    script = training_script()
    record = json.loads((DEMO_MODEL_DIR / "training.json").read_text())
    held_out = record["corpus"]["held_out_topics"]
    assert held_out == script.HELD_OUT_TOPICS
    topics = script.pydoc_topics()
    losses = []
    with Engine(DEMO_MODEL_DIR) as engine:
        for name in held_out:
            ids = engine.tokenizer(topics[name])["input_ids"]
            chunks = [ids[i: i + script.SEQ_LEN] for i in range(0, len(ids), script.SEQ_LEN)]
            chunks = [c for c in chunks if len(c) >= 2]
            params = SamplingParams(max_tokens=1, prompt_logprobs=0)
            for chunk, out in zip(chunks, engine.generate(chunks, params, use_tqdm=False)):
                losses += [-row[token] for row, token in zip(out.prompt_logprobs[1:], chunk[1:])]
        log_vocab = math.log(engine.model_config.vocab_size)
    assert len(losses) > 300
    loss = sum(losses) / len(losses)
    assert abs(loss - record["held_out_loss"]) < 0.02, (loss, record["held_out_loss"])
    assert loss < 0.5 * log_vocab, (loss, log_vocab)


def test_demo_model_continues_in_english():
    for text in demo_texts(['The "for" statement', "Exceptions are"], 48):
        assert "\ufffd" not in text and all(c.isprintable() or c in "\n\t" for c in text), text  # decodes cleanly
        words = re.findall(r"[A-Za-z]+", text)
        assert len(words) >= 15, text
        assert len(english_words(text)) >= 8, text
        assert len(set(english_words(text))) >= 5, text


def test_a_random_model_fails_the_english_check(llama_dir):
    """The check above is not one that any model passes."""
    with Engine(llama_dir) as engine:
        out = engine.generate(['The "for" statement'], SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
                              use_tqdm=False)[0]
    assert len(english_words(out.text)) < 8, out.text


def test_demo_default_runs_the_trained_model_streams_and_prints_stats():
    done = pyengine("demo", "--num-requests", "8", "--max-tokens", "24")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert re.search(r"^Model: a \d+\.\d M-parameter Llama trained on CPython's bundled documentation by "
                     r"scripts/train_demo_model\.py", out, flags=re.M), out
    assert "RANDOM" not in out
    shown = re.findall(r"^--- request (\d+): '(.*)'$", out, flags=re.M)
    assert [p for _, p in shown] == DEMO_PROMPTS
    # Each prompt's continuation (lines re-wrapped for the terminal), as the engine generates it in-process.
    *texts, streamed = demo_texts([*DEMO_PROMPTS, STREAM_PROMPT], 24)
    blocks = re.split(r"^--- .*$", out, flags=re.M)
    for prompt, text, block in zip(DEMO_PROMPTS, texts, blocks[1:]):
        assert words(block) == words(f"[{prompt}]{text}"), (block, text)
    # The streamed run: the text arrives in several outputs, and is the greedy text.
    m = re.search(r"^--- streamed, token by token as each step produces it: '(.*)'\n    \[(.*?)\]((?:.|\n)*?)\n"
                  r"    \[streamed (\d+) tokens in (\d+) outputs, .* s, finish_reason=(\w+)\]$", out, flags=re.M)
    assert m, out
    assert m.group(1) == m.group(2) == STREAM_PROMPT
    assert words(m.group(3)) == words(streamed)
    assert int(m.group(4)) > 1 and int(m.group(5)) > 1
    # The statistics after it.
    assert re.search(r"^8 requests \(8 distinct prompts\), \d+ generated tokens in .* tokens/s \(float32\)$", out,
                     flags=re.M)
    assert re.search(r"^engine stats: num_requests=0, .*num_free_slots=8, ", out, flags=re.M), out
    assert re.search(r"^step timings \(\d+ steps\): schedule ", out, flags=re.M), out
