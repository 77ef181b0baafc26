"""The engine: assembly at start-up and the synchronous step()."""

from __future__ import annotations

import array
import itertools
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from pyengine._core import CoreBatchManager
from pyengine.config import KvCacheConfig, SchedulerConfig
from pyengine.detokenizer import IncrementalDetokenizer
from pyengine.executor import ModelRunner
from pyengine.models import LlamaFamilyModel, ModelConfig
from pyengine.models.loader import load_tensors
from pyengine.outputs import RequestMetrics, RequestOutput
from pyengine.sampler import greedy_sample
from pyengine.sampling_params import SamplingParams

logger = logging.getLogger("pyengine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# C++ FinishReason values -> the names users see.
FINISH_REASONS = {1: "stop", 2: "stop", 3: "length", 4: "abort"}

Prompt = str | Sequence[int]


def _parse_dtype(dtype: str | torch.dtype, what: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"{what} must be one of {sorted(DTYPES)}, got {dtype!r}")


def _available_memory_bytes() -> int:
    """MemAvailable of /proc/meminfo (the OS's estimate of what can be allocated)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass
class _RequestState:
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)


class Engine:
    """An in-process LLM engine driven by the caller, one synchronous `step()` at a time.

    model: a local Hugging Face model directory (config.json, safetensors, tokenizer).
    dtype: "float32", "bfloat16" or "float16" for weights and activations.
    max_seq_len: prompt + generated tokens of one request; defaults to the model's
        max_position_embeddings.
    """

    def __init__(self, model: str | Path, dtype: str | torch.dtype = "float32",
                 kv_cache_config: KvCacheConfig | None = None,
                 scheduler_config: SchedulerConfig | None = None,
                 max_seq_len: int | None = None) -> None:
        self._closed = True
        self.kv_cache_config = kv_cache_config or KvCacheConfig()
        self.scheduler_config = scheduler_config or SchedulerConfig()
        self.dtype = _parse_dtype(dtype, "dtype")
        kv_dtype = self.dtype if self.kv_cache_config.dtype == "auto" else DTYPES[self.kv_cache_config.dtype]
        self.model_dir = Path(model)

        self.model_config = ModelConfig.from_model_dir(self.model_dir)
        mc = self.model_config
        if max_seq_len is None:
            max_seq_len = mc.max_position_embeddings
        if not isinstance(max_seq_len, int) or not 1 <= max_seq_len <= mc.max_position_embeddings:
            raise ValueError(f"max_seq_len must be in [1, max_position_embeddings={mc.max_position_embeddings}], "
                             f"got {max_seq_len!r}")
        self.max_seq_len = max_seq_len
        self.tokenizer = self._load_tokenizer(self.model_dir)

        names, optional = LlamaFamilyModel.weight_names(mc)
        weights = load_tensors(self.model_dir, names, self.dtype, optional)
        model_obj = LlamaFamilyModel(mc, weights, self.dtype, max_seq_len)

        sc, kc = self.scheduler_config, self.kv_cache_config
        tpb = kc.tokens_per_block
        bytes_per_token = mc.kv_bytes_per_token_per_elem * torch.empty((), dtype=kv_dtype).element_size()
        if kc.max_tokens is not None:
            num_blocks = math.ceil(kc.max_tokens / tpb)
        else:
            budget = int(_available_memory_bytes() * kc.free_memory_fraction)
            wanted = sc.max_batch_size * math.ceil(max_seq_len / tpb)  # every seat at full length
            num_blocks = min(wanted, budget // (bytes_per_token * tpb))
        if num_blocks * tpb < max_seq_len:
            raise ValueError(f"the KV pool holds {num_blocks * tpb} tokens ({num_blocks} blocks of {tpb}), "
                             f"fewer than max_seq_len={max_seq_len}: raise KvCacheConfig.max_tokens or lower max_seq_len")

        self._bm = CoreBatchManager(
            max_batch_size=sc.max_batch_size, max_num_tokens=sc.max_num_tokens, max_seq_len=max_seq_len,
            tokens_per_block=tpb, num_blocks=num_blocks, enable_chunked_context=sc.enable_chunked_prefill,
            policy=sc.capacity_scheduler_policy, vocab_size=mc.vocab_size)
        self._runner = ModelRunner(model_obj, self._bm, sc.max_batch_size, num_blocks, tpb, kv_dtype)
        logger.info("pyengine: %s (%s, %d layers) in %s; KV pool %d blocks x %d tokens (%.1f MiB, %s)",
                    self.model_dir, mc.model_type, mc.num_layers, self.dtype, num_blocks, tpb,
                    self._runner.kv_pool_bytes / 2**20, kv_dtype)
        self._requests: dict[int, _RequestState] = {}
        self._finished_ids: set[int] = set()
        self._ids = itertools.count()
        self._closed = False

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
                    request_id: int | None = None) -> int:
        """Queues a request; returns its id. Raises ValueError/TypeError, changing nothing,
        for bad input (empty prompt, token id outside the vocabulary, prompt + max_tokens
        beyond max_seq_len, invalid parameters, an id already in use)."""
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
        eos = [] if params.ignore_eos else list(self.model_config.eos_token_ids)
        end_id = eos[0] if eos else -1
        stops = list(params.stop_token_ids) + eos[1:]
        self._bm.add_request(request_id, array.array("i", ids), params.max_tokens, end_id, stops,
                             0, time.monotonic())
        self._finished_ids.discard(request_id)
        self._requests[request_id] = _RequestState(
            prompt_token_ids=ids, params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
            metrics=RequestMetrics(arrival_time=time.monotonic()))
        return request_id

    def abort_request(self, request_id: int) -> bool:
        """Cancels a request: it gets a final output with finish_reason "abort" from the next
        step(), which frees its seat and blocks. Returns False if it has already finished;
        raises ValueError for an id the engine never saw."""
        self._check_open()
        if self._bm.abort_request(request_id):
            return True
        if request_id in self._finished_ids:
            return False
        raise ValueError(f"unknown request_id {request_id!r}")

    def has_unfinished_requests(self) -> bool:
        return self._bm.has_unfinished()

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one step (schedule, forward, sample, update, respond, free); returns the
        outputs of the requests that advanced or ended in it."""
        self._check_open()
        bm = self._bm
        num_tokens, num_seqs, num_logits = bm.schedule(time.monotonic())
        events = bm.events()
        outputs = [self._final_abort(rid) for rid in events["aborted"]]
        if num_seqs == 0:
            return outputs
        logits = self._runner.forward(num_tokens, num_seqs, num_logits)
        tokens = greedy_sample(logits)
        bm.update_from_ptr(tokens.data_ptr(), num_logits, time.monotonic())
        events = bm.events()
        for rid, token, done, reason in zip(events["output_request_ids"], events["tokens"],
                                            events["finished"], events["finish_reasons"]):
            outputs.append(self._advance(rid, token, bool(done), reason))
        bm.free_finished()
        return outputs

    def _advance(self, rid: int, token: int, done: bool, reason: int) -> RequestOutput:
        state = self._requests[rid]
        state.token_ids.append(token)
        new_text = state.detokenizer.add([token], final=done)
        stop_reason = None
        if done:
            m = self._bm.request_metrics(rid)
            state.metrics = RequestMetrics(arrival_time=m["arrival_time"],
                                           first_scheduled_time=m["first_scheduled_time"],
                                           first_token_time=m["first_token_time"],
                                           finish_time=m["finish_time"], num_pauses=m["num_pauses"])
            stop_reason = m["stop_token"] if m["stop_token"] >= 0 else None
            del self._requests[rid]
            self._finished_ids.add(rid)
        return RequestOutput(request_id=rid, prompt_token_ids=state.prompt_token_ids,
                             token_ids=list(state.token_ids), new_token_ids=[token],
                             text=state.detokenizer.text, new_text=new_text, finished=done,
                             finish_reason=FINISH_REASONS.get(reason) if done else None,
                             stop_reason=stop_reason, metrics=state.metrics)

    def _final_abort(self, rid: int) -> RequestOutput:
        state = self._requests.pop(rid)
        self._finished_ids.add(rid)
        state.metrics.finish_time = time.monotonic()
        return RequestOutput(request_id=rid, prompt_token_ids=state.prompt_token_ids,
                             token_ids=list(state.token_ids), new_token_ids=[],
                             text=state.detokenizer.text, new_text="", finished=True,
                             finish_reason="abort", metrics=state.metrics)

    # ---- convenience -------------------------------------------------------------------------

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
                del self._requests[rid]
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
                "num_slots": bm.num_slots, "num_free_slots": bm.num_free_slots}

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
        self._runner = None  # type: ignore[assignment]

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
