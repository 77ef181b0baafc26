"""The engine: assembly at start-up and the synchronous step()."""

from __future__ import annotations

import array
import contextlib
import hashlib
import itertools
import logging
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from pyengine.core._core import CoreBatchManager
from pyengine.config import KvCacheConfig, SchedulerConfig
from pyengine.engine.detokenizer import IncrementalDetokenizer
from pyengine.runtime.cuda_graphs import DecodeGraphs, check_graph_batch_sizes, default_graph_batch_sizes
from pyengine.runtime.device import resolve_device
from pyengine.runtime.model_runner import Forwarded, ModelRunner
from pyengine.runtime.kv_capacity import (SKIP_ENV, CpuMemoryProbe, CudaMemoryProbe, KvCapacity, MemoryReading,
                                  capacity_from_reading, configured_capacity, skip_requested)
from pyengine.models import LlamaFamilyModel, ModelConfig
from pyengine.models.loader import load_tensors
from pyengine.engine.outputs import RequestMetrics, RequestOutput
from pyengine.engine.outputs import RequestState, metrics_from_core
from pyengine.sampling.sampler import SampleResult, Sampler, top_logprobs
from pyengine.sampling.params import SamplingParams

logger = logging.getLogger("pyengine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_DTYPES = DTYPES | {"float8_e4m3": torch.float8_e4m3fn}
# C++ FinishReason values -> the names users see.
FINISH_REASONS = {1: "stop", 2: "stop", 3: "length", 4: "abort", 5: "stop"}

Prompt = str | Sequence[int]


@dataclass
class _Batch:
    """One scheduled step: sizes from the batch manager, its events, prompt-logprob rows."""

    num_tokens: int
    num_seqs: int
    num_logits: int
    events: dict
    prompt_rows: tuple[torch.Tensor, list] | None = None


class StartupError(RuntimeError):
    """Engine(...) failed; `phase` names the start-up phase ("config", "weights",
    "kv_capacity", "scheduler", "executor") and the original exception is the cause."""

    def __init__(self, phase: str, error: BaseException) -> None:
        super().__init__(f"pyengine start-up failed in phase '{phase}': {type(error).__name__}: {error}")
        self.phase = phase
        self.error = error


def _parse_dtype(dtype: str | torch.dtype, what: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"{what} must be one of {sorted(DTYPES)}, got {dtype!r}")


def compute_max_num_sequences(max_batch_size: int, overlap: bool) -> int:
    """The seat pool: one seat per batch row, twice that with the overlap loop so that a
    retiring request and its replacement can hold seats at once."""
    return max_batch_size * (2 if overlap else 1)


def cache_salt_key(salt: str | bytes | None) -> int:
    """A stable non-zero 64-bit key for a cache salt (0 means no salt)."""
    if salt is None:
        return 0
    data = salt.encode() if isinstance(salt, str) else bytes(salt)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") or 1


class Engine:
    """An in-process LLM engine driven by the caller, one synchronous `step()` at a time.

    model: a local Hugging Face model directory (config.json, safetensors, tokenizer).
    dtype: "float32", "bfloat16" or "float16" for weights and activations.
    max_seq_len: prompt + generated tokens of one request; defaults to the model's
        max_position_embeddings.
    seed: seeds the seeds drawn for requests that give none (None: random).
    overlap: run step n's forward in a worker thread while step n-1's outputs are built;
        each step() then returns the previous step's outputs (one step of extra latency to
        every request's first output), identical to those without overlap. The seat pool
        doubles so that retiring and newly admitted requests can hold seats at once.
    device: "cpu" (default), "cuda" or "cuda:N": where weights, KV pool, forward and sampler
        live. On a GPU the forward runs on the engine's own execution stream.
    cuda_graphs: on a GPU, replay captured CUDA graphs for decode batches (padded up to the
        next captured size); False runs every batch eagerly. Ignored on the CPU.
    cuda_graph_batch_sizes: the batch sizes captured (default 1, 2, 4, 8, 16, ... up to
        max_batch_size).
    """

    def __init__(self, model: str | Path, dtype: str | torch.dtype = "float32",
                 kv_cache_config: KvCacheConfig | None = None,
                 scheduler_config: SchedulerConfig | None = None,
                 max_seq_len: int | None = None, seed: int | None = None, overlap: bool = False,
                 device: str | torch.device = "cpu", cuda_graphs: bool = True,
                 cuda_graph_batch_sizes: Sequence[int] | None = None) -> None:
        self._closed = True
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: tuple | None = None  # overlap: the step sampled but not yet updated
        self.overlap = bool(overlap)
        self._phases: list[tuple[str, float]] = []
        self._capacity: KvCapacity | None = None
        self._runner: ModelRunner | None = None
        with self._phase("config"):
            self._configure(model, dtype, kv_cache_config, scheduler_config, max_seq_len, device)
            self._graph_sizes = self._configure_graphs(cuda_graphs, cuda_graph_batch_sizes)
        with self._phase("weights"):
            names, optional = LlamaFamilyModel.weight_names(self.model_config)
            weights = load_tensors(self.model_dir, names, self.dtype, optional)
            model_obj = LlamaFamilyModel(self.model_config, weights, self.dtype, self.max_seq_len, self.device)
        with self._phase("kv_capacity"):
            self._capacity = self._estimate_kv_capacity(model_obj)
        with self._phase("scheduler"):
            self._build_scheduler(seed)
        with self._phase("executor"):
            self._runner = self._make_runner(model_obj, self._bm, self.scheduler_config.max_batch_size,
                                             self._capacity.num_blocks, self.scheduler_config.max_num_tokens)
            if self._graph_sizes:  # after the KV pool: graphs read it at a fixed address
                try:
                    self._runner.decode_pad_sizes = self._graph_sizes
                    self._runner.graphs = DecodeGraphs(self._runner, self._graph_sizes)
                except BaseException:
                    self._runner.close()
                    raise
            if self.overlap:  # last: nothing after it can fail and leave the thread behind
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pyengine-forward")
        self._requests: dict[int, RequestState] = {}
        self._finished_ids: set[int] = set()
        self._streams: dict[int, deque[RequestOutput]] = {}
        self._pending_outputs: list[RequestOutput] = []  # aborts of a step that failed
        self._num_prompt_logprobs = 0  # requests still owed prompt logprobs
        self._ids = itertools.count()
        self.reset_timings()
        self._closed = False
        cap = self._capacity
        logger.info("pyengine: %s (%s, %d layers, %s) ready: KV pool %d blocks x %d tokens = %.1f MiB (%s, %s); "
                    "start-up %s", self.model_dir, self.model_config.model_type, self.model_config.num_layers,
                    self.dtype, cap.num_blocks, cap.tokens_per_block, cap.num_blocks * cap.bytes_per_block / 2**20,
                    self.kv_dtype, cap.source, ", ".join(f"{n} {t:.2f} s" for n, t in self._phases))

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Times a start-up phase; a failure in it raises StartupError naming the phase."""
        start = time.perf_counter()
        try:
            yield
        except Exception as e:
            raise StartupError(name, e) from e
        self._phases.append((name, time.perf_counter() - start))

    def _configure(self, model: str | Path, dtype: str | torch.dtype, kv_cache_config: KvCacheConfig | None,
                   scheduler_config: SchedulerConfig | None, max_seq_len: int | None,
                   device: str | torch.device) -> None:
        self.kv_cache_config = kv_cache_config or KvCacheConfig()
        self.scheduler_config = scheduler_config or SchedulerConfig()
        self.dtype = _parse_dtype(dtype, "dtype")
        self.device = resolve_device(device)
        kv = self.kv_cache_config.dtype
        self.kv_dtype = self.dtype if kv == "auto" else KV_DTYPES[kv]
        if kv == "float8_e4m3":
            if self.device.type != "cuda":
                raise ValueError("KvCacheConfig.dtype='float8_e4m3' needs device='cuda' (the CPU kernels "
                                 "have no fp8)")
            if self.dtype == torch.float32:
                raise ValueError("KvCacheConfig.dtype='float8_e4m3' needs a bfloat16 or float16 model, "
                                 "got dtype=float32")
        self.model_dir = Path(model)
        self.model_config = ModelConfig.from_model_dir(self.model_dir)
        mc = self.model_config
        if max_seq_len is None:
            max_seq_len = mc.max_position_embeddings
        if not isinstance(max_seq_len, int) or not 1 <= max_seq_len <= mc.max_position_embeddings:
            raise ValueError(f"max_seq_len must be in [1, max_position_embeddings={mc.max_position_embeddings}], "
                             f"got {max_seq_len!r}")
        self.max_seq_len = max_seq_len
        self.num_seats = compute_max_num_sequences(self.scheduler_config.max_batch_size, overlap=self.overlap)
        self.tokenizer = self._load_tokenizer(self.model_dir)

    def _configure_graphs(self, enabled: bool, sizes: Sequence[int] | None) -> list[int]:
        """The decode batch sizes to capture (none on the CPU or with cuda_graphs=False)."""
        if not isinstance(enabled, bool):
            raise TypeError(f"cuda_graphs must be a bool, got {enabled!r}")
        sc = self.scheduler_config
        if sizes is not None:
            sizes = check_graph_batch_sizes(sizes, sc.max_batch_size, sc.max_num_tokens)
        if not enabled or self.device.type != "cuda":
            return []
        if sizes is None:
            sizes = [s for s in default_graph_batch_sizes(sc.max_batch_size) if s <= sc.max_num_tokens]
        return sizes

    def _make_runner(self, model_obj: LlamaFamilyModel, bm: CoreBatchManager, rows: int, num_blocks: int,
                     max_num_tokens: int) -> ModelRunner:
        kc = self.kv_cache_config
        return ModelRunner(model_obj, bm, rows, num_blocks, kc.tokens_per_block, self.kv_dtype,
                           max_seq_len=self.max_seq_len, max_num_tokens=max_num_tokens,
                           kv_scales=(kc.k_scale, kc.v_scale))

    def _estimate_kv_capacity(self, model_obj: LlamaFamilyModel) -> KvCapacity:
        kc, sc, mc = self.kv_cache_config, self.scheduler_config, self.model_config
        tpb = kc.tokens_per_block
        bytes_per_block = mc.kv_bytes_per_token_per_elem * tpb * torch.empty((), dtype=self.kv_dtype).element_size()
        if kc.free_memory_fraction is None or skip_requested():
            if kc.max_tokens is None:
                raise ValueError(f"{SKIP_ENV} is set but KvCacheConfig.max_tokens is not: the pool size must come "
                                 "from somewhere")
            cap = configured_capacity(kc.max_tokens, tpb, bytes_per_block)
        else:
            reading = self._measure_worst_case_batch(model_obj)
            cap = capacity_from_reading(
                reading, tokens_per_block=tpb, bytes_per_block=bytes_per_block,
                free_memory_fraction=kc.free_memory_fraction, max_tokens=kc.max_tokens,
                max_memory_bytes=kc.max_memory_bytes,
                seat_cap_blocks=self.num_seats * math.ceil(self.max_seq_len / tpb))
        if cap.num_blocks < self.num_seats:
            raise ValueError(f"the KV pool ({cap.num_blocks} blocks) cannot cover the seat pool ({self.num_seats} "
                             "sequence slots, one block each at least): raise KvCacheConfig.max_tokens or "
                             "max_memory_bytes, or lower max_batch_size")
        if cap.max_tokens_in_pool < self.max_seq_len:
            raise ValueError(f"the KV pool holds {cap.max_tokens_in_pool} tokens ({cap.num_blocks} blocks of {tpb}), "
                             f"fewer than max_seq_len={self.max_seq_len}: one request of max_seq_len tokens would "
                             "never fit; raise KvCacheConfig.max_tokens or lower max_seq_len")
        return cap

    def _measure_worst_case_batch(self, model_obj: LlamaFamilyModel) -> MemoryReading:
        """Pass 1: a small cache, a worst-case dummy batch — max_num_tokens in one forward,
        one long context plus a full batch of one-token rows — and its memory peak."""
        sc, tpb = self.scheduler_config, self.kv_cache_config.tokens_per_block
        rows = max(1, min(sc.max_batch_size, sc.max_num_tokens))
        context = max(1, min(sc.max_num_tokens - (rows - 1), self.max_seq_len - 1))
        blocks = math.ceil((context + 1) / tpb) + rows
        bm = CoreBatchManager(max_batch_size=rows, max_num_tokens=context + rows - 1,
                              max_seq_len=max(context + 1, rows), tokens_per_block=tpb, num_blocks=blocks,
                              enable_chunked_context=False, vocab_size=self.model_config.vocab_size)
        runner = self._make_runner(model_obj, bm, rows, blocks, context + rows - 1)
        bm.add_request(0, array.array("i", [1] * context), 1)
        for i in range(1, rows):
            bm.add_request(i, array.array("i", [1]), 1)

        def dummy_batch() -> None:
            num_tokens, num_seqs, num_logits = bm.schedule(0.0)
            runner.forward(num_tokens, num_seqs, num_logits)

        probe = CudaMemoryProbe(self.device) if self.device.type == "cuda" else CpuMemoryProbe()
        try:
            reading = probe.measure(dummy_batch)
        finally:
            bm.rollback()
            runner.close()
        del runner, bm  # pass 1's cache goes before pass 2 builds the real one
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return reading

    def _build_scheduler(self, seed: int | None) -> None:
        sc, kc, mc = self.scheduler_config, self.kv_cache_config, self.model_config
        self._bm = CoreBatchManager(
            max_batch_size=sc.max_batch_size, max_num_tokens=sc.max_num_tokens, max_seq_len=self.max_seq_len,
            tokens_per_block=kc.tokens_per_block, num_blocks=self._capacity.num_blocks,
            enable_chunked_context=sc.enable_chunked_prefill, policy=sc.capacity_scheduler_policy,
            vocab_size=mc.vocab_size, num_seq_slots=self.num_seats, enable_block_reuse=kc.enable_block_reuse,
            queue_policy=sc.queue_policy)
        self._sampler = Sampler(self._bm.num_slots, mc.vocab_size, seed, self.device)

    def startup_report(self) -> dict[str, Any]:
        """The start-up phases with their seconds, and the KV capacity figures."""
        return {"phases": [{"name": n, "seconds": t} for n, t in self._phases],
                "kv_capacity": self._capacity.as_dict(), "num_seats": self.num_seats,
                "max_seq_len": self.max_seq_len, "device": str(self.device),
                "cuda_graph_batch_sizes": list(self._graph_sizes)}

    # ---- requests -------------------------------------------------------------------------

    @staticmethod
    def _load_tokenizer(model_dir: Path) -> Any:
        if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return None
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(model_dir))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine has been shut down")

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"a text prompt needs a tokenizer, and {str(self.model_dir)!r} has none; "
                                 "pass token ids")
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 1 and not prompt.is_floating_point():
            return prompt.tolist()
        if isinstance(prompt, (list, tuple)):
            bad = next((t for t in prompt if not isinstance(t, int) or isinstance(t, bool)), None)
            if bad is not None:
                raise TypeError(f"prompt token ids must be ints, got {bad!r}")
            return list(prompt)
        raise TypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: int | None = None, priority: float = 0.5,
                    cache_salt: str | bytes | None = None) -> int:
        """Queues a request; returns its id. Raises ValueError/TypeError, changing nothing,
        for bad input (empty prompt, token id outside the vocabulary, prompt + max_tokens
        beyond max_seq_len, invalid parameters, an id already in use).

        priority: higher starts first under SchedulerConfig(queue_policy="priority").
        cache_salt: requests share prefix-cache blocks only with requests of the same salt.
        """
        self._check_open()
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        ids = self._prompt_ids(prompt)
        if request_id is None:
            request_id = next(self._ids)
            while self._bm.contains(request_id) or request_id in self._requests:
                request_id = next(self._ids)
        elif not isinstance(request_id, int) or isinstance(request_id, bool):
            raise TypeError(f"request_id must be an int, got {request_id!r}")
        bad_stop = next((t for t in params.stop_token_ids if t >= self.model_config.vocab_size), None)
        if bad_stop is not None:
            raise ValueError(f"stop_token_ids entry {bad_stop} is outside the vocabulary "
                             f"[0, {self.model_config.vocab_size})")
        eos = [] if params.ignore_eos else list(self.model_config.eos_token_ids)
        end_id = eos[0] if eos else -1
        stops = list(params.stop_token_ids) + eos[1:]
        if not isinstance(priority, (int, float)) or isinstance(priority, bool) or not math.isfinite(priority):
            raise ValueError(f"priority must be a finite number, got {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, (str, bytes)):
            raise TypeError(f"cache_salt must be a str or bytes, got {type(cache_salt).__name__}")
        now = time.monotonic()
        self._bm.add_request(request_id, array.array("i", ids), params.max_tokens, end_id, stops,
                             params.min_tokens, now, float(priority), cache_salt_key(cache_salt))
        self._finished_ids.discard(request_id)
        state = RequestState(
            request_id=request_id, prompt_token_ids=ids, params=params,
            seed=params.seed if params.seed is not None else self._sampler.new_seed(),
            stop_ids=eos + list(params.stop_token_ids),
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
            metrics=RequestMetrics(arrival_time=now))
        self._requests[request_id] = state
        self._num_prompt_logprobs += state.wants_prompt_logprobs
        return request_id

    def abort_request(self, request_id: int) -> bool:
        """Cancels a waiting or running request: the next step() frees its seat and blocks
        and returns its final output with finish_reason "abort" (its sampler state is
        released now, before the seat). Returns False for a request that has already
        finished; raises ValueError for an id the engine never saw."""
        self._check_open()
        if self._bm.abort_request(request_id):
            slot = self._bm.request_metrics(request_id)["seq_slot"]
            if slot >= 0:
                self._sampler.release_slot(slot)
            return True
        if request_id in self._finished_ids:
            return False
        raise ValueError(f"unknown request_id {request_id!r}")

    def has_unfinished_requests(self) -> bool:
        """True while some request has not delivered its final output."""
        return self._bm.has_unfinished() or bool(self._pending_outputs) or self._inflight is not None

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one step (schedule, forward, sample, update, respond, free); returns the
        outputs of the requests that advanced or ended in it.

        With overlap=True, step n's forward runs in a worker thread while step n-1's
        results are turned into outputs, and each call returns step n-1's outputs: the same
        outputs, one call later.

        Atomic: if the forward, the sampler or a user's logits processor raises, the
        exception reaches the caller and the engine is as it was before the step (same
        requests in the same states, no seat or block changed hands); calling step() again
        continues. Aborts requested before the step take effect regardless, and outputs
        already produced (the previous step's, with overlap) come with the next step that
        succeeds."""
        self._check_open()
        # on a GPU, everything a step does on the device (sampler state, sampling, token
        # copies) goes on the execution stream, ordered after the forward
        with self._runner.stream_context():
            return self._step_overlap() if self._pool is not None else self._step_plain()



    def _step_plain(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        batch = self._schedule()
        t1 = time.perf_counter()
        try:
            forwarded = self._forward(batch) if batch.num_seqs else None
            t2 = time.perf_counter()
            result = self._sample(batch, forwarded) if batch.num_seqs else None
        except BaseException:
            self._undo_schedule(batch)
            self._pending_outputs.extend(self._abort_outputs(batch))
            raise
        t3 = time.perf_counter()
        outputs, self._pending_outputs = self._pending_outputs, []
        outputs += self._abort_outputs(batch)
        if result is not None:
            outputs += self._respond(self._update(batch, forwarded, result))
            self._bm.free_finished()
            self._account(t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)
        return self._route(outputs)

    def _step_overlap(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        items = None
        if self._inflight is not None:  # step n-1: sampled last call; its C++ update is cheap
            prev, self._inflight = self._inflight, None
            items = self._update(*prev)
            self._bm.free_finished()  # what ended by a stop condition left every batch
        batch = self._schedule()
        t1 = time.perf_counter()
        future = self._pool.submit(self._forward, batch) if batch.num_seqs else None
        # While the forward runs: step n-1's outputs (detokenization, stop strings, streams).
        outputs, self._pending_outputs = self._pending_outputs, []
        if items is not None:
            outputs += self._respond(items)
        outputs += self._abort_outputs(batch)
        t2 = time.perf_counter()
        try:
            forwarded = future.result() if future is not None else None
            t3 = time.perf_counter()
            result = self._sample(batch, forwarded) if future is not None else None
        except BaseException:
            self._undo_schedule(batch)
            # `outputs` holds step n-1's and the aborts' outputs: the next step that succeeds delivers them
            self._pending_outputs = outputs + self._pending_outputs
            raise
        if result is not None:
            self._inflight = (batch, forwarded, result)
            self._account(t1 - t0, t3 - t2, time.perf_counter() - t3, t2 - t1)
        return self._route(outputs)

    def _account(self, schedule: float, forward: float, sample: float, update: float) -> None:
        t = self._timings
        t["schedule"] += schedule
        t["forward"] += forward
        t["sample"] += sample
        t["update"] += update
        t["steps"] += 1

    def _route(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is not None:
                queue.append(out)
        return outputs

    def _schedule(self) -> "_Batch":
        """The batch manager's schedule, the aborts it dropped, the sampler rows it seats."""
        bm = self._bm
        num_tokens, num_seqs, num_logits = bm.schedule(time.monotonic())
        events = bm.events()
        batch = _Batch(num_tokens, num_seqs, num_logits, events)
        try:
            self._seat_sampler_rows(events)
            if num_seqs and self._num_prompt_logprobs:
                batch.prompt_rows = self._prompt_logprob_rows(num_seqs)
        except BaseException:
            self._undo_schedule(batch)
            self._pending_outputs.extend(self._abort_outputs(batch))
            raise
        return batch

    def _abort_outputs(self, batch: "_Batch") -> list[RequestOutput]:
        """Final outputs of the requests the schedule dropped (after any output of theirs
        from the step before, with overlap)."""
        return [self._final_abort(rid) for rid in batch.events["aborted"]]

    def _undo_schedule(self, batch: "_Batch") -> None:
        """A step failed: roll the schedule back (the aborts it dropped stay dropped; the
        caller keeps their final outputs for the next step that succeeds)."""
        if self.device.type == "cuda":  # the failed step's queued copies and kernels finish first:
            self._runner.stream.synchronize()  # the next schedule rewrites the buffers they read
        self._unseat_sampler_rows(batch.events)
        self._bm.rollback()

    def _forward(self, batch: "_Batch") -> Forwarded:
        extra = None if batch.prompt_rows is None else batch.prompt_rows[0]
        return self._runner.forward(batch.num_tokens, batch.num_seqs, batch.num_logits, extra)

    def _sample(self, batch: "_Batch", forwarded: Forwarded) -> SampleResult:
        """Samples the batch (padding rows too: their tokens go to the scratch row); changes
        no state (_update commits it). On a GPU the tokens start their way to the host."""
        result = self._sampler.sample(forwarded.logits[: forwarded.num_rows], forwarded.slots)
        result.host_tokens, result.ready = self._runner.tokens_to_host(result.tokens)
        return result

    def _update(self, batch: "_Batch", forwarded: Forwarded, result: SampleResult) -> list[tuple]:
        """Commits a sampled step: sampler counters, the token buffer, the batch manager's
        update (stop conditions). Requests it ended have their sampler rows released and
        metrics read here, before free_finished() returns their seats."""
        bm, sampler = self._bm, self._sampler
        if result.ready is not None:
            result.ready.synchronize()  # the step's tokens have reached the host
        sampler.commit(result)
        self._runner.record_tokens(forwarded, result.tokens)
        bm.update_from_ptr(result.host_tokens.data_ptr(), batch.num_logits, time.monotonic())
        if batch.prompt_rows is not None:
            self._record_prompt_logprobs(forwarded.logits[forwarded.num_rows:], batch.prompt_rows[1])
        items = []
        for k, (rid, token, done, reason) in enumerate(bm.step_outputs()):
            metrics = None
            if done:
                metrics = bm.request_metrics(rid)
                sampler.release_slot(metrics["seq_slot"])
            items.append((rid, token, reason, result.logprobs[k], metrics))
        return items

    def _respond(self, items: list[tuple]) -> list[RequestOutput]:
        """Outputs of an updated step: text, stop strings (which end a request early),
        logprobs, metrics."""
        outputs = []
        for rid, token, reason, logprobs, metrics in items:
            state = self._requests[rid]
            done = metrics is not None
            new_text, stopped = state.append_token(token, logprobs, final=done)
            if stopped and not done:
                self._bm.finish_stopped(rid, time.monotonic())
                metrics = self._bm.request_metrics(rid)
                self._sampler.release_slot(metrics["seq_slot"])
            if metrics is None:
                outputs.append(state.output([token], new_text, False, None))
                continue
            state.metrics = metrics_from_core(metrics)
            if not stopped and metrics["stop_token"] >= 0:
                state.stop_reason = metrics["stop_token"]
            self._forget(rid)
            outputs.append(state.output([token], new_text, True, "stop" if stopped else FINISH_REASONS[reason]))
        return outputs

    def _seat_sampler_rows(self, events: dict) -> None:
        """Releases the rows of paused/aborted requests, then sets up the newly seated ones
        (a row is rewritten whole when seated, so no stale state is ever read)."""
        sampler = self._sampler
        for slot in events["paused_slots"] + events["aborted_slots"]:
            if slot >= 0:
                sampler.release_slot(slot)
        for rid, slot in zip(events["new_seated"], events["new_seated_slots"]):
            st = self._requests[rid]
            sampler.init_slot(slot, st.params, st.prompt_token_ids, st.token_ids, st.stop_ids, st.seed)

    def _unseat_sampler_rows(self, events: dict) -> None:
        """Undoes _seat_sampler_rows for a step that failed (paused requests get their
        seats back, so their rows are rebuilt from their tokens)."""
        sampler = self._sampler
        for slot in events["new_seated_slots"]:
            sampler.release_slot(slot)
        for rid, slot in zip(events["paused"], events["paused_slots"]):
            st = self._requests.get(rid)
            if st is not None:
                sampler.init_slot(slot, st.params, st.prompt_token_ids, st.token_ids, st.stop_ids, st.seed)

    def timings(self) -> dict[str, float]:
        """Seconds spent so far in each part of step() (schedule: batch manager and sampler
        rows; forward: the model — with overlap, the wait for it; sample: the sampler;
        update: stop checks, outputs, frees), and the number of steps that ran a forward."""
        return dict(self._timings)

    def reset_timings(self) -> None:
        self._timings = dict.fromkeys(("schedule", "forward", "sample", "update", "steps"), 0.0)

    def _forget(self, rid: int) -> None:
        state = self._requests.pop(rid)
        self._num_prompt_logprobs -= state.wants_prompt_logprobs
        self._finished_ids.add(rid)

    def _final_abort(self, rid: int) -> RequestOutput:
        state = self._requests[rid]
        self._forget(rid)
        state.metrics.finish_time = time.monotonic()
        return state.output([], "", True, "abort")

    def _prompt_logprob_rows(self, num_seqs: int) -> tuple[torch.Tensor, list[tuple[RequestState, int]]] | None:
        """Rows of this batch whose logits give prompt logprobs: (row indices, [(request, position)])."""
        r = self._runner
        rows: list[int] = []
        owners: list[tuple[RequestState, int]] = []
        qsl = r.query_start_loc[: num_seqs + 1].tolist()
        seq_lens = r.seq_lens[:num_seqs].tolist()
        for s, rid in enumerate(r.request_ids[:num_seqs].tolist()):
            state = self._requests[rid]
            if not state.wants_prompt_logprobs:
                continue
            first_pos = seq_lens[s] - (qsl[s + 1] - qsl[s])
            owed_from = len(state.prompt_logprobs) - 1  # position whose row predicts the next owed token
            for row in range(qsl[s], qsl[s + 1]):
                pos = first_pos + row - qsl[s]
                if owed_from <= pos < len(state.prompt_token_ids) - 1:
                    rows.append(row)
                    owners.append((state, pos))
        if not rows:
            return None
        return torch.tensor(rows, dtype=torch.int32), owners

    def _record_prompt_logprobs(self, logits: torch.Tensor, owners: list[tuple[RequestState, int]]) -> None:
        logprobs = torch.log_softmax(logits, dim=-1)
        for i, (state, pos) in enumerate(owners):
            state.prompt_logprobs.append(top_logprobs(logprobs[i], state.params.prompt_logprobs,
                                                      state.prompt_token_ids[pos + 1]))
            if not state.wants_prompt_logprobs:
                self._num_prompt_logprobs -= 1

    # ---- convenience -------------------------------------------------------------------------

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               request_id: int | None = None) -> Iterator[RequestOutput]:
        """Adds a request and yields its outputs step by step (other requests advance in
        the same steps). Several streams may be consumed interleaved. Closing the
        generator early aborts the request."""
        rid = self.add_request(prompt, params, request_id)
        queue: deque[RequestOutput] = deque()
        self._streams[rid] = queue
        finished = False
        try:
            while not finished:
                while not queue:
                    self.step()
                out = queue.popleft()
                finished = out.finished
                yield out
        finally:
            self._streams.pop(rid, None)
            if not finished and not self._closed and rid in self._requests:
                self.abort_request(rid)

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Adds the prompts, steps until all of them finish, returns their final outputs in
        input order. Other requests in the engine advance too (their outputs are not
        returned). A bad prompt or parameter raises before any of them is queued."""
        self._check_open()
        single = isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                              and isinstance(prompts[0], int))
        prompt_list = [prompts] if single else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(f"got {len(param_list)} SamplingParams for {len(prompt_list)} prompts")
        ids: list[int] = []
        try:
            for p, sp in zip(prompt_list, param_list):
                ids.append(self.add_request(p, sp))
        except Exception:
            for rid in ids:  # undo: the partly queued batch leaves no trace
                self._bm.remove_waiting(rid)
                self._num_prompt_logprobs -= self._requests.pop(rid).wants_prompt_logprobs
            raise
        results: dict[int, RequestOutput] = {}
        wanted = set(ids)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while len(results) < len(ids):
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[rid] for rid in ids]

    # ---- resources ---------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        bm = self._bm
        return {"num_requests": bm.num_requests, "num_waiting": bm.num_waiting, "num_active": bm.num_active,
                "num_blocks": bm.num_blocks, "num_free_blocks": bm.num_free_blocks,
                "num_reusable_blocks": bm.num_reusable_blocks, "num_slots": bm.num_slots,
                "num_free_slots": bm.num_free_slots, "total_reused_tokens": bm.total_reused_tokens,
                "num_reuse_hits": bm.num_reuse_hits}

    def check_resources(self) -> None:
        """Checks the pools' invariants and, when no request is left, that every block and
        seat is back. Raises RuntimeError describing what leaked."""
        self._bm.check_invariants()
        if self._bm.has_unfinished():
            return
        bm = self._bm
        if bm.num_free_blocks != bm.num_blocks:
            raise RuntimeError(f"{bm.num_blocks - bm.num_free_blocks} KV blocks leaked")
        bm.check_all_slots_free()

    def shutdown(self) -> None:
        """Releases the KV pool and the model. The engine cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._inflight = None
        if self._runner is not None:
            self._runner.close()
        self._runner = None  # type: ignore[assignment]

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
