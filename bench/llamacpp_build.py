"""llama.cpp for ``bench/llamacpp.py``: fetch, build, convert — all cached.

- **Fetch**: the ``llama-cpp-python`` source distribution from PyPI (``pip download
  --no-deps --no-binary :all: llama-cpp-python==VERSION``); it vendors a llama.cpp tree
  (``vendor/llama.cpp``) pinned to one llama.cpp commit, named in its CHANGELOG.
- **Build**: a CMake Release build of that tree for this CPU (``GGML_NATIVE=ON``, CPU
  backend only, static libraries), of the tools the benchmarks run only (``TOOLS``:
  ``llama-bench``, ``llama-batched-bench``, ``llama-quantize``, ``llama-perplexity``). A stamp
  file (``build/pyengine-stamp.json``) records the version, the CMake arguments, the CPU and
  the tools built; a build whose stamp matches is reused, tools missing from a build with the
  same configuration are added to it (an incremental build of those targets), and a build
  with another configuration is redone from scratch.
- **Convert**: the benchmark checkpoint (safetensors) to GGUF in f32 and bf16 with the
  tree's own ``convert_hf_to_gguf.py``, run through a small wrapper (``--convert`` below)
  that declares the benchmark tokenizer's pre-tokenizer as ``gpt-2`` (a byte-level BPE the
  converter does not know by hash) and treats a missing ``sentencepiece`` package like a
  missing ``tokenizer.model``. The cached tree itself is never modified.
- **Quantize**: the f32 GGUF to Q8_0, Q4_0 and Q4_K_M with the tree's own ``llama-quantize``
  (no importance matrix), cached next to it.

Layout under the cache root (``--cache-dir``, else ``$PYENGINE_LLAMACPP_CACHE``, else
``~/.cache/pyengine/llamacpp``)::

    <root>/<version>/src/llama_cpp_python-<version>/   the unpacked sdist
    <root>/<version>/build/bin/llama-bench, llama-batched-bench, llama-quantize, llama-perplexity
    <root>/<version>/build/pyengine-stamp.json
    <root>/<version>/gguf/<checkpoint>-<digest>/model-f32.gguf, model-bf16.gguf,
        model-q8_0.gguf, model-q4_0.gguf, model-q4_k_m.gguf, conversions.json

Depends on the standard library only (plus, for ``--convert``, what the converter imports:
torch, numpy, transformers, pyyaml, tqdm).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

DEFAULT_VERSION = "0.3.36"
CACHE_ENV = "PYENGINE_LLAMACPP_CACHE"
TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize", "llama-perplexity")
STAMP = "pyengine-stamp.json"
CONVERT_SCHEME = 1  # bump when the conversion wrapper changes what it writes
# GGUF types made from the f32 GGUF by llama-quantize: file suffix -> llama-quantize's type name
QUANTIZED_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k_s": "Q4_K_S", "q4_k_m": "Q4_K_M", "q5_k_s": "Q5_K_S",
                   "q5_k_m": "Q5_K_M"}
# tensor types llama-quantize may give the output projection (--output-tensor-type) that pyengine
# also has (its lm_head_quantization=)
OUTPUT_TENSOR_TYPES = ("q8_0", "q5_0", "q5_1", "q4_0", "q4_k", "q5_k", "q6_k")
INTERESTING_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512dq",
    "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16",  # x86
    "asimd", "asimddp", "sve", "sve2", "bf16", "i8mm", "sme",  # aarch64 (/proc/cpuinfo "Features")
)

Log = Callable[[str], None]


def default_cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "pyengine" / "llamacpp"


def cpu_flags() -> list[str]:
    """The instruction-set features of INTERESTING_FLAGS this CPU has (from /proc/cpuinfo)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key = line.split(":", 1)[0].strip()
            if key in ("flags", "Features"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in INTERESTING_FLAGS if f in have]
    except OSError:
        pass
    return []


# llama.cpp repacks weights at load into layouts of its "extra buffer types" (on x86: its AMX
# layout where the CPU has AMX-INT8, else the AVX2 interleaved one). On some AMX machines
# (Sapphire Rapids-class Xeons, KVM guests among them) its AMX matrix product crashes
# (SIGSEGV in ggml_backend_amx_mul_mat; llama.cpp issue 20824, closed without a fix). A tool
# killed by a signal is therefore run once more with repacking off, and the figures say so.
NO_REPACK_ARGS = {"llama-bench": ["--repack", "0"], "llama-batched-bench": ["--no-repack"],
                  "llama-perplexity": ["--no-repack"]}
NO_REPACK_ENV = "PYENGINE_LLAMACPP_REPACK"  # "0": bench/cpp/llamacpp_greedy.cpp loads without repacking


def run_tool(cmd: list, **kw) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Runs a llama.cpp tool (NO_REPACK_ARGS' keys); if a signal kills it, once more with weight
    repacking off (unless `cmd` has it off already: a command run_tool returned). Returns the
    last run's result and the command it ran."""
    cmd = [str(c) for c in cmd]
    r = subprocess.run(cmd, **kw)
    extra = NO_REPACK_ARGS.get(Path(cmd[0]).name)
    if r.returncode < 0 and extra is not None and not repack_off(cmd):
        cmd = cmd + extra
        r = subprocess.run(cmd, **kw)
    return r, cmd


def repack_off(cmd: list[str]) -> bool:
    """Whether run_tool fell back to no repacking for `cmd` (the command it returned)."""
    extra = NO_REPACK_ARGS.get(Path(cmd[0]).name)
    return extra is not None and cmd[-len(extra):] == extra


def _run(cmd: list[str], log: Log, **kw) -> subprocess.CompletedProcess:
    log("$ " + " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], **kw)


# --------------------------------------------------------------------------------------
# Fetch
# --------------------------------------------------------------------------------------


def _download_sdist(version: str | None, dest: Path, log: Log) -> Path | None:
    spec = f"llama-cpp-python=={version}" if version else "llama-cpp-python"
    r = _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check",
              "-d", dest, spec], log, capture_output=True, text=True)
    if r.returncode != 0:
        log((r.stdout + r.stderr).strip().splitlines()[-1] if (r.stdout + r.stderr).strip() else "pip failed")
        return None
    found = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    return found[-1] if found else None


def fetch(root: Path, version: str, log: Log) -> tuple[str, Path]:
    """(version, unpacked sdist folder). Downloads ``llama-cpp-python==version``; if that is
    not available, the newest version (the caller reports the difference)."""
    src = root / version / "src" / f"llama_cpp_python-{version}"
    if (src / ".unpacked").is_file():
        return version, src
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=root) as tmp:
        log(f"downloading the llama-cpp-python {version} sdist from PyPI ...")
        tarball = _download_sdist(version, Path(tmp), log)
        if tarball is None:
            log(f"llama-cpp-python=={version} is not available as an sdist; trying the newest version")
            tarball = _download_sdist(None, Path(tmp), log)
            if tarball is None:
                raise RuntimeError("could not download the llama-cpp-python sdist (network access to PyPI needed)")
        version = re.fullmatch(r"llama_cpp_python-(.+)\.tar\.gz", tarball.name).group(1)
        src = root / version / "src" / f"llama_cpp_python-{version}"
        if (src / ".unpacked").is_file():
            return version, src
        unpack = Path(tempfile.mkdtemp(prefix=".unpack-", dir=root))
        try:
            with tarfile.open(tarball) as tf:
                if hasattr(tarfile, "data_filter"):
                    tf.extractall(unpack, filter="data")
                else:  # Python without extraction filters (< 3.11.4)
                    tf.extractall(unpack)
            top = unpack / f"llama_cpp_python-{version}"
            if not (top / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
                raise RuntimeError(f"{tarball.name} has no vendor/llama.cpp tree")
            (top / ".unpacked").write_text(tarball.name + "\n")
            src.parent.mkdir(parents=True, exist_ok=True)
            if src.exists():
                shutil.rmtree(src)
            os.rename(top, src)
        finally:
            shutil.rmtree(unpack, ignore_errors=True)
    return version, src


def llama_cpp_commit(sdist: Path, version: str) -> str | None:
    """The llama.cpp commit the sdist vendors, from its CHANGELOG ("update llama.cpp to
    ggml-org/llama.cpp@<hash>" under the version's heading), if named there."""
    try:
        text = (sdist / "CHANGELOG.md").read_text(encoding="utf-8")
    except OSError:
        return None
    m = re.search(rf"^## \[{re.escape(version)}\](.*?)(?=^## \[|\Z)", text, re.S | re.M)
    hit = re.search(r"llama\.cpp@([0-9a-f]{7,40})", m.group(1)) if m else None
    return hit.group(1) if hit else None


# --------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------


@dataclass
class LlamaCpp:
    version: str  # llama-cpp-python's
    requested_version: str
    commit: str | None  # the vendored llama.cpp's
    tree: Path  # vendor/llama.cpp
    build_dir: Path
    stamp: dict = field(default_factory=dict)

    def tool(self, name: str) -> Path:
        return self.build_dir / "bin" / name

    @property
    def gguf_root(self) -> Path:
        return self.build_dir.parent / "gguf"


# ggml's instruction-set options for a build that runs as a CPU of an emulated level would
# (bench/common.py EMULATED_CPU_LEVELS) instead of GGML_NATIVE's "everything this CPU has": "avx2"
# is AVX2 + FMA + F16C (+ BMI2), no AVX-VNNI, AVX-512 or AMX -- an AMD EPYC before Zen 4. ggml
# then also repacks weights as it does there (its AVX2 interleaved layouts, not AMX's).
LEVEL_ISA_ARGS: dict[str, list[str]] = {
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
             "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF",
             "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF",
             "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"],
}


def build_dir_name(level: str | None) -> str:
    """The build folder under the version's: "build" for this CPU, "build-LEVEL" for a level."""
    return "build" if level is None else f"build-{level}"


def cmake_args(commit: str | None, level: str | None = None) -> list[str]:
    """The CMake configuration: for this CPU (GGML_NATIVE), or for ``level`` (LEVEL_ISA_ARGS)."""
    if level is not None and level not in LEVEL_ISA_ARGS:
        raise ValueError(f"unknown CPU level {level!r} for the llama.cpp build; one of {', '.join(LEVEL_ISA_ARGS)}")
    isa = ["-DGGML_NATIVE=ON"] if level is None else LEVEL_ISA_ARGS[level]
    args = ["-DCMAKE_BUILD_TYPE=Release", *isa, "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
            "-DBUILD_SHARED_LIBS=OFF", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF",
            "-DGGML_HIP=OFF", "-DGGML_SYCL=OFF", "-DGGML_OPENCL=OFF", "-DGGML_RPC=OFF",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
            "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_NUMBER=0"]
    if commit:
        args.append(f"-DLLAMA_BUILD_COMMIT={commit}")
    return args


def _stamp_key(version: str, commit: str | None, args: list[str]) -> dict:
    """What the build folder's configuration depends on (the tools built are recorded apart:
    adding a tool to a build of the same configuration does not start it over)."""
    from bench.common import cpu_model  # noqa: PLC0415 (bench.common imports torch)

    return {"llama_cpp_python": version, "llama_cpp_commit": commit, "cmake_args": args,
            "cpu": cpu_model(), "cpu_flags": cpu_flags()}


def stamp_state(stamp: dict | None, key: dict, tools: tuple[str, ...] | list[str] = TOOLS) -> tuple[str, list[str]]:
    """What a build with this ``stamp`` needs for ``tools`` under configuration ``key``:
    ("ok", []) reuse it; ("add", missing tools) build those targets in the same folder;
    ("rebuild", all tools) start over (no stamp, or another configuration). A stamp of an
    older version of this script kept the targets inside its key; it is read the same way."""
    if not stamp or not isinstance(stamp.get("key"), dict):
        return "rebuild", list(tools)
    old_key = dict(stamp["key"])
    built = stamp.get("targets", old_key.pop("targets", []))
    old_key.pop("targets", None)
    if old_key != key:
        return "rebuild", list(tools)
    missing = [t for t in tools if t not in built]
    return ("add", missing) if missing else ("ok", [])


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def build(root: Path, version: str = DEFAULT_VERSION, jobs: int = 2, log: Log = print,
          trust_cache: bool = False, level: str | None = None) -> LlamaCpp:
    """The built llama.cpp tools (``TOOLS``) of llama-cpp-python ``version`` under ``root``:
    reused when the build stamp matches (or, with ``trust_cache``, whenever the tools exist --
    no network); tools missing from a build of the same configuration are added to it; fetched
    and built from scratch otherwise. ``level``: built for that emulated CPU level instead of
    this CPU (cmake_args), in a folder of its own; the GGUF files are shared."""
    if trust_cache:
        build_dir = root / version / build_dir_name(level)
        stamp = _read_json(build_dir / STAMP) or {}
        src = root / version / "src" / f"llama_cpp_python-{version}"
        commit = stamp.get("key", {}).get("llama_cpp_commit")
        lc = LlamaCpp(version, version, commit, src / "vendor" / "llama.cpp", build_dir, stamp)
        missing = [t for t in TOOLS if not lc.tool(t).is_file()] + ([] if lc.tree.is_dir() else [str(lc.tree)])
        if missing:
            raise RuntimeError(f"--skip-build-check: no cached build at {build_dir} ({', '.join(missing)} missing)")
        return lc

    requested = version
    version, sdist = fetch(root, version, log)
    commit = llama_cpp_commit(sdist, version)
    tree, build_dir = sdist / "vendor" / "llama.cpp", root / version / build_dir_name(level)
    args = cmake_args(commit, level)
    key = _stamp_key(version, commit, args)
    lc = LlamaCpp(version, requested, commit, tree, build_dir)
    stamp = _read_json(build_dir / STAMP)
    state, targets = stamp_state(stamp, key)
    if state != "rebuild" and not all(lc.tool(t).is_file() for t in TOOLS if t not in targets):
        state, targets = "rebuild", list(TOOLS)  # the stamp names a tool that is gone
    if state == "ok":
        lc.stamp = stamp
        return lc
    if state == "rebuild" and stamp is not None:  # built with other settings (or for another CPU): start over
        shutil.rmtree(build_dir, ignore_errors=True)
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake is needed to build llama.cpp (and a C/C++ compiler)")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    t0 = time.perf_counter()
    configure = ["cmake", "-S", tree, "-B", build_dir, *gen, *args]
    if state == "add":
        log(f"adding {', '.join(targets)} to the llama.cpp build in {build_dir} (-j {jobs}) ...")
    else:
        log(f"building llama.cpp {commit or '(unknown commit)'} from llama-cpp-python {version} "
            f"into {build_dir} (-j {jobs}) ...")
        r = _run(configure, log, capture_output=True, text=True)
        if r.returncode != 0 and build_dir.exists():  # e.g. an interrupted build with another generator
            shutil.rmtree(build_dir, ignore_errors=True)
            r = _run(configure, log, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"CMake configure failed:\n{(r.stdout + r.stderr)[-4000:]}")
    r = _run(["cmake", "--build", build_dir, "--config", "Release", "-j", str(jobs), "--target", *targets],
             log, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"llama.cpp build failed:\n{(r.stdout + r.stderr)[-4000:]}")
    seconds = time.perf_counter() - t0
    if state == "add":
        old_key = dict(stamp["key"])
        built = stamp.get("targets", old_key.pop("targets", []))
        lc.stamp = {**stamp, "key": key, "targets": list(dict.fromkeys([*built, *targets])),
                    "added": [*stamp.get("added", []),
                              {"targets": targets, "seconds": round(seconds, 1),
                               "built": _dt.datetime.now().isoformat(timespec="seconds")}]}
    else:
        cache = (build_dir / "CMakeCache.txt").read_text(errors="replace")
        cxx = re.search(r"^CMAKE_CXX_COMPILER:\w+=(.*)$", cache, re.M)
        compiler = None
        if cxx:
            v = subprocess.run([cxx.group(1), "--version"], capture_output=True, text=True)
            compiler = v.stdout.splitlines()[0] if v.returncode == 0 and v.stdout else cxx.group(1)
        lc.stamp = {"key": key, "targets": list(TOOLS), "compiler": compiler, "build_seconds": round(seconds, 1),
                    "jobs": jobs, "built": _dt.datetime.now().isoformat(timespec="seconds"),
                    "configure_command": " ".join(str(c) for c in configure)}
    (build_dir / STAMP).write_text(json.dumps(lc.stamp, indent=1))  # last: a stamped build is complete
    log(f"built in {seconds:.0f} s")
    return lc


# --------------------------------------------------------------------------------------
# Convert
# --------------------------------------------------------------------------------------


def quantized_key(outtype: str, output_type: str | None) -> str:
    """The file-name and conversions.json key of GGUF type ``outtype`` whose output projection
    llama-quantize makes ``output_type`` (None: its own choice, the plain ``outtype``)."""
    if output_type is None or outtype not in QUANTIZED_TYPES:
        return outtype
    return f"{outtype}.output-{output_type}"


def output_type_args(checkpoint: Path, output_type: str | None) -> list[str]:
    """llama-quantize's options giving the output projection ``output_type``: the output tensor,
    or, for a model whose embedding table is its output projection (tie_word_embeddings; the GGUF
    then has no output tensor), the table -- as pyengine's lm_head_quantization= does."""
    if output_type is None:
        return []
    if output_type not in OUTPUT_TENSOR_TYPES:
        raise ValueError(f"output tensor type {output_type!r}: not one of {', '.join(OUTPUT_TENSOR_TYPES)}")
    config = _read_json(checkpoint / "config.json") or {}
    flag = "--token-embedding-type" if config.get("tie_word_embeddings", False) else "--output-tensor-type"
    return [flag, output_type]


def gguf_files(lc: LlamaCpp, checkpoint: Path, name: str, outtypes: list[str], log: Log = print,
               threads: int = 2, root: Path | None = None, output_type: str | None = None) -> dict[str, Path]:
    """{outtype: GGUF file} of the checkpoint, converted once per checkpoint content (its
    digest) and llama.cpp version, and reused afterwards (kept under ``root``, by default the
    build's ``gguf`` folder). ``outtypes``: the converter's ``f32``/``bf16``, or a key of
    ``QUANTIZED_TYPES`` (``q8_0``, ``q4_0``, ``q4_k_s``, ``q4_k_m``, ...): the f32 file quantized
    by ``llama-quantize`` (with ``threads`` threads), made again whenever the f32 file is.
    ``output_type``: the quantized files' output projection in that type (output_type_args;
    files of their own, quantized_key)."""
    from bench.common import checkpoints  # noqa: PLC0415

    digest = checkpoints.checkpoint_digest(checkpoint)[:16]
    folder = (root or lc.gguf_root) / f"{name}-{digest}"
    folder.mkdir(parents=True, exist_ok=True)
    info_path = folder / "conversions.json"
    info = _read_json(info_path) or {}
    out = {}
    wanted = list(dict.fromkeys(outtypes))
    if any(t in QUANTIZED_TYPES for t in wanted) and "f32" not in wanted:
        wanted.insert(0, "f32")  # the quantizer's input
    wanted.sort(key=lambda t: t in QUANTIZED_TYPES)  # converted types first
    for t in wanted:
        if t not in QUANTIZED_TYPES and t not in ("f32", "bf16", "f16"):
            raise ValueError(f"unknown GGUF type {t!r}")
        key = quantized_key(t, output_type)
        path = folder / f"model-{key}.gguf"
        rec = info.get(key, {})
        tmp = folder / f".model-{key}.gguf.tmp"
        if t in QUANTIZED_TYPES:
            src = out["f32"]
            fresh = path.is_file() and rec.get("scheme") == CONVERT_SCHEME and \
                rec.get("source_mtime_ns") == src.stat().st_mtime_ns
            options = output_type_args(checkpoint, output_type)
            cmd = [lc.tool("llama-quantize"), *options, src, tmp, QUANTIZED_TYPES[t], threads]
            what = f"quantizing {name} to GGUF {QUANTIZED_TYPES[t]} with llama-quantize" + (
                f" {' '.join(options)}" if options else "")
        else:
            fresh = path.is_file() and rec.get("scheme") == CONVERT_SCHEME
            cmd = [sys.executable, Path(__file__).resolve(), "--convert", lc.tree, "--", checkpoint,
                   "--outtype", t, "--outfile", tmp]
            what = f"converting {name} to GGUF {t}"
        if not fresh:
            t0 = time.perf_counter()
            log(what + " ...")
            r = _run(cmd, log, capture_output=True, text=True)
            if r.returncode != 0 or not tmp.is_file():
                tmp.unlink(missing_ok=True)
                raise RuntimeError(f"{what} failed:\n{(r.stdout + r.stderr)[-4000:]}")
            os.replace(tmp, path)
            if t in QUANTIZED_TYPES:
                shown = [Path(cmd[0]).name, *options, src.name, path.name, QUANTIZED_TYPES[t], str(threads)]
                rec = {"source_mtime_ns": src.stat().st_mtime_ns}
            else:
                shown = [str(cmd[0]), "bench/llamacpp_build.py", *map(str, cmd[2:-1]), path.name]
                rec = {}
            rec.update({"scheme": CONVERT_SCHEME, "seconds": round(time.perf_counter() - t0, 1),
                        "command": " ".join(shown), "bytes": path.stat().st_size, "checkpoint": str(checkpoint)})
            info[key] = rec
            info_path.write_text(json.dumps(info, indent=1))
            log(f"  {path} ({rec['bytes'] / 1e6:.0f} MB) in {rec['seconds']:.1f} s")
        out[t] = path
    return {t: out[t] for t in outtypes}


GREEDY_SOURCE = Path(__file__).resolve().parent / "cpp" / "llamacpp_greedy.cpp"


def greedy_tool(lc: LlamaCpp, log: Log = print) -> Path:
    """``bench/cpp/llamacpp_greedy.cpp`` (greedy decoding through llama.cpp's C API, printing
    token ids) linked against the build's static libraries, as ``build/bin/pyengine-greedy``;
    compiled again when the source or the libraries are newer than it."""
    out = lc.build_dir / "bin" / "pyengine-greedy"
    libs = [lc.build_dir / "src" / "libllama.a"] + [lc.build_dir / "ggml" / "src" / f"lib{n}.a"
                                                    for n in ("ggml", "ggml-cpu", "ggml-base")]
    missing = [str(p) for p in libs if not p.is_file()]
    if missing:
        raise RuntimeError(f"no llama.cpp libraries to link: {', '.join(missing)} missing")
    newest = max(p.stat().st_mtime_ns for p in [GREEDY_SOURCE, *libs])
    if out.is_file() and out.stat().st_mtime_ns >= newest:
        return out
    cxx = os.environ.get("CXX", "c++")
    cmd = [cxx, "-std=c++17", "-O2", str(GREEDY_SOURCE), "-I", str(lc.tree / "include"), "-I",
           str(lc.tree / "ggml" / "include"), *map(str, libs), "-fopenmp", "-lpthread", "-ldl", "-lm",
           "-o", str(out) + ".tmp"]
    log(f"compiling {out.name} ...")
    r = _run(cmd, log, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"compiling {GREEDY_SOURCE.name} failed:\n{(r.stdout + r.stderr)[-4000:]}")
    os.replace(str(out) + ".tmp", out)
    return out


def gguf_tensor_types(path: Path, tree: Path | None = None) -> dict[str, int]:
    """How many tensors of each GGML type (``"Q4_K"``, ``"F32"``, ...) a GGUF file holds, read
    with the ``gguf`` package's GGUFReader (the installed package, else the copy in the
    llama.cpp ``tree``)."""
    try:
        from gguf import GGUFReader  # noqa: PLC0415
    except ImportError:
        if tree is None:
            raise
        sys.path.insert(0, str(Path(tree) / "gguf-py"))
        from gguf import GGUFReader  # noqa: PLC0415
    counts: dict[str, int] = {}
    for t in GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _convert_main(tree: Path, argv: list[str]) -> None:
    """Run ``tree/convert_hf_to_gguf.py argv`` with two adjustments, in this process only:
    the BPE pre-tokenizer is declared ``gpt-2`` (the benchmark tokenizer is a byte-level
    BPE whose hash the converter's table does not list), and without ``sentencepiece`` a
    checkpoint that has no ``tokenizer.model`` is treated as the converter treats it when
    the package is installed (FileNotFoundError: not a SentencePiece vocabulary)."""
    sys.path[:0] = [str(tree), str(tree / "gguf-py")]
    import conversion.base as base  # the tree's converter package

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    original = base.TextModel._create_vocab_sentencepiece

    def create_vocab_sentencepiece(self):
        if not (Path(self.dir_model) / "tokenizer.model").is_file():
            raise FileNotFoundError(f"File not found: {Path(self.dir_model) / 'tokenizer.model'}")
        return original(self)

    base.TextModel._create_vocab_sentencepiece = create_vocab_sentencepiece
    script = tree / "convert_hf_to_gguf.py"
    sys.argv = [str(script), *argv]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--convert" and sys.argv[3] == "--":
        _convert_main(Path(sys.argv[2]), sys.argv[4:])
    else:
        sys.exit("usage: llamacpp_build.py --convert LLAMA_CPP_TREE -- CONVERTER_ARGS (bench/llamacpp.py runs this)")
