"""The model runner: owns the KV pool tensor and turns the batch manager's metadata buffers
into the model's inputs.

On the CPU the model reads the C++ buffers directly (zero-copy views). On a GPU the C++ buffers
are page-locked in place and each step copies the used part of them, without blocking, into
device buffers of fixed address on the runner's execution stream; decode batches may then
replay a captured CUDA graph (pyengine/cuda_graphs.py).

Padding: a decode batch can be padded up to a larger size (the CUDA graph sizes). Padding
rows own no sequence slot: they read their input token from, and write their sampled token to, the
scratch row past the last slot, store no KV (slot -1) and attend to one cached position.
"""

from __future__ import annotations

import bisect
import math
import contextlib
import logging
import weakref
from dataclasses import dataclass

import torch

from pyengine.core._core import CoreBatchManager
from pyengine.layers._attention_cuda import split_k_rows, workspace_bytes
from pyengine.layers.fused_decode import CpuDecodeLayers
from pyengine.models import AttentionMetadata, LlamaFamilyModel
from pyengine.runtime.weight_arena import WeightArena

logger = logging.getLogger("pyengine")

# Every KV pool alive in the process (tests check that a failed start-up leaves none).
LIVE_KV_POOLS: "weakref.WeakSet[torch.Tensor]" = weakref.WeakSet()

# Batch shapes whose metadata views a CPU runner keeps (_batch_views); past this many, it starts over.
_MAX_KEPT_VIEWS = 256

# The C++ metadata buffers the forward reads, with their dtypes.
_BUFFERS = {"input_ids": torch.int32, "positions": torch.int32, "slot_mapping": torch.int32,
            "query_start_loc": torch.int32, "seq_lens": torch.int32, "block_tables": torch.int32,
            "logits_indices": torch.int32, "logits_slots": torch.int32, "seq_slots": torch.int32,
            "request_ids": torch.int64, "logits_offsets": torch.int32}


def allocate_kv_pool(config, num_blocks: int, tokens_per_block: int, dtype: torch.dtype, device: torch.device,
                     zeroed: bool) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A model's KV pool, one tensor [layers, K/V, blocks, kv heads, tokens per block, head dim]
    (registered in LIVE_KV_POOLS), and its per-layer (K, V) views."""
    shape = (config.num_layers, 2, num_blocks, config.num_kv_heads, tokens_per_block, config.head_dim)
    if torch.device(device).type == "cpu":
        # In huge pages, as the weights (see weight_arena.py), and faulted in now: a page first
        # touched by a step would stall it (a 2 MiB page is zeroed, and may be compacted for,
        # on its first write: prompts ran at a quarter of their speed when that happened
        # mid-run). Fresh anonymous memory is zeros; writing one zero per 4 KiB faults it in.
        region = WeightArena.reserve(math.prod(shape) * torch.empty((), dtype=dtype).element_size())
        pool = region.zeros(shape, dtype)
        pool.view(-1)[:: 4096 // pool.element_size()].zero_()
    else:
        pool = (torch.zeros if zeroed else torch.empty)(shape, dtype=dtype, device=device)
    LIVE_KV_POOLS.add(pool)
    return pool, [(pool[i, 0], pool[i, 1]) for i in range(config.num_layers)]


def one_call_decode(model: LlamaFamilyModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                    max_blocks_per_seq: int) -> CpuDecodeLayers | None:
    """The C++ call that runs all layers of a small batch, bound to these caches, where the
    model's small-batch linears are pyengine's kernels (bf16 weights on the CPU; fp32 unless
    exact_fp32; quantized) and that kernel computes the model's layers (model.fused_cpu_decode_ok:
    Llama-shaped layers; not Gemma's, nor partial or LongRoPE); else None."""
    if model.device.type != "cpu":
        return None
    if (model.bf16_kernel_max_rows or model.fast_fp32 or model.quantized) and model.fused_cpu_decode_ok:
        return CpuDecodeLayers(model, kv_caches, max_blocks_per_seq)
    return None


def split_k_workspace_bytes(dtype: torch.dtype, num_heads: int, head_dim: int, max_batch_size: int,
                            max_num_tokens: int, max_seq_len: int) -> int:
    """The CUDA attention's split-K scratch an engine needs, sized for the largest batch that
    reaches the split-K kernel: the decode batches' max_batch_size rows where prefill takes the
    tensor-core kernel (bf16/fp16, head_dim 64/128); every batch -- a prefill of max_num_tokens
    tokens, as the KV-capacity estimate's dummy batch is -- where it cannot (fp32, head_dim 256).
    Either way at most about 1024 rows' worth of partial results (the kernel stops splitting
    beyond): a few MiB to tens of MiB."""
    rows = split_k_rows(dtype, head_dim, max_batch_size, max_num_tokens)
    return workspace_bytes(rows, num_heads, head_dim, max_seq_len)


@dataclass
class Forwarded:
    """A forward's result: fp32 logits of `num_rows` sampled rows (the batch's logits rows,
    or more when it was padded) followed by any extra rows asked for; `slots` are the sampled
    rows' sequence slots (the scratch slot for padding rows), on the logits' device."""

    logits: torch.Tensor
    num_rows: int
    slots: torch.Tensor


class ModelRunner:
    def __init__(self, model: LlamaFamilyModel, bm: CoreBatchManager, max_batch_size: int,
                 num_blocks: int, tokens_per_block: int, kv_dtype: torch.dtype, max_seq_len: int,
                 max_num_tokens: int, kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
        c = model.config
        self.model = model
        self.device = model.device
        self.is_cuda = self.device.type == "cuda"
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.max_num_tokens = max_num_tokens
        self.tokens_per_block = tokens_per_block
        self.k_scale, self.v_scale = kv_scales
        # Zeroed on a GPU (cheap there) so that padding rows read finite values.
        self.kv_pool, self.kv_caches = allocate_kv_pool(c, num_blocks, tokens_per_block, kv_dtype, self.device,
                                                        zeroed=self.is_cuda)
        self._bm = bm
        self.scratch_slot = bm.num_slots
        # Host views of the C++ buffers (zero copy).
        self.host = {name: torch.frombuffer(bm.buffers[name], dtype=dt) for name, dt in _BUFFERS.items()}
        self.host["block_tables"] = self.host["block_tables"].view(max_batch_size, bm.max_blocks_per_seq)
        h = self.host
        self.input_ids, self.positions, self.slot_mapping = h["input_ids"], h["positions"], h["slot_mapping"]
        self.query_start_loc, self.seq_lens, self.block_tables = h["query_start_loc"], h["seq_lens"], h["block_tables"]
        self.logits_indices, self.logits_slots = h["logits_indices"], h["logits_slots"]
        self.logits_offsets = h["logits_offsets"]  # a row's index among its sequence's (drafts)
        self.seq_slots, self.request_ids = h["seq_slots"], h["request_ids"]
        # The last token sampled for each slot (+ the scratch row): on a GPU, generation rows
        # read their input from here, so a step never waits for the host to learn the previous
        # step's tokens (the overlap loop's token buffer). On the model's device. On the CPU the
        # tokens are on the host when sampled and each step's update precedes the next
        # schedule (in both loops), so the batch manager's input ids are already the last
        # tokens: the buffer is not used (its gather and scatter cost a batch-1 step ~0.15 ms).
        # (Tests of the GPU's padding rows turn it on on the CPU.)
        self.token_buffer = self.is_cuda
        self._views: dict[tuple[int, int, int], tuple] = {}  # _batch_views, per batch shape (CPU)
        self.last_tokens = torch.zeros(bm.num_slots + 1, dtype=torch.int32, device=self.device)
        # Decode batches of n rows are padded to the smallest of these sizes >= n (the CUDA
        # graphs' sizes; on the CPU only for tests of the padding itself).
        self.decode_pad_sizes: list[int] = []
        # Verify batches (speculative decoding: generation rows only, each sequence with its
        # drafts) whose most drafts a sequence carries is at most max(verify_pad_drafts) run
        # padded: every sequence to 1 + the next of these draft counts, the sequences to the
        # next pad size (the CUDA graphs' shapes; on the CPU only for tests of the padding).
        self.verify_pad_drafts: list[int] = []
        self._verify_host: dict[str, torch.Tensor] | None = None  # their metadata (_verify_layout)
        self.graphs = None  # pyengine.runtime.cuda_graphs.DecodeGraphs once captured
        self._registered: list[int] = []
        # all layers of a small batch in one C++ call, bound to this KV pool, where it applies
        self.cpu_decode = one_call_decode(model, self.kv_caches, bm.max_blocks_per_seq)
        if self.is_cuda:
            self._init_cuda(c)

    # ---- CUDA set-up -----------------------------------------------------------------------

    def _init_cuda(self, c) -> None:
        self.stream = torch.cuda.Stream(self.device)
        # The buffers the forward reads (request ids stay on the host), page-locked in place.
        uploaded = {name: view for name, view in self.host.items() if name != "request_ids"}
        for view in uploaded.values():
            self._register(view)
        self.dev = {name: torch.zeros_like(view, device=self.device) for name, view in uploaded.items()}
        # a padded verify batch's real rows (_forward_verify)
        self.dev["verify_rows"] = torch.zeros(self.max_num_tokens, dtype=torch.int64, device=self.device)
        nbytes = split_k_workspace_bytes(self.model.dtype, c.num_heads, c.head_dim, self.max_batch_size,
                                         self.max_num_tokens, self.max_seq_len)
        self.workspace = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._host_tokens = [torch.empty(self.max_num_tokens, dtype=torch.int32).pin_memory() for _ in range(2)]
        self._host_turn = 0

    def _register(self, view: torch.Tensor) -> None:
        nbytes = view.numel() * view.element_size()
        if nbytes == 0:
            return
        err = torch.cuda.cudart().cudaHostRegister(view.data_ptr(), nbytes, 0)
        if int(err) != 0:  # pageable memory still works, with synchronous copies
            logger.warning("pyengine: cudaHostRegister failed (%s); metadata copies will be synchronous", err)
            return
        self._registered.append(view.data_ptr())

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to release to
            pass

    def close(self) -> None:
        """Releases what the runner holds outside torch's care (page-locked registrations)."""
        if self._registered:
            torch.cuda.synchronize(self.device)
            for ptr in self._registered:
                torch.cuda.cudart().cudaHostUnregister(ptr)
            self._registered = []
        self.graphs = None

    # ---- the step ---------------------------------------------------------------------------

    @property
    def kv_pool_bytes(self) -> int:
        return self.kv_pool.numel() * self.kv_pool.element_size()

    def is_decode(self, num_tokens: int, num_seqs: int, num_logits: int, extra_rows: torch.Tensor | None) -> bool:
        """One token per sequence, each sampled, all in generation, no extra rows."""
        return (extra_rows is None and num_tokens == num_seqs == num_logits
                and self._bm.num_generation_seqs == num_seqs)

    def padded_size(self, num_seqs: int) -> int:
        """The size a decode batch of `num_seqs` rows runs at: the next pad size, or itself."""
        sizes = self.decode_pad_sizes
        if not sizes or num_seqs > sizes[-1]:
            return num_seqs
        return sizes[bisect.bisect_left(sizes, num_seqs)]

    def _pad(self, n: int, size: int) -> None:
        """Writes padding rows n..size-1 of a decode batch into the host buffers."""
        if size == n:
            return
        self.query_start_loc[n] = n
        self.positions[n:size] = 0
        self.slot_mapping[n:size] = -1
        self.seq_lens[n:size] = 1
        self.block_tables[n:size, 0] = 0
        self.query_start_loc[n + 1: size + 1] = torch.arange(n + 1, size + 1, dtype=torch.int32)
        self.logits_indices[n:size] = torch.arange(n, size, dtype=torch.int32)
        self.seq_slots[n:size] = self.scratch_slot
        self.logits_slots[n:size] = self.scratch_slot

    def stream_context(self) -> contextlib.AbstractContextManager:
        """On a GPU, makes the execution stream current (everything a step does on the device
        goes there, in order); nothing on the CPU."""
        return torch.cuda.stream(self.stream) if self.is_cuda else contextlib.nullcontext()

    @torch.inference_mode()
    def forward(self, num_tokens: int, num_seqs: int, num_logits: int,
                extra_rows: torch.Tensor | None = None) -> Forwarded:
        """Runs the scheduled batch; returns the fp32 logits of the sampled rows, then of
        `extra_rows` (token rows, e.g. for prompt logprobs)."""
        decode = self.is_decode(num_tokens, num_seqs, num_logits, extra_rows)
        if not decode and self.verify_pad_drafts:
            shape = self._verify_shape(num_tokens, num_seqs, num_logits, extra_rows)
            if shape is not None:
                return self._forward_verify(num_tokens, num_seqs, num_logits, *shape)
        if decode:
            size = self.padded_size(num_seqs)
            self._pad(num_seqs, size)
            num_tokens = num_seqs = num_logits = size
        # generation sequences come first, one token each plus their draft tokens
        ngen = num_seqs if decode else self._bm.num_generation_seqs
        drafts = 0 if decode else self._bm.num_draft_tokens
        if not self.is_cuda:
            return self._run(self.host, num_tokens, num_seqs, num_logits, extra_rows, ngen, drafts=drafts)
        with self.stream_context():
            self._upload(num_tokens, num_seqs, num_logits)
            if decode and self.graphs is not None and num_seqs in self.graphs.sizes:
                return Forwarded(self.graphs.replay(num_seqs), num_logits, self.dev["logits_slots"][:num_logits])
            max_query_len = 1 if decode else int(
                (self.query_start_loc[1: num_seqs + 1] - self.query_start_loc[:num_seqs]).max())
            max_context_len = int(self.seq_lens[:num_seqs].max())
            return self._run(self.dev, num_tokens, num_seqs, num_logits, extra_rows, ngen, max_query_len,
                             max_context_len, drafts)

    # ---- padded verify batches (speculative decoding) ---------------------------------------------

    def _verify_shape(self, num_tokens: int, num_seqs: int, num_logits: int,
                      extra_rows: torch.Tensor | None) -> tuple[int, int] | None:
        """(sequences, drafts per sequence) a verify batch runs padded to, or None where it runs
        as it is: not a verify batch (a context chunk, a row not sampled, extra rows), more
        drafts than the largest pad count, more rows than the buffers hold, a padded context
        past max_seq_len, or (on a GPU) no graph of that shape."""
        if (extra_rows is not None or num_logits != num_tokens or self._bm.num_generation_seqs != num_seqs
                or num_tokens == num_seqs):
            return None
        qsl = self.query_start_loc[: num_seqs + 1]
        lens = qsl[1:] - qsl[:-1]
        most = int(lens.max()) - 1
        pads = self.verify_pad_drafts
        if most > pads[-1]:
            return None
        drafts = pads[bisect.bisect_left(pads, most)]
        size = self.padded_size(num_seqs)
        if size * (1 + drafts) > self.max_num_tokens:
            return None
        if int((self.seq_lens[:num_seqs] + (1 + drafts - lens)).max()) > self.max_seq_len:
            return None
        if self.is_cuda and (self.graphs is None or not self.graphs.has_verify(size, drafts)):
            return None
        return size, drafts

    def _verify_layout(self, num_seqs: int, size: int, drafts: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The metadata of this step's verify batch (in the host buffers) padded to `size`
        sequences of 1 + `drafts` rows each, in buffers of its own (the step's own stay as they
        are: the sampler reads them), and the padded row of each real row (the logits rows to
        keep, in the batch's order). A sequence's padding rows follow its last draft: positions
        continuing, no KV written (slot -1), their blocks past the sequence's last the last one
        (they read, never write; the real rows' causal windows end before them). Padding
        sequences: positions 0..drafts, no KV, block 0, the scratch slot."""
        if self._verify_host is None:
            n, b = self.max_num_tokens, self.max_batch_size

            def i32(size: int) -> torch.Tensor:
                return torch.zeros(size, dtype=torch.int32)

            h = {"input_ids": i32(n), "positions": i32(n), "slot_mapping": i32(n), "query_start_loc": i32(b + 1),
                 "seq_lens": i32(b), "seq_slots": i32(b), "block_tables": torch.zeros_like(self.block_tables),
                 "logits_indices": torch.arange(n, dtype=torch.int32), "logits_slots": i32(n),
                 "rows": torch.zeros(n, dtype=torch.int64)}
            if self.is_cuda:  # page-locked: the uploads are asynchronous
                h = {name: t.pin_memory() for name, t in h.items()}
            self._verify_host = h
        h = self._verify_host
        q = 1 + drafts
        total = size * q
        qsl = self.query_start_loc[: num_seqs + 1].to(torch.int64)
        lens = qsl[1:] - qsl[:-1]
        num_tokens = int(qsl[-1])
        seq_of_row = torch.repeat_interleave(torch.arange(num_seqs), lens)
        dst = seq_of_row * q + (torch.arange(num_tokens) - qsl[:-1][seq_of_row])
        h["rows"][:num_tokens] = dst
        h["input_ids"][:total] = 0
        h["input_ids"][dst] = self.input_ids[:num_tokens]
        first = torch.zeros(size, dtype=torch.int32)
        first[:num_seqs] = self.positions[qsl[:-1]]
        h["positions"][:total] = (first.repeat_interleave(q) + torch.arange(q, dtype=torch.int32).repeat(size))
        h["slot_mapping"][:total] = -1
        h["slot_mapping"][dst] = self.slot_mapping[:num_tokens]
        h["query_start_loc"][: size + 1] = torch.arange(size + 1, dtype=torch.int32) * q
        real_lens = self.seq_lens[:num_seqs]
        h["seq_lens"][:num_seqs] = real_lens + (q - lens).to(torch.int32)
        h["seq_lens"][num_seqs:size] = q
        h["seq_slots"][:num_seqs] = self.seq_slots[:num_seqs]
        h["seq_slots"][num_seqs:size] = self.scratch_slot
        tables = h["block_tables"]
        tables[:num_seqs] = self.block_tables[:num_seqs]
        tables[num_seqs:size] = 0
        tpb = self.tokens_per_block
        for s in range(num_seqs):
            used = (int(real_lens[s]) + tpb - 1) // tpb
            padded = (int(h["seq_lens"][s]) + tpb - 1) // tpb
            if padded > used:
                tables[s, used:padded] = tables[s, used - 1]
        return h, h["rows"][:num_tokens]

    def _forward_verify(self, num_tokens: int, num_seqs: int, num_logits: int, size: int, drafts: int) -> Forwarded:
        """A verify batch padded to `size` sequences of 1 + `drafts` rows (on a GPU the replay of
        that shape's graph); returns the logits of its real rows, in order."""
        bufs, rows = self._verify_layout(num_seqs, size, drafts)
        total = size * (1 + drafts)
        if not self.is_cuda:
            fw = self._run(bufs, total, size, total, None, size, drafts=drafts)
            return Forwarded(fw.logits.index_select(0, rows), num_logits, self.logits_slots[:num_logits])
        with self.stream_context():
            d = self.dev
            self._upload_padded(bufs, size, total, non_blocking=True)
            d["logits_slots"][:num_logits].copy_(self.logits_slots[:num_logits], non_blocking=True)
            d["verify_rows"][:num_tokens].copy_(rows, non_blocking=True)
            logits = self.graphs.replay_verify(size, drafts).index_select(0, d["verify_rows"][:num_tokens])
            return Forwarded(logits, num_logits, d["logits_slots"][:num_logits])

    def verify_forward(self, size: int, drafts: int) -> torch.Tensor:
        """The forward of a padded verify batch of `size` sequences of 1 + `drafts` rows,
        entirely from the device buffers (the body a CUDA graph captures): the logits of all
        its rows."""
        total = size * (1 + drafts)
        return self._run(self.dev, total, size, total, None, size, 1 + drafts, self.max_seq_len, drafts).logits

    def pad_verify_dummy(self, size: int, drafts: int) -> None:
        """Device buffers of a verify batch of padding sequences only (finite inputs, no KV
        written): what graph capture warms up and captures on."""
        bufs, _ = self._verify_layout(0, size, drafts)
        self._upload_padded(bufs, size, size * (1 + drafts), non_blocking=False)

    def _upload_padded(self, bufs: dict[str, torch.Tensor], size: int, total: int, non_blocking: bool) -> None:
        """Copies a padded verify batch's metadata (`_verify_layout`) into the device buffers."""
        for name, n in (("input_ids", total), ("positions", total), ("slot_mapping", total),
                        ("query_start_loc", size + 1), ("seq_lens", size), ("seq_slots", size),
                        ("block_tables", size), ("logits_indices", total)):
            self.dev[name][:n].copy_(bufs[name][:n], non_blocking=non_blocking)

    def _upload(self, num_tokens: int, num_seqs: int, num_logits: int) -> None:
        """Copies the used part of this step's metadata to the device (non-blocking: the host
        buffers are page-locked and are not rewritten before the step's tokens are read back)."""
        d, h = self.dev, self.host
        for name, n in (("input_ids", num_tokens), ("positions", num_tokens), ("slot_mapping", num_tokens),
                        ("query_start_loc", num_seqs + 1), ("seq_lens", num_seqs), ("seq_slots", num_seqs),
                        ("block_tables", num_seqs), ("logits_indices", num_logits), ("logits_slots", num_logits)):
            d[name][:n].copy_(h[name][:n], non_blocking=True)

    def _run(self, bufs: dict[str, torch.Tensor], num_tokens: int, num_seqs: int, num_logits: int,
             extra_rows: torch.Tensor | None, ngen: int, max_query_len: int | None = None,
             max_context_len: int | None = None, drafts: int = 0) -> Forwarded:
        """The model on a batch whose metadata is in `bufs` (the host views on the CPU, the
        device buffers on a GPU); generation rows take their input from the token buffer (a
        sequence with draft tokens: its first row)."""
        if ngen and self.token_buffer:
            first = bufs["query_start_loc"][:ngen].long() if drafts else slice(0, ngen)
            bufs["input_ids"][first] = self.last_tokens[bufs["seq_slots"][:ngen].long()]
        input_ids, positions, meta, rows, slots = self._batch_views(bufs, num_tokens, num_seqs, num_logits,
                                                                    max_query_len, max_context_len)
        if extra_rows is not None:
            rows = torch.cat([rows, extra_rows.to(self.device)])
        logits = self.model.forward(input_ids, positions, meta, self.kv_caches, rows)
        return Forwarded(logits, num_logits, slots)

    def _batch_views(self, bufs: dict[str, torch.Tensor], num_tokens: int, num_seqs: int, num_logits: int,
                     max_query_len: int | None, max_context_len: int | None) -> tuple:
        """(input ids, positions, attention metadata, logits rows, logits slots) of a batch: views of
        the fixed metadata buffers. On the CPU they are kept per batch shape: a batch-1 step would
        otherwise pay a dozen slicing operations, run with caches cold from the weight stream."""
        key = (num_tokens, num_seqs, num_logits)
        keep = not self.is_cuda and bufs is self.host  # (a padded verify batch's buffers are not kept)
        views = self._views.get(key) if keep else None
        if views is None:
            meta = AttentionMetadata(
                slot_mapping=bufs["slot_mapping"][:num_tokens],
                query_start_loc=bufs["query_start_loc"][: num_seqs + 1], seq_lens=bufs["seq_lens"][:num_seqs],
                block_tables=bufs["block_tables"][:num_seqs], max_query_len=max_query_len,
                max_context_len=max_context_len, workspace=self.workspace if self.is_cuda else None,
                k_scale=self.k_scale, v_scale=self.v_scale, cpu_decode=self.cpu_decode)
            views = (bufs["input_ids"][:num_tokens], bufs["positions"][:num_tokens], meta,
                     bufs["logits_indices"][:num_logits], bufs["logits_slots"][:num_logits])
            if keep:
                if len(self._views) >= _MAX_KEPT_VIEWS:
                    self._views.clear()
                self._views[key] = views
        views[2].cpu_decode = self.cpu_decode  # (tests turn the one-call path off on a live runner)
        return views

    def decode_forward(self, size: int) -> torch.Tensor:
        """The forward of a decode batch of `size` rows, entirely from the device buffers (the
        body a CUDA graph captures): one query per row, the split-K grid sized for max_seq_len
        so that one capture serves every length."""
        return self._run(self.dev, size, size, size, None, size, 1, self.max_seq_len).logits

    # ---- after sampling ---------------------------------------------------------------------

    def tokens_to_host(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The sampled tokens on the host: on a GPU, a non-blocking copy into a page-locked
        buffer and the event that says it has landed (wait for it before reading)."""
        if not self.is_cuda:
            return tokens, None
        with self.stream_context():
            buf = self._host_tokens[self._host_turn][: tokens.shape[0]]
            self._host_turn ^= 1
            buf.copy_(tokens, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return buf, event

    def record_tokens(self, forwarded: Forwarded, tokens: torch.Tensor, last_rows: list[int] | None = None) -> None:
        """Commits a step's sampled tokens to the token buffer (padding rows: the scratch row).
        `last_rows` (speculative decoding): the row of each sequence's last kept token. (No
        buffer on the CPU: see token_buffer.)"""
        if not self.token_buffer:
            return
        with self.stream_context():
            if last_rows is None:
                self.last_tokens[forwarded.slots.long()] = tokens
            else:
                rows = torch.tensor(last_rows, dtype=torch.int64).to(tokens.device)
                self.last_tokens[forwarded.slots[rows].long()] = tokens[rows]
