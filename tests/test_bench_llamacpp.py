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


# ---- quantized formats, models and sizes ------------------------------------------------------


def test_quantized_dtype_options():
    assert llamacpp.parse_dtypes("q8_0,Q4_0,q4_k_m,q4_k,fp32") == ["q8_0", "q4_0", "q4_k", "float32"]
    assert [llamacpp.GGUF_TYPE[d] for d in ("q8_0", "q4_0", "q4_k")] == ["q8_0", "q4_0", "q4_k_m"]
    assert all(t in llamacpp_build.QUANTIZED_TYPES for t in ("q8_0", "q4_0", "q4_k_m"))
    assert llamacpp.pyengine_dtype("q4_k") == ("float32", "q4_k_m")  # llama.cpp's Q4_K_M mixture
    assert llamacpp.pyengine_dtype("bfloat16") == ("bfloat16", None)
    # llama.cpp's default f16 KV cache in both tools for the quantized formats
    assert llamacpp.KV_TYPE["q4_0"] == {"bench": "f16", "batched": "f16"}
    with pytest.raises(Exception, match="q4_k"):
        llamacpp.parse_dtypes("q5_0")


def test_figures_option():
    assert llamacpp.parse_figures("batched,tg") == ["tg", "batched"]  # in the order the script runs them
    assert llamacpp.parse_figures(" TG ") == ["tg"]
    with pytest.raises(Exception, match="unknown figure 'tgx'"):
        llamacpp.parse_figures("pp,tgx")
    assert [k for k, _ in llamacpp.figure_keys(["tg"])] == ["tg"]
    assert [k for k, _ in llamacpp.figure_keys(["pp", "batched"])] == ["pp", "batched_total", "batched_generated"]


def test_sizes_per_model():
    s = llamacpp.sizes_for("smollm-135m-shape")
    assert (s.pp, s.tg, s.npp, s.ntg, s.npl, s.tg_prompt) == (128, 128, 128, 128, 64, 128)
    s = llamacpp.sizes_for("qwen3-0.6b-shape")  # pp512, tg128, 64 x (128 + 128)
    assert (s.pp, s.tg, s.npp, s.ntg, s.npl, s.tg_prompt) == (512, 128, 128, 128, 64, 128)
    assert llamacpp.sizes_for("qwen3-0.6b-shape", quick=True) == llamacpp.QUICK
    assert llamacpp.sizes_for("smollm-135m-shape", pp=256).pp == 256
    assert llamacpp.sizes_for("qwen3-0.6b-shape", quick=True, pp=32).pp == 32
    s = llamacpp.sizes_for("qwen3-0.6b-shape", tg_prompt=1)  # tg from (nearly) the empty context llama-bench's has
    assert (s.pp, s.tg, s.tg_prompt) == (512, 128, 1)
    assert llamacpp.QUICK.pp == 64  # unchanged by the calls above


def test_bench_models():
    from bench import common

    assert set(common.BENCH_MODELS) == {"smollm-135m-shape", "qwen3-0.6b-shape"}
    q = common.BENCH_MODELS["qwen3-0.6b-shape"]
    assert (q["model_type"], q["vocab_size"], q["hidden_size"], q["intermediate_size"], q["num_layers"],
            q["num_heads"], q["num_kv_heads"], q["head_dim"], q["max_position_embeddings"],
            q["tie_word_embeddings"]) == ("qwen3", 151936, 1024, 3072, 28, 16, 8, 128, 4096, True)
    with pytest.raises(ValueError, match="unknown benchmark model"):
        common.bench_checkpoint("nope")


# ---- the build stamp ----------------------------------------------------------------------------

KEY = {"llama_cpp_python": "0.3.36", "llama_cpp_commit": "0c1e57098", "cmake_args": ["-DX=1"], "cpu": "C",
       "cpu_flags": ["avx2"]}
ALL = ["llama-bench", "llama-batched-bench", "llama-quantize", "llama-perplexity"]


def test_stamp_state():
    assert llamacpp_build.stamp_state(None, KEY, ALL) == ("rebuild", ALL)
    assert llamacpp_build.stamp_state({"key": KEY, "targets": ALL}, KEY, ALL) == ("ok", [])
    # fewer tools wanted than built: still fine
    assert llamacpp_build.stamp_state({"key": KEY, "targets": ALL}, KEY, ALL[:2]) == ("ok", [])
    # a stamp of the earlier script: its targets inside the key, two tools only -> add the other two
    legacy = {"key": {**KEY, "targets": ["llama-bench", "llama-batched-bench"]}}
    assert llamacpp_build.stamp_state(legacy, KEY, ALL) == ("add", ["llama-quantize", "llama-perplexity"])
    # another configuration (CPU, CMake arguments, version): start over
    assert llamacpp_build.stamp_state({"key": {**KEY, "cpu": "D"}, "targets": ALL}, KEY, ALL) == ("rebuild", ALL)
    assert llamacpp_build.stamp_state({"key": {**KEY, "cmake_args": []}, "targets": ALL}, KEY, ALL)[0] == "rebuild"
    assert llamacpp_build.TOOLS == tuple(ALL)


def test_cmake_args_for_this_cpu_and_for_an_emulated_level():
    native = llamacpp_build.cmake_args("0c1e57098")
    assert "-DGGML_NATIVE=ON" in native and "-DLLAMA_BUILD_COMMIT=0c1e57098" in native
    avx2 = llamacpp_build.cmake_args("0c1e57098", "avx2")
    assert "-DGGML_NATIVE=ON" not in avx2 and "-DGGML_NATIVE=OFF" in avx2
    for on in ("AVX", "AVX2", "FMA", "F16C"):
        assert f"-DGGML_{on}=ON" in avx2
    for off in ("AVX_VNNI", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AMX_INT8", "AMX_BF16"):
        assert f"-DGGML_{off}=OFF" in avx2
    # the rest of the configuration is the native build's
    assert [a for a in avx2 if "GGML_NATIVE" not in a and a not in llamacpp_build.LEVEL_ISA_ARGS["avx2"]] == \
        [a for a in native if a != "-DGGML_NATIVE=ON"]
    with pytest.raises(ValueError, match="unknown CPU level 'avx9'.*one of avx2"):
        llamacpp_build.cmake_args(None, "avx9")


def test_every_emulated_level_has_a_llamacpp_build():
    from bench.common import EMULATED_CPU_LEVELS

    assert set(EMULATED_CPU_LEVELS) <= set(llamacpp_build.LEVEL_ISA_ARGS)


def test_a_levels_build_has_its_own_folder(tmp_path):
    assert llamacpp_build.build_dir_name(None) == "build"
    assert llamacpp_build.build_dir_name("avx2") == "build-avx2"
    with pytest.raises(RuntimeError, match=r"no cached build at .*0\.3\.36/build-avx2 "):
        llamacpp_build.build(tmp_path, "0.3.36", trust_cache=True, level="avx2")


def test_gguf_tensor_types(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("a", np.zeros((4, 32), dtype=np.float32))
    w.add_tensor("b", np.zeros(32, dtype=np.float32))
    w.add_tensor("c", np.zeros((2, 34), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert llamacpp_build.gguf_tensor_types(path) == {"F32": 2, "Q8_0": 1}


def _cached_f32_gguf(tmp_path: Path, config: dict) -> tuple:
    """(checkpoint, LlamaCpp, GGUF folder) of a checkpoint with `config` whose f32 GGUF file is
    already converted and cached (a few bytes standing for it), and an empty build's bin folder."""
    import json

    from bench.common import checkpoints

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(config))
    build = tmp_path / "build"
    (build / "bin").mkdir(parents=True)
    lc = llamacpp_build.LlamaCpp("0", "0", None, tmp_path / "tree", build)
    folder = lc.gguf_root / f"m-{checkpoints.checkpoint_digest(ckpt)[:16]}"
    folder.mkdir(parents=True)
    (folder / "model-f32.gguf").write_bytes(b"GGUF f32")
    (folder / "conversions.json").write_text(json.dumps({"f32": {"scheme": llamacpp_build.CONVERT_SCHEME,
                                                                  "seconds": 1, "bytes": 8}}))
    return ckpt, lc, folder


def test_quantized_gguf_files_are_made_from_f32_and_cached(tmp_path):
    """gguf_files runs llama-quantize on the cached f32 file once per format, and again when the
    f32 file changes (a fake llama-quantize that copies its input and counts its calls)."""
    import json
    import os
    import stat

    ckpt, lc, folder = _cached_f32_gguf(tmp_path, {})
    calls = tmp_path / "calls.txt"
    tool = lc.build_dir / "bin" / "llama-quantize"
    tool.write_text(f"#!/bin/sh\necho \"$3 $4\" >> {calls}\ncp \"$1\" \"$2\"\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    out = llamacpp_build.gguf_files(lc, ckpt, "m", ["q4_k_m", "q8_0"], log=lambda m: None, threads=3)
    assert list(out) == ["q4_k_m", "q8_0"]
    assert out["q4_k_m"] == folder / "model-q4_k_m.gguf" and out["q4_k_m"].read_bytes() == b"GGUF f32"
    assert calls.read_text().split("\n")[:2] == ["Q4_K_M 3", "Q8_0 3"]
    info = json.loads((folder / "conversions.json").read_text())
    assert info["q8_0"]["command"].startswith("llama-quantize model-f32.gguf model-q8_0.gguf Q8_0 3")
    llamacpp_build.gguf_files(lc, ckpt, "m", ["q8_0"], log=lambda m: None)
    assert len(calls.read_text().split()) == 4  # cached: not quantized again
    st = (folder / "model-f32.gguf").stat()
    os.utime(folder / "model-f32.gguf", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new f32 file
    llamacpp_build.gguf_files(lc, ckpt, "m", ["q8_0"], log=lambda m: None)
    assert calls.read_text().split("\n")[2] == "Q8_0 2"


def _fake_quantize_tool(build: Path, calls: Path) -> None:
    """A llama-quantize that records its arguments and copies its input (after the options) to
    its output."""
    import stat
    tool = build / "bin" / "llama-quantize"
    tool.write_text(f"#!{sys.executable}\nimport shutil, sys\nargs = sys.argv[1:]\n"
                    f"open({str(calls)!r}, 'a').write(' '.join(args) + '\\n')\n"
                    "while args[0].startswith('--'):\n    args = args[2:]\nshutil.copy(args[0], args[1])\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("tied, flag", [(True, "--token-embedding-type"), (False, "--output-tensor-type")])
def test_an_output_tensor_type_makes_files_of_its_own(tmp_path, tied, flag):
    """gguf_files(output_type=...): llama-quantize gives the output projection that type -- the
    output tensor, or the embedding table of a model that ties the two -- into a file of its own,
    beside the plain quantized file; float files are shared."""
    import json

    ckpt, lc, folder = _cached_f32_gguf(tmp_path, {"tie_word_embeddings": tied})
    calls = tmp_path / "calls.txt"
    _fake_quantize_tool(lc.build_dir, calls)
    out = llamacpp_build.gguf_files(lc, ckpt, "m", ["f32", "q4_0"], log=lambda m: None, threads=2,
                                    output_type="q4_0")
    assert out == {"f32": folder / "model-f32.gguf", "q4_0": folder / "model-q4_0.output-q4_0.gguf"}
    assert out["q4_0"].read_bytes() == b"GGUF f32"
    src, dst = folder / "model-f32.gguf", folder / ".model-q4_0.output-q4_0.gguf.tmp"
    assert calls.read_text().splitlines() == [f"{flag} q4_0 {src} {dst} Q4_0 2"]
    info = json.loads((folder / "conversions.json").read_text())
    assert info["q4_0.output-q4_0"]["command"] == f"llama-quantize {flag} q4_0 model-f32.gguf " \
                                                  "model-q4_0.output-q4_0.gguf Q4_0 2"
    assert llamacpp_build.quantized_key("q4_0", "q4_0") == "q4_0.output-q4_0"
    assert llamacpp_build.quantized_key("f32", "q4_0") == "f32"
    plain = llamacpp_build.gguf_files(lc, ckpt, "m", ["q4_0"], log=lambda m: None, threads=2)
    assert plain == {"q4_0": folder / "model-q4_0.gguf"}  # the plain file: quantized on its own
    assert calls.read_text().splitlines()[1] == f"{src} {folder / '.model-q4_0.gguf.tmp'} Q4_0 2"
    llamacpp_build.gguf_files(lc, ckpt, "m", ["q4_0"], log=lambda m: None, output_type="q4_0")
    assert len(calls.read_text().splitlines()) == 2  # cached
    with pytest.raises(ValueError, match="output tensor type 'q3_k': not one of q8_0, q5_0, q5_1, q4_0, q4_k, q5_k, q6_k"):
        llamacpp_build.gguf_files(lc, ckpt, "m", ["q8_0"], log=lambda m: None, output_type="q3_k")


def test_output_tensor_type_needs_a_quantized_format(capsys):
    with pytest.raises(SystemExit) as e:
        llamacpp.main(["--dtypes", "bfloat16", "--output-tensor-type", "q4_0"])
    assert e.value.code == 2
    assert "--output-tensor-type needs a quantized format among --dtypes" in capsys.readouterr().err
