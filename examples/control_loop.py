"""Driving pyengine from an application's own loop.

An embedded engine does not own the process: the application calls `engine.step()` when
it has time — here a fixed-rate "control loop" that does its own work each tick and gives
the engine one step per tick, streaming text as it arrives and cancelling a request that
runs too long.

    python examples/control_loop.py                 # a small random-weight model (meaningless text)
    python examples/control_loop.py --model DIR     # a local Hugging Face model directory

--max-seq-len (prompt + generated tokens per request) defaults to 512, or the model's
max_position_embeddings if that is smaller.
"""

from __future__ import annotations

import argparse
import time

from pyengine import Engine, SamplingParams, SchedulerConfig
from pyengine.models import ModelConfig
from pyengine.testing.checkpoints import cached_checkpoint

DEMO_MODEL = dict(model_type="llama", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=344, vocab_size=512, max_position_embeddings=512)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a local Hugging Face model directory")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="prompt + generated tokens per request (default: 512, or fewer if the model has fewer "
                             "positions)")
    parser.add_argument("--ticks", type=int, default=200)
    args = parser.parse_args()
    model = args.model or cached_checkpoint("example-llama", DEMO_MODEL)
    max_seq_len = args.max_seq_len or min(512, ModelConfig.from_model_dir(model).max_position_embeddings)
    room = max(1, max_seq_len - 64)  # generated tokens per request at most: 64 positions are left to the prompt

    with Engine(model, max_seq_len=max_seq_len, scheduler_config=SchedulerConfig(max_batch_size=4)) as engine:
        story = engine.add_request("Once upon a time",
                                   SamplingParams(temperature=0.8, seed=1, max_tokens=min(40, room)))
        plan = engine.add_request("Plan: move arm to",
                                  SamplingParams(temperature=0.0, max_tokens=min(24, room), stop=["."]))
        chatter = engine.add_request("Say something long",
                                     SamplingParams(max_tokens=min(400, room), ignore_eos=True))
        texts = {story: "", plan: "", chatter: ""}
        for tick in range(args.ticks):
            tick_start = time.perf_counter()
            # ... the application's own work for this tick goes here ...
            if tick == 10:
                engine.abort_request(chatter)  # the application changed its mind
            for out in engine.step():
                texts[out.request_id] += out.new_text
                if out.finished:
                    print(f"[tick {tick}] request {out.request_id} finished ({out.finish_reason}, "
                          f"{len(out.token_ids)} tokens): {texts[out.request_id]!r}")
            if not engine.has_unfinished_requests():
                break
            spent = time.perf_counter() - tick_start
            time.sleep(max(0.0, 0.01 - spent))  # a 100 Hz loop
        print("pools:", engine.stats())


if __name__ == "__main__":
    main()
