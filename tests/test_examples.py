"""The Python example runs to completion and shows the engine working."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_control_loop_example(tmp_path):
    env = {**os.environ, "PYENGINE_CHECKPOINT_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, str(REPO / "examples" / "control_loop.py"), "--ticks", "300"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    reasons = re.findall(r"request (\d+) finished \((\w+), (\d+) tokens\)", done.stdout)
    by_request = {int(rid): reason for rid, reason, _ in reasons}
    assert len(by_request) == 3
    assert by_request[2] == "abort"  # cancelled at tick 10
    assert by_request[0] == "length" and by_request[1] in ("length", "stop")
    assert "'num_free_blocks': " in done.stdout and "'num_free_slots': 4" in done.stdout


def test_control_loop_example_on_a_model_with_fewer_positions(checkpoint_factory):
    """--model DIR whose max_position_embeddings (128) is below the example's 512: max_seq_len
    follows the model, or --max-seq-len."""
    model = checkpoint_factory("llama_128_positions", model_type="llama", max_position_embeddings=128)
    for extra in ([], ["--max-seq-len", "100"]):
        done = subprocess.run([sys.executable, str(REPO / "examples" / "control_loop.py"), "--model", str(model),
                               "--ticks", "300", *extra], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        reasons = dict(re.findall(r"request (\d+) finished \((\w+), \d+ tokens\)", done.stdout))
        assert reasons.get("2") == "abort" and reasons.get("0") == "length", done.stdout
