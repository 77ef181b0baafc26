"""User-facing configuration: the engine, its KV cache and its scheduler, each validated once
when it is made (values that depend on the model, such as max_seq_len, are checked at start-up)."""

from __future__ import annotations

import os
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Sequence

import torch

from pyengine.core import CAPACITY_POLICIES as _CAPACITY_POLICIES
from pyengine.core import QUEUE_POLICIES as _QUEUE_POLICIES
from pyengine.dtypes import KV_CACHE_DTYPES as _KV_CACHE_DTYPES
from pyengine.dtypes import model_dtype
from pyengine.quant.formats import quant_format
from pyengine.quant.on_load import MIXTURES

# The names the C++ core knows (one source: its enums, through the bindings).
CAPACITY_POLICIES = tuple(_CAPACITY_POLICIES)
QUEUE_POLICIES = tuple(_QUEUE_POLICIES)
KV_CACHE_DTYPES = ("auto", *_KV_CACHE_DTYPES)



def _device_type(device: str | torch.device) -> str | None:
    """"cpu" or "cuda" for a device argument; None for one that is not a device."""
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError):
        return None

@dataclass
class KvCacheConfig:
    """The paged KV cache.

    tokens_per_block: tokens in one KV block (the paging unit and the chunk unit).
    free_memory_fraction: the share of the memory left after a measured worst-case batch
        that the pool may take (see pyengine/kv_capacity.py). None, with `max_tokens`
        set, skips the measurement and uses `max_tokens` as is (so does the environment
        variable PYENGINE_SKIP_KV_ESTIMATION=1).
    max_tokens: caps the pool, in tokens.
    max_memory_bytes: caps the pool, in bytes.
    The pool is also never larger than every sequence slot at `max_seq_len` needs.
    dtype: storage dtype of K and V; "auto" follows the model's dtype, except that quantized
        weights (quantization=, a quantized GGUF file, an AWQ/GPTQ checkpoint), which compute in
        float32, keep a "float16" cache (as llama.cpp does by default). "float8_e4m3" (CUDA,
        bfloat16/float16 models) stores e4m3 values with per-tensor scales k_scale/v_scale
        (stored = value / scale).
    enable_block_reuse: requests sharing a prefix share its full KV blocks (prefix caching);
        freed blocks stay reusable until their memory is needed (least recently used first).
    load_from: a file written by Engine.save_kv_cache, loaded at start-up once the KV pool
        exists (as Engine.load_kv_cache does; a bad file fails the "executor" phase).
    """

    tokens_per_block: int = 16
    max_tokens: int | None = None
    free_memory_fraction: float | None = 0.9
    max_memory_bytes: int | None = None
    dtype: str = "auto"
    enable_block_reuse: bool = True
    k_scale: float = 1.0
    v_scale: float = 1.0
    load_from: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tokens_per_block, int) or self.tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be a positive int, got {self.tokens_per_block!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive int or None, got {self.max_tokens!r}")
        if self.free_memory_fraction is None:
            if self.max_tokens is None:
                raise ValueError("free_memory_fraction=None needs max_tokens: the pool size must come from somewhere")
        elif not isinstance(self.free_memory_fraction, (int, float)) or not 0.0 < self.free_memory_fraction <= 1.0:
            raise ValueError(f"free_memory_fraction must be in (0, 1] or None, got {self.free_memory_fraction!r}")
        if self.max_memory_bytes is not None and (not isinstance(self.max_memory_bytes, int)
                                                  or self.max_memory_bytes < 1):
            raise ValueError(f"max_memory_bytes must be a positive int or None, got {self.max_memory_bytes!r}")
        if self.dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"KV cache dtype must be one of {KV_CACHE_DTYPES}, got {self.dtype!r}")
        if self.load_from is not None and not isinstance(self.load_from, (str, os.PathLike)):
            raise TypeError(f"load_from must be a path or None, got {self.load_from!r}")
        for name in ("k_scale", "v_scale"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not (v > 0 and v != float("inf")):
                raise ValueError(f"{name} must be a positive finite number, got {v!r}")
            if v != 1.0 and self.dtype != "float8_e4m3":
                raise ValueError(f"{name}={v!r} applies to a float8_e4m3 cache only (dtype is {self.dtype!r})")


@dataclass(frozen=True)
class StepCostModel:
    """Milliseconds of a step: fixed_ms + per_seq_ms * sequences + per_token_ms * tokens +
    per_kpair_ms * attention pairs / 1000. Every coefficient is a finite number >= 0."""

    fixed_ms: float = 0.0
    per_seq_ms: float = 0.0
    per_token_ms: float = 0.0
    per_kpair_ms: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"StepCostModel.{f.name} must be a finite number >= 0, got {value!r}")

    def predict_ms(self, seqs: int, tokens: int, pairs: int) -> float:
        return self.fixed_ms + self.per_seq_ms * seqs + self.per_token_ms * tokens + self.per_kpair_ms * pairs * 1e-3

    def as_dict(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


def check_budget_ms(value: object, name: str = "budget_ms") -> float:
    """A step's time budget: a positive finite number of milliseconds; ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of milliseconds, got {value!r}")
    return float(value)


@dataclass
class SchedulerConfig:
    """Scheduling limits and policies.

    max_batch_size: sequences in one forward (and sequence slots).
    max_num_tokens: tokens in one forward (the token budget shared by prefill chunks and
        decode rows).
    enable_chunked_prefill: split long prompts into chunks (whole KV blocks but the last).
    capacity_scheduler_policy: "guaranteed_no_evict" (reserve KV blocks to completion),
        "max_utilization" (admit greedily, pause and recompute the latest request when
        blocks run out) or "static_batch" (admit only when nothing runs).
    queue_policy: "fcfs" (arrival order) or "priority" (higher `priority` of add_request
        first, arrival order among equals; under max_utilization the lowest-priority running
        request is the one paused).
    step_budget_ms: a time budget for every step (None: none); `Engine.step(budget_ms=...)`
        overrides it for one call. Prefill chunks are cut so that the step's predicted time
        fits; decode rows always run (docs/step_budget.md).
    step_cost_model: the model that predicts a step's time. None (default): fitted at start-up
        and corrected from every measured step. A StepCostModel: used as given, never refitted.
    """

    max_batch_size: int = 64
    max_num_tokens: int = 2048
    enable_chunked_prefill: bool = True
    capacity_scheduler_policy: str = "guaranteed_no_evict"
    queue_policy: str = "fcfs"
    step_budget_ms: float | None = None
    step_cost_model: StepCostModel | None = None

    def __post_init__(self) -> None:
        if self.step_budget_ms is not None:
            check_budget_ms(self.step_budget_ms, "step_budget_ms")
        if self.step_cost_model is not None and not isinstance(self.step_cost_model, StepCostModel):
            raise ValueError(f"step_cost_model must be a StepCostModel or None, got {self.step_cost_model!r}")
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive int, got {self.max_batch_size!r}")
        if not isinstance(self.max_num_tokens, int) or self.max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be a positive int, got {self.max_num_tokens!r}")
        if self.capacity_scheduler_policy not in CAPACITY_POLICIES:
            raise ValueError(f"capacity_scheduler_policy must be one of {CAPACITY_POLICIES}, "
                             f"got {self.capacity_scheduler_policy!r}")
        if self.queue_policy not in QUEUE_POLICIES:
            raise ValueError(f"queue_policy must be one of {QUEUE_POLICIES}, got {self.queue_policy!r}")


def quantization_name(value: str) -> str:
    """A quantize-on-load format's canonical name, or a mixture's (ValueError naming both kinds)."""
    if str(value).lower() in MIXTURES:
        return str(value).lower()
    try:
        return quant_format(value).name
    except ValueError as e:
        raise ValueError(f"{e}; or a mixture: {', '.join(MIXTURES)}") from None


SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (docs/speculative_decoding.md): each step of a generating request
    also carries up to `num_speculative_tokens` draft tokens, which the same forward verifies;
    the drafts that match what the model samples are accepted, so one forward can yield
    several tokens. Greedy and seeded outputs are those of decoding without it.

    method: "ngram" (prompt lookup: the tokens that followed the most recent earlier
        occurrence of the request's last n tokens, n from prompt_lookup_max down to
        prompt_lookup_min; no second model), or "draft_model" (a smaller model with the
        target's vocabulary, `draft_model`, proposes them; its KV pool is counted in the KV
        capacity).
    num_speculative_tokens: the most draft tokens a step of one request carries. Each draft is
        one more query row in the forward: on the CPU keep 1 + k within the rows the
        one-call decode path takes (startup_report()["cpu_one_call_decode_max_rows"]: 64 in
        fp32 at the avx2 and avx512 levels, 16 at the portable one, 4 in bf16 on CPUs with AMX),
        past which a step costs much more.
    prompt_lookup_min, prompt_lookup_max: the n-gram sizes tried ("ngram").
    draft_model: the draft model's Hugging Face checkpoint directory ("draft_model"; its
        tokenizer must be the target's). It runs in the engine's dtype, on the engine's device.
    draft_quantization: quantize the draft model's weights at load ("draft_model"; a format
        or mixture as EngineConfig.quantization takes, e.g. "q4_0"; on the CPU the engine's
        dtype must be float32). The model's own checkpoint quantized to 4 bits is a draft that agrees with
        it most of the time and reads a fraction of its bytes.
    adaptive_draft_length: each step, give a request the number of drafts (up to
        num_speculative_tokens) that its acceptance so far makes worth their cost, none while
        they do not pay (then a one-draft probe every 9 steps); the cost grows with the
        number of generating requests. False: always num_speculative_tokens.
    draft_row_cost: the cost of one more query row relative to a one-row decode step (None:
        0.12 on the CPU, 0.02 on a GPU).
    draft_propose_cost: the cost of proposing one draft in the same unit (None: 0 for
        "ngram"; for "draft_model", the bytes of the draft's layers and head over the model's,
        which is what a batch-1 forward of each reads).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    draft_model: str | Path | None = None
    draft_quantization: str | None = None
    adaptive_draft_length: bool = True
    draft_row_cost: float | None = None
    draft_propose_cost: float | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if self.method == "draft_model":
            if self.draft_model is None:
                raise ValueError("speculative method 'draft_model' needs draft_model=<checkpoint directory>")
            if not isinstance(self.draft_model, (str, Path)):
                raise TypeError(f"draft_model must be a path, got {self.draft_model!r}")
            self.draft_model = Path(self.draft_model)
        elif self.draft_model is not None:
            raise ValueError(f"draft_model={str(self.draft_model)!r} is for method='draft_model', "
                             f"not {self.method!r}")
        if self.draft_quantization is not None:
            if self.method != "draft_model":
                raise ValueError(f"draft_quantization={self.draft_quantization!r} is for method='draft_model', "
                                 f"not {self.method!r}")
            self.draft_quantization = quantization_name(self.draft_quantization)
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max ({self.prompt_lookup_max}) must be at least prompt_lookup_min "
                             f"({self.prompt_lookup_min})")
        if not isinstance(self.adaptive_draft_length, bool):
            raise TypeError(f"adaptive_draft_length must be a bool, got {self.adaptive_draft_length!r}")
        for name in ("draft_row_cost", "draft_propose_cost"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0 (or None), got {value!r}")
            setattr(self, name, float(value))


@dataclass
class EngineConfig:
    """Everything `Engine(...)` takes (see its docstring for each field)."""

    model: str | Path
    dtype: str | torch.dtype = "float32"
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_seq_len: int | None = None
    seed: int | None = None
    overlap: bool = False
    device: str | torch.device = "cpu"
    cuda_graphs: bool = True
    cuda_graph_batch_sizes: Sequence[int] | None = None
    exact_fp32: bool = False
    pack_bf16_weights: bool | None = None
    huge_page_weights: bool = True
    quantization: str | None = None
    quantize_lm_head: bool = True
    lm_head_quantization: str | None = None
    tokenizer: str | Path | None = None
    generation_config: str | Path = "auto"
    chat_template: str | None = None
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        self.model = Path(self.model)
        if isinstance(self.generation_config, str) and self.generation_config in ("auto", "ignore"):
            pass
        elif isinstance(self.generation_config, (str, Path)):
            self.generation_config = Path(self.generation_config)
        else:
            raise TypeError(f"generation_config must be 'auto', 'ignore' or a path, got {self.generation_config!r}")
        if self.chat_template is not None and (not isinstance(self.chat_template, str) or not self.chat_template):
            raise TypeError(f"chat_template must be a non-empty Jinja template string or None, "
                            f"got {self.chat_template!r}")
        if self.tokenizer is not None:
            if not isinstance(self.tokenizer, (str, Path)):
                raise TypeError(f"tokenizer must be a directory path or None, got {self.tokenizer!r}")
            self.tokenizer = Path(self.tokenizer)
        self.kv_cache_config = self.kv_cache_config or KvCacheConfig()
        self.scheduler_config = self.scheduler_config or SchedulerConfig()
        if not isinstance(self.kv_cache_config, KvCacheConfig):
            raise TypeError(f"kv_cache_config must be a KvCacheConfig, got {type(self.kv_cache_config).__name__}")
        if not isinstance(self.scheduler_config, SchedulerConfig):
            raise TypeError(f"scheduler_config must be a SchedulerConfig, got {type(self.scheduler_config).__name__}")
        if self.speculative_config is not None:
            if not isinstance(self.speculative_config, SpeculativeConfig):
                raise TypeError(f"speculative_config must be a SpeculativeConfig or None, "
                                f"got {type(self.speculative_config).__name__}")
            k = self.speculative_config.num_speculative_tokens
            if k >= self.scheduler_config.max_num_tokens:
                raise ValueError(f"num_speculative_tokens ({k}) must be below max_num_tokens "
                                 f"({self.scheduler_config.max_num_tokens})")
        self.dtype = model_dtype(self.dtype)
        if self.max_seq_len is not None and (not isinstance(self.max_seq_len, int) or self.max_seq_len < 1):
            raise ValueError(f"max_seq_len must be a positive int or None, got {self.max_seq_len!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise TypeError(f"seed must be an int or None, got {self.seed!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be a bool, got {self.cuda_graphs!r}")
        self.overlap = bool(self.overlap)
        if not isinstance(self.exact_fp32, bool):
            raise TypeError(f"exact_fp32 must be a bool, got {self.exact_fp32!r}")
        if self.pack_bf16_weights is not None and not isinstance(self.pack_bf16_weights, bool):
            raise TypeError(f"pack_bf16_weights must be a bool or None, got {self.pack_bf16_weights!r}")
        if not isinstance(self.huge_page_weights, bool):
            raise TypeError(f"huge_page_weights must be a bool, got {self.huge_page_weights!r}")
        if not isinstance(self.quantize_lm_head, bool):
            raise TypeError(f"quantize_lm_head must be a bool, got {self.quantize_lm_head!r}")
        on_cpu = _device_type(self.device) == "cpu"  # (a bad device is named when it is resolved)
        if self.quantization is not None:
            self.quantization = quantization_name(self.quantization)
            if on_cpu and self.dtype != torch.float32:
                raise ValueError(f"quantization={self.quantization!r} computes with float32 activations on the CPU: "
                                 f"dtype must be 'float32', got {self.dtype}")
        if not self.quantize_lm_head and self.quantization is None:
            raise ValueError("quantize_lm_head=False needs quantization=: it keeps the embedding table and lm_head "
                             "of a model quantized at load in float")
        if self.lm_head_quantization is not None:
            if self.quantization is None:
                raise ValueError(f"lm_head_quantization={self.lm_head_quantization!r} needs quantization=: it "
                                 "chooses the output projection's format in a model quantized at load")
            if not self.quantize_lm_head:
                raise ValueError(f"lm_head_quantization={self.lm_head_quantization!r} and quantize_lm_head=False "
                                 "exclude each other")
            try:
                self.lm_head_quantization = quant_format(self.lm_head_quantization).name
            except ValueError as e:
                raise ValueError(f"lm_head_quantization: {e}") from None
        spec = self.speculative_config
        if (isinstance(spec, SpeculativeConfig) and spec.draft_quantization is not None and on_cpu
                and self.dtype != torch.float32):
            raise ValueError(f"draft_quantization={spec.draft_quantization!r} computes with float32 activations on "
                             f"the CPU: dtype must be 'float32', got {self.dtype}")

    @property
    def num_seq_slots(self) -> int:
        """The sequence slot pool: one slot per batch row, twice that with the overlap loop so
        that a retiring request and its replacement can hold slots at once."""
        return self.scheduler_config.max_batch_size * (2 if self.overlap else 1)
