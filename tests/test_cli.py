"""The command line, run as a user runs it: `python -m pyengine ...` in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from pyengine import Engine, SamplingParams
from pyengine.cli import DEMO_PROMPTS

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


# ---- demo ---------------------------------------------------------------------------------


def test_demo_labels(tmp_path):
    env = {"PYENGINE_CHECKPOINT_CACHE": str(tmp_path)}
    args = ["demo", "--num-requests", "10", "--max-tokens", "4"]
    first = pyengine(*args, env=env)
    assert first.returncode == 0, first.stderr
    model_dir = tmp_path / "demo-llama"
    assert f"model, built just now in {model_dir}." in first.stdout
    assert "reused" not in first.stdout
    second = pyengine(*args, env=env)
    assert second.returncode == 0, second.stderr
    assert f"model, reused from the cache, {model_dir}." in second.stdout
    assert "built" not in second.stdout

    out = second.stdout
    assert "10 requests: the 8 demo prompts, repeated to make up 10; at most 8 run at once" in out
    # Each distinct prompt is shown once, with the ids of its requests (greedy: repeats agree).
    shown = re.findall(r"^--- requests? ([\d, ]+): '(.*)'$", out, flags=re.M)
    assert [p for _, p in shown] == DEMO_PROMPTS
    assert [ids for ids, _ in shown] == ["0, 8", "1, 9"] + [str(i) for i in range(2, 8)]
    assert re.search(r"^10 requests \(8 distinct prompts\), 40 generated tokens in ", out, flags=re.M)
    assert re.findall(r"^    tokens: .*$", first.stdout, flags=re.M) == re.findall(r"^    tokens: .*$", out, flags=re.M)
