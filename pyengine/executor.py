"""The model runner: owns the KV pool tensor and turns the batch manager's metadata buffers
into the model's inputs without copying them."""

from __future__ import annotations

import weakref

import torch

from pyengine._core import CoreBatchManager
from pyengine.models import AttentionMetadata, LlamaFamilyModel


# Every KV pool alive in the process (tests check that a failed start-up leaves none).
LIVE_KV_POOLS: "weakref.WeakSet[torch.Tensor]" = weakref.WeakSet()


class ModelRunner:
    def __init__(self, model: LlamaFamilyModel, bm: CoreBatchManager, max_batch_size: int,
                 num_blocks: int, tokens_per_block: int, kv_dtype: torch.dtype) -> None:
        c = model.config
        self.model = model
        # One tensor for the whole pool: [layers, K/V, blocks, kv heads, tokens per block, head dim].
        self.kv_pool = torch.empty((c.num_layers, 2, num_blocks, c.num_kv_heads, tokens_per_block, c.head_dim),
                                   dtype=kv_dtype)
        self.kv_caches = [(self.kv_pool[i, 0], self.kv_pool[i, 1]) for i in range(c.num_layers)]
        LIVE_KV_POOLS.add(self.kv_pool)
        b = bm.buffers

        def view(name: str, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.frombuffer(b[name], dtype=dtype)

        self.input_ids = view("input_ids")
        self.positions = view("positions")
        self.slot_mapping = view("slot_mapping")
        self.query_start_loc = view("query_start_loc")
        self.seq_lens = view("seq_lens")
        self.block_tables = view("block_tables").view(max_batch_size, bm.max_blocks_per_seq)
        self.logits_indices = view("logits_indices")
        self.logits_slots = view("logits_slots")
        self.seq_slots = view("seq_slots")
        self.request_ids = view("request_ids", torch.int64)
        self._bm = bm
        # The last token sampled for each slot (+ the scratch row): generation rows read
        # their input from here, so a step never waits for the host to learn the previous
        # step's tokens (the overlap loop's token buffer).
        self.last_tokens = torch.zeros(bm.num_slots + 1, dtype=torch.int32)

    @property
    def kv_pool_bytes(self) -> int:
        return self.kv_pool.numel() * self.kv_pool.element_size()

    def record_tokens(self, num_logits: int, tokens: torch.Tensor) -> None:
        self.last_tokens[self.logits_slots[:num_logits].long()] = tokens

    @torch.inference_mode()
    def forward(self, num_tokens: int, num_seqs: int, num_logits: int,
                extra_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Runs the scheduled batch; returns fp32 logits [num_logits (+ extra rows), vocab]
        for the sampled rows, then for `extra_rows` (token rows, e.g. for prompt logprobs)."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            query_start_loc=self.query_start_loc[: num_seqs + 1],
            seq_lens=self.seq_lens[:num_seqs],
            block_tables=self.block_tables[:num_seqs],
        )
        ngen = self._bm.num_generation_seqs  # generation rows come first, one token each
        if ngen:
            self.input_ids[:ngen] = self.last_tokens[self.seq_slots[:ngen].long()]
        rows = self.logits_indices[:num_logits]
        if extra_rows is not None:
            rows = torch.cat([rows, extra_rows])
        return self.model.forward(self.input_ids[:num_tokens], self.positions[:num_tokens], meta,
                                  self.kv_caches, rows)
