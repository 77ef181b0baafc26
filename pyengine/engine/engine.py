"""The engine facade: what an application calls. Start-up is in startup.py, the step in
step_loop.py, request checks in requests.py, outputs in outputs.py."""

from __future__ import annotations

import array
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any, Sequence

import torch

from pyengine.config import KvCacheConfig, SchedulerConfig, SpeculativeConfig, StepCostModel, check_budget_ms
from pyengine.engine.chat import ChatOptions, Message, is_conversation
from pyengine.engine.one_thread import OneThreadGuard, one_thread
from pyengine.engine.outputs import RequestOutput
from pyengine.engine.requests import Prompt, RequestId, RequestTable
from pyengine.engine import kv_persistence
from pyengine.engine.startup import StartupError, kv_fingerprint, kv_pools, start_engine
from pyengine.engine.step_cost import OnlineStepCost
from pyengine.engine.step_loop import StepLoop
from pyengine.engine.stream import RequestStream
from pyengine.layers.cpu_features import cpu_info
from pyengine.sampling import SamplingParams, drafts_allowed

__all__ = ["Engine", "StartupError"]

logger = logging.getLogger("pyengine")


class Engine:
    """An in-process LLM engine driven by the caller, one synchronous `step()` at a time.

    model: a local Hugging Face model directory (config.json, safetensors, tokenizer).
    dtype: "float32", "bfloat16" or "float16" for weights and activations.
    max_seq_len: prompt + generated tokens of one request; defaults to the model's
        max_position_embeddings.
    seed: seeds the seeds drawn for requests that give none (None: random).
    overlap: run step n's forward in a worker thread while step n-1's outputs are built;
        each step() then returns the previous step's outputs (one step of extra latency to
        every request's first output), identical to those without overlap. The sequence slot
        pool doubles so that retiring and newly admitted requests can hold slots at once.
    device: "cpu" (default), "cuda" or "cuda:N": where weights, KV pool, forward and sampler
        live. On a GPU the forward runs on the engine's own execution stream.
    cuda_graphs: on a GPU, replay captured CUDA graphs for decode batches (padded up to the
        next captured size); False runs every batch eagerly. Ignored on the CPU.
    cuda_graph_batch_sizes: the batch sizes captured (default 1, 2, 4, 8, 16, ... up to
        max_batch_size).
    exact_fp32: on the CPU in float32, run every matmul through torch, so that logits are
        bit-identical to transformers' at the same batch shape. By default small (decode)
        batches use pyengine's own fp32 GEMV and run all layers in one C++ call, about twice as
        fast at batch 1; its sums run in another order, so a greedy token can differ from
        transformers' where the two best logits are within rounding noise of each other.
    pack_bf16_weights: in bfloat16 on a CPU with bf16 instructions (AVX512-BF16 or AMX), keep a
        copy of each linear weight in oneDNN's packed layout for the GEMMs of batches past the
        one-call decode rows (prefill, larger decode batches): those run 1.3-1.9x faster, for
        the weights' bytes again in memory (startup_report()["packed_weight_bytes"]). None
        (default): where that copy takes at most a quarter of the available memory; True:
        always; False: never.
    huge_page_weights: on the CPU, copy the weights at start-up into one anonymous memory region
        advised for 2 MiB transparent huge pages (default True), rather than compute from the
        checkpoint file's memory mapping: decode streams them faster (about 1.3x for a bf16
        model's weights on the machine of bench/README.md), for a copy's time at start-up.
        startup_report()["weight_memory"] says how many bytes the kernel backs with huge pages.
    quantization: quantize the checkpoint's float weights at load, into one of llama.cpp's block
        formats: "q8_0", "q5_0", "q5_1", "q4_0", "q4_k", "q5_k", "q6_k", or one of llama.cpp's
        mixtures "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m"
        (round to nearest, as llama-quantize does without an
        importance matrix; see `pyengine.quant`). The linear layers take that format (where a
        layer's rows do not fit it, the next one that fits); the output projection Q6_K (Q8_0 if
        its rows do not fit; Q8_0 stays Q8_0). On the CPU activations stay float32 (dtype must
        be float32); on a GPU the weight-only kernels take float32, bfloat16 or float16.
    quantize_lm_head: with `quantization`, False keeps the embedding table and lm_head in float32
        (False without `quantization` is a config error).
    lm_head_quantization: with `quantization`, the output projection's format (lm_head, or the
        embedding table when the model ties them) in place of the default Q6_K: e.g. "q4_0" for a
        faster step where the vocabulary is large, as llama-quantize's --output-tensor-type
        (the same fallback where its rows do not fit).
    tokenizer: a directory holding the tokenizer (tokenizer.json / tokenizer_config.json), used
        instead of the model's own; it must exist and hold one. By default the model directory's
        tokenizer (or the GGUF file's); a model without one takes token-id prompts only.
    generation_config: "auto" (default) reads the model directory's generation_config.json:
        its eos_token_id entries end requests (besides config.json's and the tokenizer's
        end-of-sequence ids), and its temperature, top_k, top_p, min_p, repetition_penalty and
        max_new_tokens become the defaults of the SamplingParams fields a request leaves unset
        (fields the caller set keep their values, even when equal to SamplingParams' defaults).
        "ignore" reads no generation_config.json; a path reads that file (or the one in that
        directory) instead. The defaults in force are in startup_report()["generation_config"].
    chat_template: a Jinja chat template for conversations, used instead of the tokenizer's
        own (see add_request).
    speculative_config: speculative decoding (SpeculativeConfig; None: off): a step verifies
        draft tokens of each generating request along with its next token, so it can yield
        several tokens for about the price of one. Greedy and seeded outputs are unchanged.
        Requests with repetition/presence/frequency penalties or logits processors do not
        speculate (docs/speculative_decoding.md).

    The CPU kernels run at the highest instruction-set level the CPU supports (see
    `pyengine.cpu_info()`); the PYENGINE_CPU_ISA environment variable ("generic", "avx2",
    "avx512", "neon") forces a lower one, and PYENGINE_CPU_VNNI=0 keeps the quantized kernels
    off VNNI (same results, for measuring).

    One thread drives an engine: a call from a second thread while another thread is inside
    the engine (a step, a stream() iterator's step, add_request, ...) raises RuntimeError.
    Calls from the same thread during a call (a logits processor aborting a request) are fine.
    """

    def __init__(self, model: str | Path, dtype: str | torch.dtype = "float32",
                 kv_cache_config: KvCacheConfig | None = None,
                 scheduler_config: SchedulerConfig | None = None,
                 max_seq_len: int | None = None, seed: int | None = None, overlap: bool = False,
                 device: str | torch.device = "cpu", cuda_graphs: bool = True,
                 cuda_graph_batch_sizes: Sequence[int] | None = None, exact_fp32: bool = False,
                 pack_bf16_weights: bool | None = None, huge_page_weights: bool = True,
                 quantization: str | None = None,
                 quantize_lm_head: bool = True, lm_head_quantization: str | None = None,
                 tokenizer: str | Path | None = None,
                 generation_config: str | Path = "auto", chat_template: str | None = None,
                 speculative_config: SpeculativeConfig | None = None) -> None:
        self._closed = True
        self._guard = OneThreadGuard()
        parts = start_engine(model=model, dtype=dtype, kv_cache_config=kv_cache_config,
                             scheduler_config=scheduler_config, max_seq_len=max_seq_len, seed=seed,
                             overlap=overlap, device=device, cuda_graphs=cuda_graphs,
                             cuda_graph_batch_sizes=cuda_graph_batch_sizes, exact_fp32=exact_fp32,
                             pack_bf16_weights=pack_bf16_weights, huge_page_weights=huge_page_weights,
                             quantization=quantization,
                             quantize_lm_head=quantize_lm_head, lm_head_quantization=lm_head_quantization,
                             tokenizer=tokenizer,
                             generation_config=generation_config, chat_template=chat_template,
                             speculative_config=speculative_config)
        self._parts = parts
        self.config = parts.config
        self.model_dir, self.model_config, self.tokenizer = parts.config.model, parts.model_config, parts.tokenizer
        self.dtype, self.kv_dtype, self.device = parts.config.dtype, parts.kv_dtype, parts.device
        self.max_seq_len, self.overlap = parts.max_seq_len, parts.config.overlap
        self.kv_cache_config, self.scheduler_config = parts.config.kv_cache_config, parts.config.scheduler_config
        self._bm, self._runner, self._sampler = parts.bm, parts.runner, parts.sampler
        self._requests = RequestTable(parts.model_config, parts.tokenizer, parts.config.tokenizer or parts.config.model,
                                      parts.generation, parts.max_seq_len, parts.config.chat_template)
        online = OnlineStepCost(parts.step_cost) if parts.step_cost_calibrated else None
        self._loop = StepLoop(self._bm, self._runner, self._sampler, self._requests, self.overlap, online,
                              parts.drafter)
        self._streams: dict[RequestId, deque[RequestOutput]] = {}  # open stream() iterators
        self._closed = False
        cap = parts.capacity
        logger.info("pyengine: %s (%s, %d layers, %s) ready: KV pool %d blocks x %d tokens = %.1f MiB (%s, %s); "
                    "start-up %s", self.model_dir, self.model_config.model_type, self.model_config.num_layers,
                    self.dtype, cap.num_blocks, cap.tokens_per_block, cap.num_blocks * cap.bytes_per_block / 2**20,
                    self.kv_dtype, cap.source, ", ".join(f"{n} {t:.2f} s" for n, t in parts.phases))

    # ---- requests ---------------------------------------------------------------------------

    @one_thread
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: RequestId | None = None, priority: float = 0.5,
                    cache_salt: str | bytes | None = None, *,
                    tools: Sequence[dict[str, Any]] | None = None, chat_template: str | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    add_generation_prompt: bool = True) -> RequestId:
        """Queues a request; returns its id. Raises ValueError/TypeError, changing nothing,
        for bad input (empty prompt, token id outside the vocabulary, prompt + max_tokens
        beyond max_seq_len, invalid parameters, an id already in use).

        prompt: text (needs the model's tokenizer), a list of token ids, a 1-D int tensor, or a
            conversation: a list of {"role": ..., "content": ...} messages, rendered to token ids
            with the tokenizer's chat template (transformers' apply_chat_template) and, with
            add_generation_prompt, the opening of the assistant's turn. A tokenizer without a
            chat template takes a conversation only with chat_template= (here or in Engine).
        params: unset fields take the model's generation defaults (see Engine's generation_config).
        request_id: an int in [0, 2**63) or a str; by default the engine assigns ints.
        priority: higher starts first under SchedulerConfig(queue_policy="priority").
        cache_salt: requests share prefix-cache blocks only with requests of the same salt.
        tools, chat_template, chat_template_kwargs: for a conversation: tool schemas for the
            template, a template instead of the tokenizer's, extra template variables (e.g.
            {"enable_thinking": False} for Qwen3).
        """
        self._check_open()
        chat = None
        if is_conversation(prompt) or tools is not None or chat_template is not None or chat_template_kwargs:
            if not is_conversation(prompt):
                raise ValueError("tools, chat_template and chat_template_kwargs apply to a conversation (a list of "
                                 "{'role', 'content'} messages), not to a text or token-id prompt")
            chat = ChatOptions(tools, chat_template, chat_template_kwargs or {}, add_generation_prompt)
        new = self._requests.prepare(prompt, params, request_id, priority, cache_salt, self._bm.contains, chat)
        now = time.monotonic()
        p = new.params
        # prompt logprobs need every prompt position computed: no blocks from the prefix cache
        self._bm.add_request(new.core_id, array.array("i", new.prompt_token_ids), p.max_tokens, new.end_id,
                             new.core_stop_ids, p.min_tokens, now, new.priority, new.cache_salt_key,
                             reuse_prefix=p.prompt_logprobs is None)
        if self.config.speculative_config is not None and not drafts_allowed(p):
            self._bm.set_max_draft_tokens(new.core_id, 0)
        self._requests.add(new, self._sampler.new_seed, now)
        return new.request_id

    @one_thread
    def abort_request(self, request_id: RequestId) -> bool:
        """Cancels a waiting or running request: the next step() frees its sequence slot and
        blocks and returns its final output with finish_reason "abort" (its sampler state is
        released now, before the slot). Returns False for a request that has already finished;
        raises ValueError for an id the engine does not know."""
        self._check_open()
        core_id = self._requests.core_id(request_id)
        if core_id is not None and self._bm.abort_request(core_id):
            slot = self._bm.request_metrics(core_id)["seq_slot"]
            if slot >= 0:
                self._sampler.release_slot(slot)
            return True
        if core_id is not None or self._requests.was_finished(request_id):
            return False
        raise ValueError(f"unknown request_id {request_id!r}")

    @one_thread
    def has_unfinished_requests(self) -> bool:
        """True while some request has not delivered its final output."""
        return self._bm.has_unfinished() or self._loop.has_work()

    # ---- the step -------------------------------------------------------------------------

    @one_thread
    def step(self, budget_ms: float | None = None) -> list[RequestOutput]:
        """Runs one step (schedule, forward, sample, update, respond, free); returns the
        outputs of the requests that advanced or ended in it.

        `budget_ms` (default: SchedulerConfig.step_budget_ms, None: no budget): a time budget
        for this step. Every generation row runs; prompt chunks are cut (in whole KV blocks)
        so that the step's time predicted by the step cost model fits; a step with nothing
        else to do computes at least one block of the first prompt. Outputs do not depend on
        the budget, only the step in which they arrive (docs/step_budget.md). ValueError for a
        budget that is not a positive number of milliseconds, before anything changes.

        With overlap=True, step n's forward runs in a worker thread while step n-1's
        results are turned into outputs, and each call returns step n-1's outputs: the same
        outputs, one call later.

        Atomic: if the forward, the sampler or a user's logits processor raises, the
        exception reaches the caller and the engine is as it was before the step (same
        requests in the same states, no sequence slot or block changed hands -- except that
        requests the step paused stay paused, to be recomputed); calling step() again
        continues. Aborts requested before the step take effect regardless, and
        outputs already produced (the previous step's, with overlap) come with the next step
        that succeeds."""
        budget = self.scheduler_config.step_budget_ms if budget_ms is None else check_budget_ms(budget_ms)
        self._check_open()
        outputs = self._loop.step(budget)
        if self._streams:
            for out in outputs:
                queue = self._streams.get(out.request_id)
                if queue is not None:
                    queue.append(out)
        return outputs

    def timings(self) -> dict[str, float]:
        """Seconds spent so far in each part of step() (schedule: batch manager and sampler
        rows; forward: the model -- with overlap, the wait for it; sample: the sampler;
        update: stop checks, outputs, frees), and the number of steps that ran a forward."""
        return self._loop.timings()

    @one_thread
    def reset_timings(self) -> None:
        self._loop.reset_timings()

    # ---- convenience -------------------------------------------------------------------------

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               request_id: RequestId | None = None) -> RequestStream:
        """Adds a request (now: bad input raises here) and returns an iterator of its outputs,
        step by step (each next() steps the engine until the request has an output; other
        requests advance in the same steps). Several streams may be consumed interleaved.
        Closing the iterator early (or dropping it) aborts the request."""
        rid = self.add_request(prompt, params, request_id)
        return self._open_stream(rid)

    def _open_stream(self, rid: RequestId) -> RequestStream:
        queue: deque[RequestOutput] = deque()
        self._streams[rid] = queue
        return RequestStream(self, rid, queue)

    def chat(self, messages: Sequence[Message], params: SamplingParams | None = None,
             request_id: RequestId | None = None, *, tools: Sequence[dict[str, Any]] | None = None,
             chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None) -> RequestStream:
        """Adds a conversation (see add_request) and returns an iterator of the reply's outputs,
        step by step, as stream() does; the last output's `text` is the whole reply. For the
        next turn, append {"role": "assistant", "content": reply} and the next user message:
        with prefix reuse on (the default) the earlier turns' full KV blocks are reused."""
        if not is_conversation(messages):
            raise TypeError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.80}")
        rid = self.add_request(messages, params, request_id, tools=tools, chat_template=chat_template,
                               chat_template_kwargs=chat_template_kwargs)
        return self._open_stream(rid)

    @one_thread
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Adds the prompts, steps until all of them finish, returns their final outputs in
        input order. Other requests in the engine advance too (their outputs are not
        returned). A bad prompt or parameter raises before any of them is queued."""
        self._check_open()
        single = isinstance(prompts, str) or is_conversation(prompts) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int))
        prompt_list = [prompts] if single else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(f"got {len(param_list)} SamplingParams for {len(prompt_list)} prompts")
        ids: list[RequestId] = []
        try:
            for p, sp in zip(prompt_list, param_list):
                ids.append(self.add_request(p, sp))
        except Exception:
            for rid in ids:  # undo: the partly queued batch leaves no trace
                core_id = self._requests.core_id(rid)
                self._bm.remove_waiting(core_id)
                self._requests.remove(core_id, finished=False)
            raise
        results: dict[RequestId, RequestOutput] = {}
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

    # ---- state and resources -----------------------------------------------------------------

    @one_thread
    def stats(self) -> dict[str, int]:
        """Requests, KV blocks, sequence slots (num_slots, num_free_slots), prefix-reuse
        totals and speculative-decoding totals (draft tokens verified and accepted) now. Print it with pprint for one line a figure."""
        bm = self._bm
        return {"num_requests": bm.num_requests, "num_waiting": bm.num_waiting, "num_active": bm.num_active,
                "num_blocks": bm.num_blocks, "num_free_blocks": bm.num_free_blocks,
                "num_reusable_blocks": bm.num_reusable_blocks, "num_slots": bm.num_slots,
                "num_free_slots": bm.num_free_slots, "total_reused_tokens": bm.total_reused_tokens,
                "num_reuse_hits": bm.num_reuse_hits, "num_draft_tokens": bm.total_draft_tokens,
                "num_accepted_draft_tokens": bm.total_accepted_draft_tokens}

    @one_thread
    def save_kv_cache(self, path: str | Path) -> dict[str, Any]:
        """Writes the reusable prefix-cache blocks (keys, tokens, K/V in the pool's dtype) and
        this engine's fingerprint to `path`, atomically (docs/kv_persistence.md). The engine
        must be idle (RuntimeError otherwise). Returns {"blocks", "bytes", "seconds"}."""
        self._check_open()
        return kv_persistence.save(path, self._bm, kv_pools(self._parts), kv_fingerprint(self._parts),
                                   busy=self._loop.has_work())

    @one_thread
    def load_kv_cache(self, path: str | Path) -> dict[str, Any]:
        """Puts the blocks of a save_kv_cache file back into the pool as reusable cached
        blocks, most recent first, as many as fit in free blocks holding no cached content.
        Raises pyengine.KvCacheFileError (a ValueError), with the pool unchanged, for another
        model or configuration (the differing fingerprint field), another format version, or a
        truncated or corrupt file; RuntimeError unless idle. Returns {"blocks_loaded",
        "blocks_skipped", "bytes", "seconds"}."""
        self._check_open()
        return kv_persistence.load(path, self._bm, kv_pools(self._parts), kv_fingerprint(self._parts),
                                   busy=self._loop.has_work())

    def startup_report(self) -> dict[str, Any]:
        """The start-up phases with their seconds, the KV capacity figures, the sequence slots,
        max_seq_len, the device, the captured CUDA graph sizes and the drafts per sequence of the
        verify batches captured too (speculative decoding: 1..k where graphs are on, else empty),
        and on the CPU the kernels' instruction-set level (with why, and the levels the CPU has)
        and the largest batch that
        runs all decoder layers in one C++ call (0: none), and the generation defaults in force
        (generation_config: the file read, the end-of-sequence ids, the sampling defaults), the
        step cost model of time-budgeted steps (step_cost_model()), and speculative decoding's
        draft model (None without one: its directory, layers, KV pool bytes, one-call rows) and
        the costs its adaptive draft length weighs drafts with (None when it is off), the bytes of
        the oneDNN-packed bf16 weights (packed_weight_bytes), and where the weights live
        (weight_memory: None where they were left where they were read -- a GPU, or
        huge_page_weights=False --, else {"bytes": the region's bytes in use, "huge_pages_advised",
        "huge_page_bytes": how many the kernel backs with 2 MiB pages now}), and what the weights
        are (weights: {"source": "checkpoint", "quantized at load", "gguf", "awq" or "gptq";
        "bytes_by_format": {"q4_k": bytes, "float32": bytes, ...} as the model holds them;
        "output_projection": its format or dtype; "plan": quantized at load, each checkpoint
        tensor's format or why it stayed float, else None})."""
        p = self._parts
        info = cpu_info()
        one_call = self._runner.cpu_decode
        arena = self._runner.model.weight_arena
        return {"phases": [{"name": n, "seconds": t} for n, t in p.phases], "kv_capacity": p.capacity.as_dict(),
                "num_seq_slots": self.config.num_seq_slots, "max_seq_len": self.max_seq_len,
                "device": str(self.device), "cuda_graph_batch_sizes": list(p.graph_sizes),
                "cuda_graph_verify_drafts": list(self._runner.verify_pad_drafts),
                "cpu_kernels": {"isa": info.isa, "reason": info.reason, "supported": list(info.supported),
                                "vnni": info.vnni, "amx": info.amx},
                "cpu_one_call_decode_max_rows": 0 if one_call is None else one_call.max_rows,
                "generation_config": p.generation.as_dict(),
                "step_cost_model": self.step_cost_model(), "draft_model": self._draft_model_report(),
                "adaptive_draft_length": p.draft_costs,
                "packed_weight_bytes": self._runner.model.packed_weight_bytes,
                "weight_memory": None if arena is None else arena.as_dict(),
                "weights": self._weights_report()}

    def _weights_report(self) -> dict[str, Any]:
        """startup_report()["weights"]."""
        model, plan = self._runner.model, self._parts.quant_plan
        return {"source": self._parts.weights_source, "bytes_by_format": model.weight_bytes_by_format,
                "output_projection": model.output_projection_format,
                "plan": None if plan is None else dict(plan.report)}

    def _draft_model_report(self) -> dict[str, Any] | None:
        drafter = self._parts.drafter
        if drafter is None:
            return None
        one_call = drafter.cpu_decode
        return {"path": str(self.config.speculative_config.draft_model), "num_layers": drafter.model.config.num_layers,
                "kv_pool_bytes": drafter.kv_pool_bytes,
                "cpu_one_call_decode_max_rows": 0 if one_call is None else one_call.max_rows}

    def step_cost_model(self) -> dict[str, Any]:
        """The step cost model of time-budgeted steps: its coefficients now (the start-up fit as
        corrected by the steps measured since, unless SchedulerConfig.step_cost_model fixed
        it), the margin the scheduler multiplies its predictions by (the 90th percentile of
        measured / predicted over the recent budget-bound steps, at least 1), the start-up
        coefficients, where those came from ("calibrated" or "configured"), how many steps
        corrected it and how many of those were budget-bound (a budget priced their prompt
        chunks or drafts)."""
        online = self._loop.step_cost
        if online is None:
            fit, margin = StepCostModel(*self._bm.step_cost_model()), 1.0
        else:
            fit, margin = online.model, online.margin
        return {**fit.as_dict(), "margin": margin, "startup": self._parts.step_cost.as_dict(),
                "source": "calibrated" if self._parts.step_cost_calibrated else "configured",
                "steps_observed": 0 if online is None else online.steps,
                "budget_bound_steps": 0 if online is None else online.bound_steps}

    @one_thread
    def check_resources(self) -> None:
        """Checks the pools' invariants and, when no request is left, that every block and
        sequence slot is back. Raises RuntimeError describing what leaked."""
        bm = self._bm
        bm.check_invariants()
        if bm.has_unfinished():
            return
        if bm.num_free_blocks != bm.num_blocks:
            raise RuntimeError(f"{bm.num_blocks - bm.num_free_blocks} KV blocks leaked")
        bm.check_all_slots_free()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine has been shut down")

    @one_thread
    def shutdown(self) -> None:
        """Releases the KV pool and the model. The engine cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        self._loop.close()
        if self._runner is not None:
            self._runner.close()
        self._runner = self._parts.runner = None  # type: ignore[assignment]
        self._loop.runner = None  # type: ignore[assignment]
        self._parts.drafter = self._loop.drafter = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
