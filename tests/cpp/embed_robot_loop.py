"""ctest example_robot_loop: the C++ robot loop (examples/cpp/robot_loop.cpp, the engine embedded
through pyengine/embed.hpp) streams the same greedy tokens as the Python engine for the same
request, cancels its second request with finish_reason "abort", and steps once per tick.

    python tests/cpp/embed_robot_loop.py path/to/robot_loop

Run with the python whose environment has pyengine installed; the robot loop embeds that same
python (PYENGINE_PYTHON).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

PROMPT = 'The "for" statement'
MAX_TOKENS = 24
ABORT_AFTER = 8


def python_tokens() -> list[int]:
    """The Python engine's tokens for the robot loop's streamed request (its sampling options)."""
    from pyengine import Engine, SamplingParams
    from pyengine.cli import DEMO_MODEL_DIR

    params = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=MAX_TOKENS)
    with Engine(DEMO_MODEL_DIR) as engine:
        (out,) = engine.generate([PROMPT], params, use_tqdm=False)
    return out.token_ids


def main() -> int:
    robot_loop = sys.argv[1]
    try:
        import pyengine  # noqa: F401
    except ImportError as e:
        print(f"FAILED: pyengine is not importable by {sys.executable} ({e}): pip install -e . into the "
              "environment of the python that configured the build (CMake's Python_EXECUTABLE)")
        return 1
    env = dict(os.environ, PYENGINE_PYTHON=os.environ.get("PYENGINE_PYTHON", sys.executable))
    run = subprocess.run([robot_loop, "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS),
                          "--abort-after", str(ABORT_AFTER), "--print-tokens"],
                         env=env, capture_output=True, text=True, timeout=600)
    print(run.stdout, end="")
    print(run.stderr, end="", file=sys.stderr)
    if run.returncode != 0:
        print(f"FAILED: robot_loop exited with {run.returncode}")
        return 1
    failures = []
    tokens_line = [line for line in run.stdout.splitlines() if line.startswith("TOKENS")]
    got = [int(t) for t in tokens_line[0].split()[1:]] if len(tokens_line) == 1 else None
    want = python_tokens()
    if got != want:
        failures.append(f"robot_loop's tokens {got} != the Python engine's {want}")
    if not re.search(rf"^tick +{ABORT_AFTER} .* request 1 abort after \d+ tokens( |$)", run.stdout, re.M):
        failures.append(f"no line says that request 1 ended with abort at tick {ABORT_AFTER}")
    ticks = re.findall(r"^tick +(\d+) +step +[\d.]+ ms", run.stdout, re.M)
    if [int(t) for t in ticks] != list(range(len(ticks))) or len(ticks) < MAX_TOKENS:
        failures.append(f"expected one numbered line per tick, at least {MAX_TOKENS}: got {ticks}")
    if not re.search(r"^steps \d+: mean [\d.]+ ms, p50 [\d.]+ ms, p99 [\d.]+ ms, max [\d.]+ ms; ticks overrun \d+",
                     run.stdout, re.M):
        failures.append("no summary line")
    for f in failures:
        print("FAILED:", f)
    if not failures:
        print(f"OK: robot_loop's {len(got)} tokens equal the Python engine's")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
