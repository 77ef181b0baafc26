"""bench/llamacpp.py's parsing of llama.cpp's benchmark output and the build helper's
offline pieces (no build, no network, no timing)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import llamacpp, llamacpp_build  # noqa: E402

LLAMA_BENCH_JSON = """\
load_backend: loaded CPU backend
[
  {
    "build_commit": "0c1e57098",
    "build_number": 0,
    "model_type": "llama ?B F32",
    "n_batch": 2048,
    "n_threads": 2,
    "type_k": "f32",
    "n_prompt": 128,
    "n_gen": 0,
    "n_depth": 0,
    "avg_ns": 100000000,
    "stddev_ns": 0,
    "avg_ts": 1280.000000,
    "stddev_ts": 0.000000,
    "samples_ns": [ 100000000 ],
    "samples_ts": [ 1280 ]
  },
  {
    "n_prompt": 0,
    "n_gen": 128,
    "avg_ts": 55.5,
    "samples_ts": [ 55.5 ]
  }
]
"""

BATCHED_JSONL = """\
main: n_kv_max = 16384, n_batch = 2048
{"n_kv_max": 16384, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, \
"n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 128, "pl": 64, "n_kv": 16384, "t_pp": 10.5, \
"speed_pp": 780.19, "t_tg": 20.25, "speed_tg": 404.54, "t": 30.75, "speed": 532.81}

llama_perf_context_print:        load time =     120.00 ms
"""

BATCHED_MD = """\
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    64 |     64 |   16 |   2048 |    1.000 |  1024.00 |    2.000 |   512.00 |    3.000 |   682.67 |
"""


def test_llama_bench_json_array_with_noise():
    recs = llamacpp.parse_llama_bench(LLAMA_BENCH_JSON + "\nllama_perf: [done]\n")
    assert [(r["n_prompt"], r["n_gen"], r["avg_ts"]) for r in recs] == [(128, 0, 1280.0), (0, 128, 55.5)]


def test_llama_bench_jsonl():
    text = '{"n_prompt": 64, "n_gen": 0, "avg_ts": 900.5}\n{"n_prompt": 0, "n_gen": 64, "avg_ts": 40.0}\n'
    assert [r["avg_ts"] for r in llamacpp.parse_llama_bench(text)] == [900.5, 40.0]


def test_llama_bench_no_results():
    with pytest.raises(ValueError, match="no llama-bench results"):
        llamacpp.parse_llama_bench("error: failed to load model\n")


def test_batched_bench_jsonl_and_markdown():
    (row,) = llamacpp.parse_batched_bench(BATCHED_JSONL)
    assert (row["pp"], row["tg"], row["pl"], row["t"], row["speed"]) == (128, 128, 64, 30.75, 532.81)
    (row,) = llamacpp.parse_batched_bench(BATCHED_MD)
    assert (row["pp"], row["tg"], row["pl"], row["n_kv"]) == (64, 64, 16, 2048)
    assert row["speed_tg"] == 512.0 and row["speed"] == 682.67


def test_batched_bench_skipped_row_is_an_error():
    # llama-batched-bench silently skips a configuration that does not fit its context
    with pytest.raises(ValueError, match="-c at least"):
        llamacpp.parse_batched_bench("main: n_kv_max = 4096\n\nllama_perf_context_print: load time = 1 ms\n")


def test_dtype_option():
    assert llamacpp.parse_dtypes("bf16,fp32,bfloat16") == ["bfloat16", "float32"]


def test_commit_from_changelog(tmp_path):
    (tmp_path / "CHANGELOG.md").write_text(
        "## [Unreleased]\n\n## [0.3.36]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098\n\n"
        "## [0.3.35]\n\n- feat: update llama.cpp to ggml-org/llama.cpp@4df29be4f\n")
    assert llamacpp_build.llama_cpp_commit(tmp_path, "0.3.36") == "0c1e57098"
    assert llamacpp_build.llama_cpp_commit(tmp_path, "0.3.35") == "4df29be4f"
    assert llamacpp_build.llama_cpp_commit(tmp_path, "0.3.1") is None


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv(llamacpp_build.CACHE_ENV, str(tmp_path))
    assert llamacpp_build.default_cache_root() == tmp_path
    monkeypatch.delenv(llamacpp_build.CACHE_ENV)
    assert llamacpp_build.default_cache_root() == Path.home() / ".cache" / "pyengine" / "llamacpp"
