"""CUDA graphs for decode batches.

A decode step launches hundreds of small kernels; replaying them as one captured graph takes
the launch overhead off the host. Graphs are captured once, after the KV pool is final, for a
list of batch sizes; a decode batch of n rows runs the graph of the smallest size >= n, padded
with rows that own no sequence slot (pyengine/runtime/model_runner.py). Prefill and mixed batches, and decode
batches larger than the largest size, run eagerly.

Everything a graph reads lives at a fixed address: the runner's device metadata buffers, the
token buffer, the KV pool, the split-K workspace. Its logits are a tensor of the graph's
private memory pool, valid until the next replay of the same graph.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from pyengine.runtime.model_runner import ModelRunner

logger = logging.getLogger("pyengine")


def default_graph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_batch_size (and max_batch_size itself)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch_size]
    sizes += list(range(8, max_batch_size, 8))
    return sorted(set(sizes + [max_batch_size]))


def check_graph_batch_sizes(sizes: Sequence[int], max_batch_size: int, max_num_tokens: int) -> list[int]:
    """Validates user-given sizes (each in [1, min(max_batch_size, max_num_tokens)]); sorted, unique."""
    limit = min(max_batch_size, max_num_tokens)
    out = []
    for s in sizes:
        if not isinstance(s, int) or isinstance(s, bool) or not 1 <= s <= limit:
            raise ValueError(f"cuda_graph_batch_sizes entry {s!r} is not an int in [1, {limit}] "
                             "(min of max_batch_size and max_num_tokens)")
        out.append(s)
    if not out:
        raise ValueError("cuda_graph_batch_sizes is empty: pass cuda_graphs=False to run without graphs")
    return sorted(set(out))


class DecodeGraphs:
    """The captured decode graphs of one runner, by batch size."""

    def __init__(self, runner: "ModelRunner", sizes: Sequence[int]) -> None:
        self.sizes = sorted(sizes)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = runner.stream
        with torch.inference_mode(), torch.cuda.stream(stream):
            # Every row a padding row: finite inputs for the warm-up runs, no KV written.
            largest = self.sizes[-1]
            runner._pad(0, largest)
            runner._upload(largest, largest, largest)
            for size in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
                runner.decode_forward(size)  # warm-up: lazy initialisations happen outside capture
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = runner.decode_forward(size)
                self._graphs[size] = (graph, logits)
            stream.synchronize()
        logger.info("pyengine: captured %d decode CUDA graphs (batch sizes %s) in %.2f s", len(self.sizes),
                    self.sizes, time.perf_counter() - start)

    def replay(self, size: int) -> torch.Tensor:
        """Replays the graph of `size` rows on the capture stream; returns its logits tensor."""
        graph, logits = self._graphs[size]
        graph.replay()
        return logits
