"""CUDA graphs for decode batches, and for speculative decoding's verify batches.

A decode step launches hundreds of small kernels; replaying them as one captured graph takes
the launch overhead off the host. Graphs are captured once, after the KV pool is final, for a
list of batch sizes; a decode batch of n rows runs the graph of the smallest size >= n, padded
with rows that own no sequence slot (pyengine/runtime/model_runner.py). With speculative
decoding, a verify batch (generating sequences only, each with up to k drafts) runs the graph
of (the next size, d) for d = 1..k: each sequence padded to 1 + d rows (the most drafts a
sequence carries rounded up), the padding rows writing no KV, and the logits of the real rows
gathered after the replay. Prefill and mixed batches, and batches larger than the largest
size, run eagerly.

Everything a graph reads lives at a fixed address: the runner's device metadata buffers, the
token buffer, the KV pool, the split-K workspace. Its logits are a tensor of the graph's
private memory pool, valid until the next replay of the same graph.
"""

from __future__ import annotations

import functools
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
    """The captured graphs of one runner: decode batches by batch size, and (speculative
    decoding) verify batches by (batch size, drafts per sequence)."""

    def __init__(self, runner: "ModelRunner", sizes: Sequence[int], verify_drafts: Sequence[int] = ()) -> None:
        self.sizes = sorted(sizes)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._verify: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # (rows, size, drafts; drafts 0 = decode): the largest first, the smaller ones reuse its memory
        shapes = [(s, s, 0) for s in self.sizes]
        shapes += [(s * (1 + d), s, d) for d in sorted(set(verify_drafts)) for s in self.sizes
                   if s * (1 + d) <= runner.max_num_tokens]
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = runner.stream
        with torch.inference_mode(), torch.cuda.stream(stream):
            for _, size, drafts in sorted(shapes, reverse=True):
                # every row a padding row: finite inputs for the warm-up run, no KV written
                if drafts:
                    runner.pad_verify_dummy(size, drafts)
                    forward = functools.partial(runner.verify_forward, size, drafts)
                else:
                    runner._pad(0, size)
                    runner._upload(size, size, size)
                    forward = functools.partial(runner.decode_forward, size)
                forward()  # warm-up: lazy initialisations happen outside capture
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = forward()
                (self._verify if drafts else self._graphs)[(size, drafts) if drafts else size] = (graph, logits)
            stream.synchronize()
        self.verify_drafts = sorted({d for _, d in self._verify})
        logger.info("pyengine: captured %d decode CUDA graphs (batch sizes %s) and %d verify graphs (drafts %s) "
                    "in %.2f s", len(self.sizes), self.sizes, len(self._verify), self.verify_drafts,
                    time.perf_counter() - start)

    def replay(self, size: int) -> torch.Tensor:
        """Replays the graph of `size` rows on the capture stream; returns its logits tensor."""
        graph, logits = self._graphs[size]
        graph.replay()
        return logits

    def has_verify(self, size: int, drafts: int) -> bool:
        return (size, drafts) in self._verify

    def replay_verify(self, size: int, drafts: int) -> torch.Tensor:
        """Replays the verify graph of `size` sequences of 1 + `drafts` rows; returns the logits
        of all its rows."""
        graph, logits = self._verify[(size, drafts)]
        graph.replay()
        return logits
