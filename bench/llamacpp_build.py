"""llama.cpp for ``bench/llamacpp.py``: fetch, build, convert — all cached.

- **Fetch**: the ``llama-cpp-python`` source distribution from PyPI (``pip download
  --no-deps --no-binary :all: llama-cpp-python==VERSION``); it vendors a llama.cpp tree
  (``vendor/llama.cpp``) pinned to one llama.cpp commit, named in its CHANGELOG.
- **Build**: a CMake Release build of that tree for this CPU (``GGML_NATIVE=ON``, CPU
  backend only, static libraries), of the two benchmark tools only: ``llama-bench`` and
  ``llama-batched-bench``. A stamp file (``build/pyengine-stamp.json``) records the version,
  the CMake arguments and the CPU; a build whose stamp matches is reused.
- **Convert**: the benchmark checkpoint (fp32 safetensors) to GGUF in f32 and bf16 with the
  tree's own ``convert_hf_to_gguf.py``, run through a small wrapper (``--convert`` below)
  that declares the benchmark tokenizer's pre-tokenizer as ``gpt-2`` (a byte-level BPE the
  converter does not know by hash) and treats a missing ``sentencepiece`` package like a
  missing ``tokenizer.model``. The cached tree itself is never modified.

Layout under the cache root (``--cache-dir``, else ``$PYENGINE_LLAMACPP_CACHE``, else
``~/.cache/pyengine/llamacpp``)::

    <root>/<version>/src/llama_cpp_python-<version>/   the unpacked sdist
    <root>/<version>/build/bin/llama-bench, llama-batched-bench
    <root>/<version>/build/pyengine-stamp.json
    <root>/<version>/gguf/<checkpoint>-<digest>/model-f32.gguf, model-bf16.gguf

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
TOOLS = ("llama-bench", "llama-batched-bench")
STAMP = "pyengine-stamp.json"
CONVERT_SCHEME = 1  # bump when the conversion wrapper changes what it writes
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


def cmake_args(commit: str | None) -> list[str]:
    args = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
            "-DBUILD_SHARED_LIBS=OFF", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF",
            "-DGGML_HIP=OFF", "-DGGML_SYCL=OFF", "-DGGML_OPENCL=OFF", "-DGGML_RPC=OFF",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
            "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_NUMBER=0"]
    if commit:
        args.append(f"-DLLAMA_BUILD_COMMIT={commit}")
    return args


def _stamp_key(version: str, commit: str | None, args: list[str]) -> dict:
    from bench.common import cpu_model  # noqa: PLC0415 (bench.common imports torch)

    return {"llama_cpp_python": version, "llama_cpp_commit": commit, "cmake_args": args, "targets": list(TOOLS),
            "cpu": cpu_model(), "cpu_flags": cpu_flags()}


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def build(root: Path, version: str = DEFAULT_VERSION, jobs: int = 2, log: Log = print,
          trust_cache: bool = False) -> LlamaCpp:
    """The built llama.cpp tools of llama-cpp-python ``version`` under ``root``: reused when
    the build stamp matches (or, with ``trust_cache``, whenever the tools exist — no network),
    fetched and built otherwise."""
    if trust_cache:
        build_dir = root / version / "build"
        stamp = _read_json(build_dir / STAMP) or {}
        src = root / version / "src" / f"llama_cpp_python-{version}"
        lc = LlamaCpp(version, version, stamp.get("llama_cpp_commit"), src / "vendor" / "llama.cpp", build_dir, stamp)
        missing = [t for t in TOOLS if not lc.tool(t).is_file()] + ([] if lc.tree.is_dir() else [str(lc.tree)])
        if missing:
            raise RuntimeError(f"--skip-build-check: no cached build at {build_dir} ({', '.join(missing)} missing)")
        return lc

    requested = version
    version, sdist = fetch(root, version, log)
    commit = llama_cpp_commit(sdist, version)
    tree, build_dir = sdist / "vendor" / "llama.cpp", root / version / "build"
    args = cmake_args(commit)
    key = _stamp_key(version, commit, args)
    lc = LlamaCpp(version, requested, commit, tree, build_dir)
    stamp = _read_json(build_dir / STAMP)
    if stamp is not None and stamp.get("key") == key and all(lc.tool(t).is_file() for t in TOOLS):
        lc.stamp = stamp
        return lc
    if stamp is not None:  # built with other settings (or for another CPU): start over
        shutil.rmtree(build_dir, ignore_errors=True)
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake is needed to build llama.cpp (and a C/C++ compiler)")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    t0 = time.perf_counter()
    log(f"building llama.cpp {commit or '(unknown commit)'} from llama-cpp-python {version} "
        f"into {build_dir} (-j {jobs}) ...")
    configure = ["cmake", "-S", tree, "-B", build_dir, *gen, *args]
    r = _run(configure, log, capture_output=True, text=True)
    if r.returncode != 0 and build_dir.exists():  # e.g. an interrupted build with another generator
        shutil.rmtree(build_dir, ignore_errors=True)
        r = _run(configure, log, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"CMake configure failed:\n{(r.stdout + r.stderr)[-4000:]}")
    r = _run(["cmake", "--build", build_dir, "--config", "Release", "-j", str(jobs), "--target", *TOOLS],
             log, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"llama.cpp build failed:\n{(r.stdout + r.stderr)[-4000:]}")
    seconds = time.perf_counter() - t0
    cache = (build_dir / "CMakeCache.txt").read_text(errors="replace")
    cxx = re.search(r"^CMAKE_CXX_COMPILER:\w+=(.*)$", cache, re.M)
    compiler = None
    if cxx:
        v = subprocess.run([cxx.group(1), "--version"], capture_output=True, text=True)
        compiler = v.stdout.splitlines()[0] if v.returncode == 0 and v.stdout else cxx.group(1)
    lc.stamp = {"key": key, "compiler": compiler, "build_seconds": round(seconds, 1), "jobs": jobs,
                "built": _dt.datetime.now().isoformat(timespec="seconds"),
                "configure_command": " ".join(str(c) for c in configure)}
    (build_dir / STAMP).write_text(json.dumps(lc.stamp, indent=1))  # last: a stamped build is complete
    log(f"built in {seconds:.0f} s")
    return lc


# --------------------------------------------------------------------------------------
# Convert
# --------------------------------------------------------------------------------------


def gguf_files(lc: LlamaCpp, checkpoint: Path, name: str, outtypes: list[str], log: Log = print) -> dict[str, Path]:
    """{outtype: GGUF file} of the checkpoint, converted once per checkpoint content (its
    digest) and llama.cpp version, and reused afterwards."""
    from bench.common import checkpoints  # noqa: PLC0415

    digest = checkpoints.checkpoint_digest(checkpoint)[:16]
    folder = lc.gguf_root / f"{name}-{digest}"
    folder.mkdir(parents=True, exist_ok=True)
    info_path = folder / "conversions.json"
    info = _read_json(info_path) or {}
    out = {}
    for t in outtypes:
        path = folder / f"model-{t}.gguf"
        rec = info.get(t, {})
        if not (path.is_file() and rec.get("scheme") == CONVERT_SCHEME):
            tmp = folder / f".model-{t}.gguf.tmp"
            cmd = [sys.executable, Path(__file__).resolve(), "--convert", lc.tree, "--", checkpoint,
                   "--outtype", t, "--outfile", tmp]
            t0 = time.perf_counter()
            log(f"converting {name} to GGUF {t} ...")
            r = _run(cmd, log, capture_output=True, text=True)
            if r.returncode != 0 or not tmp.is_file():
                raise RuntimeError(f"GGUF conversion ({t}) failed:\n{(r.stdout + r.stderr)[-4000:]}")
            os.replace(tmp, path)
            rec = {"scheme": CONVERT_SCHEME, "seconds": round(time.perf_counter() - t0, 1),
                   "command": " ".join(str(c) for c in cmd[:1] + ["bench/llamacpp_build.py"] + cmd[2:-1]) + " " + path.name,
                   "bytes": path.stat().st_size, "checkpoint": str(checkpoint)}
            info[t] = rec
            info_path.write_text(json.dumps(info, indent=1))
            log(f"  {path} ({rec['bytes'] / 1e6:.0f} MB) in {rec['seconds']:.1f} s")
        out[t] = path
    return out


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
