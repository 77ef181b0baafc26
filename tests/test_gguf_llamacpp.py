"""GGUF files made by llama.cpp's own tools from a tiny checkpoint -- its converter
(convert_hf_to_gguf.py) and llama-quantize (Q8_0, Q4_0, Q4_K_S, Q4_K_M, Q5_K_S, Q5_K_M) -- hold
the blocks of pyengine's quantize-on-load, load in pyengine and decode, greedy, the tokens
llama.cpp decodes from them (bench/cpp/llamacpp_greedy.cpp: greedy decoding through llama.cpp's
C API, printing each token's id and how near a tie it was).

The two engines compute the same quantized blocks (llama-quantize's, which pyengine's own
quantizers reproduce byte for byte) with 8-bit activation blocks, each in its own rounding and
order of additions, and both keep a float16 KV cache here. So a sequence may part from
llama.cpp's only where both engines' tokens are within the activation quantization's own
effect on the logits of the exact quantized math (transformers with the same dequantized
weights and 8-bit activations, teacher-forced: tests/hf_reference.py) -- the noise rule of
the quantize-on-load tests; after that the continuations are not comparable. The float32 file
gives llama.cpp's tokens exactly.

Needs a llama.cpp build in the cache bench/llamacpp.py keeps (``python bench/llamacpp.py
--quick`` makes one, about 8 minutes on 2 cores; ``PYENGINE_LLAMACPP_CACHE`` moves it); the
tests skip without one, saying so.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from gguf_blocks import assert_file_holds_quantize_on_load_blocks
from hf_reference import quantized_hf_model, quantized_teacher_forced_gaps
import pyengine.core._core as _core
from pyengine import Engine, KvCacheConfig, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import llamacpp_build  # noqa: E402

# llama-quantize's type -> the GGUF file's name in llamacpp_build, also pyengine's quantization= of
# the same mixture
TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_K_S": "q4_k_s", "Q4_K_M": "q4_k_m", "Q5_K_S": "q5_k_s",
         "Q5_K_M": "q5_k_m"}
GENERATED = 24
F16_KV = KvCacheConfig(dtype="float16")  # llama.cpp's default cache (and pyengine's for quantized weights)


def _quiet(_msg: str) -> None:
    pass


@pytest.fixture(scope="module")
def llama_cpp() -> tuple[llamacpp_build.LlamaCpp, Path]:
    root = llamacpp_build.default_cache_root()
    try:
        lc = llamacpp_build.build(root, trust_cache=True, log=_quiet)
        tool = llamacpp_build.greedy_tool(lc, log=_quiet)
    except RuntimeError as e:
        pytest.skip(f"no llama.cpp build under {root} ({e}); `python bench/llamacpp.py --quick` builds one")
    return lc, tool


@pytest.fixture(scope="module")
def checkpoint(checkpoint_factory) -> Path:
    return checkpoint_factory("llamacpp_llama", model_type="llama", hidden_size=256, intermediate_size=512,
                              num_heads=4, num_kv_heads=2, num_layers=2)


@pytest.fixture(scope="module")
def gguf_files(llama_cpp, checkpoint, tmp_path_factory) -> dict[str, Path]:
    """The checkpoint converted to f32 by llama.cpp's converter, then quantized by llama-quantize
    (as bench/llamacpp.py makes its files, here into a temporary folder)."""
    lc, _ = llama_cpp
    files = llamacpp_build.gguf_files(lc, checkpoint, "tiny-llama", ["f32", *TYPES.values()], log=_quiet,
                                      root=tmp_path_factory.mktemp("llamacpp_gguf"))
    return {"F32": files["f32"], **{t: files[key] for t, key in TYPES.items()}}


PROMPT_LENGTHS = (1, 5, 17, 40, 64, 9, 30, 3)


def both_engines(tool: Path, path: Path) -> list[tuple[list[int], list[int], list[tuple[int, float]]]]:
    """(prompt, pyengine's greedy tokens, llama.cpp's (token, top-2 gap)) per prompt."""
    engine = Engine(str(path), max_seq_len=128, kv_cache_config=F16_KV)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENGTHS]
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=GENERATED, ignore_eos=True),
                              use_tqdm=False)
    stats = engine.stats()  # every slot and KV block back in its pool
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_free_slots"] == stats["num_slots"]
    out = []
    for p, r in zip(prompts, results):
        ref = llama_cpp_greedy(tool, path, p, GENERATED)
        assert len(r.token_ids) == len(ref) == GENERATED
        out.append((p, r.token_ids, ref))
    return out


def parting_step(ours: list[int], ref: list[tuple[int, float]]) -> int | None:
    return next((i for i, (t, (rt, _)) in enumerate(zip(ours, ref)) if t != rt), None)


def llama_cpp_greedy(tool: Path, model: Path, prompt: list[int], n: int) -> list[tuple[int, float]]:
    cmd = [str(tool), str(model), str(n), "2", *map(str, prompt)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode < 0:  # killed by a signal: llama.cpp's AMX repacking crashes on some AMX CPUs
        r = subprocess.run(cmd, capture_output=True, text=True,
                           env={**os.environ, llamacpp_build.NO_REPACK_ENV: "0"})
    if r.returncode < 0:  # again: is it llama.cpp itself, on this CPU and file?
        bench, _ = llamacpp_build.run_tool([tool.parent / "llama-bench", "-m", model, "-p", 8, "-n", 4, "-t", 2],
                                           capture_output=True, text=True)
        if bench.returncode < 0:
            pytest.skip(f"llama.cpp itself crashes on {model.name} on this CPU (its own llama-bench dies of signal "
                        f"{-bench.returncode} too, with and without repacking): no reference to compare with")
    assert r.returncode == 0, r.stderr[-2000:]
    return [(int(a), float(b)) for a, b in (line.split() for line in r.stdout.splitlines())]


@pytest.mark.parametrize("qtype", list(TYPES))
def test_llama_quantize_files_hold_the_blocks_of_quantize_on_load(gguf_files, checkpoint, qtype):
    """Every tensor of llama-quantize's file has the type and, byte for byte, the blocks that
    Engine(checkpoint, quantization=...) makes of the checkpoint: pyengine's mixtures follow
    llama.cpp's rules and its quantizers are llama.cpp's reference ones."""
    formats = assert_file_holds_quantize_on_load_blocks(gguf_files[qtype], checkpoint, TYPES[qtype])
    assert formats == {"Q8_0": {"q8_0"}, "Q4_0": {"q4_0", "q6_k"}, "Q4_K_S": {"q4_k", "q5_k", "q6_k"},
                       "Q4_K_M": {"q4_k", "q6_k"}, "Q5_K_S": {"q5_k", "q6_k"}, "Q5_K_M": {"q5_k", "q6_k"}}[qtype]


def test_float_file_gives_llama_cpps_tokens_exactly(llama_cpp, gguf_files):
    _, tool = llama_cpp
    parted = [(len(p), parting_step(ours, ref)) for p, ours, ref in both_engines(tool, gguf_files["F32"])
              if parting_step(ours, ref) is not None]
    assert not parted, f"(prompt len, step) where pyengine parts from llama.cpp: {parted}"


@pytest.mark.parametrize("qtype", list(TYPES))
def test_greedy_tokens_equal_llama_cpps(llama_cpp, gguf_files, checkpoint, qtype):
    _, tool = llama_cpp
    runs = both_engines(tool, gguf_files[qtype])
    parted = [(p, ours, ref, at) for p, ours, ref in runs if (at := parting_step(ours, ref)) is not None]
    if not parted:
        return
    report = Engine(checkpoint, quantization=TYPES[qtype], max_seq_len=128)._parts.quant_plan.report
    reference = quantized_hf_model(checkpoint, report)
    float_acts = quantized_hf_model(checkpoint, report, quantize_activations=False)
    # where the kernels have their AMX path, pyengine computes the 8 prompts with it (llama.cpp, and
    # the reference, with 8-bit activations): its logits move by that path's difference too
    amx = quantized_hf_model(checkpoint, report, amx_prompt=True) if _core._cpu_amx() else None
    beyond = []
    for p, ours, ref, at in parted:
        prefix = ours[:at]
        gap_ours, noise = quantized_teacher_forced_gaps(reference, float_acts, p, prefix + [ours[at]])
        gap_ref, _ = quantized_teacher_forced_gaps(reference, float_acts, p, prefix + [ref[at][0]])
        if amx is not None:
            noise[-1] += quantized_teacher_forced_gaps(reference, amx, p, prefix + [ours[at]])[1][-1]
        if max(gap_ours[-1], gap_ref[-1]) > noise[-1]:
            beyond.append((len(p), at, round(gap_ours[-1], 5), round(gap_ref[-1], 5), round(noise[-1], 5)))
    assert not beyond, ("steps where pyengine parts from llama.cpp beyond the activation quantization's noise "
                        f"(prompt len, step, pyengine's gap, llama.cpp's gap, noise): {beyond}")
