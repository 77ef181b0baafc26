"""Start-up: the engine is assembled in phases, each timed, and a failure in any of them raises
StartupError naming the phase, with nothing left behind.

    config       EngineConfig checked against the model's config.json (or a GGUF file's metadata);
                 device; tokenizer
    weights      safetensors (or the GGUF file's tensors) -> the model's tensors on the device;
                 the draft model's too (speculative decoding with a draft model)
    kv_capacity  the two-pass measurement: a small cache, a worst-case dummy batch, its memory
                 peak -> the pool size (pyengine/runtime/kv_capacity.py has the formula)
    scheduler    the C++ batch manager with the real pool size, and the sampler
    executor     the model runner (KV pool, metadata views), the draft model's runner (its KV
                 pool), then CUDA graphs on a GPU
"""

from __future__ import annotations

import array
import contextlib
import logging
import math
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from pyengine import gguf
from pyengine.config import EngineConfig, SpeculativeConfig, StepCostModel
from pyengine.core import CoreBatchManager
from pyengine.dtypes import KV_CACHE_DTYPES
from pyengine.engine import kv_persistence, step_cost
from pyengine.engine.generation_config import GenerationDefaults, generation_defaults
from pyengine.engine.requests import load_tokenizer
from pyengine.layers.cpu_features import cpu_info
from pyengine.models import LlamaFamilyModel, ModelConfig, model_class
from pyengine.models.config import check_model_dir
from pyengine.models.loader import load_tensors
from pyengine.quant import QuantizedWeight
from pyengine.quant.on_load import LINEAR_SUFFIXES, QuantPlan
from pyengine.quant.prequantized import PrequantizedSpec, load_prequantized
from pyengine.runtime.cuda_graphs import DecodeGraphs, check_graph_batch_sizes, default_graph_batch_sizes
from pyengine.runtime.device import resolve_device
from pyengine.runtime import host_memory
from pyengine.runtime.heap import release_free_heap
from pyengine.runtime.kv_capacity import (SKIP_ENV, CpuMemoryProbe, CudaMemoryProbe, KvCapacity, MemoryReading,
                                          capacity_from_reading, configured_capacity, skip_requested)
from pyengine.runtime.draft_runner import DraftModelRunner
from pyengine.runtime.model_runner import ModelRunner
from pyengine.sampling import Sampler

logger = logging.getLogger(__name__)

PHASES = ("config", "weights", "kv_capacity", "scheduler", "executor")


class StartupError(RuntimeError):
    """Engine(...) failed; `phase` names the start-up phase ("config", "weights",
    "kv_capacity", "scheduler", "executor") and the original exception is the cause."""

    __module__ = "pyengine"  # raised to users as pyengine.StartupError, wherever it is defined

    def __init__(self, phase: str, error: BaseException) -> None:
        super().__init__(f"pyengine start-up failed in phase '{phase}': {type(error).__name__}: {error}")
        self.phase = phase
        self.error = error


@dataclass
class EngineParts:
    """What start-up built, handed to the Engine."""

    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Any
    device: torch.device
    kv_dtype: torch.dtype
    max_seq_len: int
    graph_sizes: list[int] = field(default_factory=list)
    capacity: KvCapacity | None = None
    bm: CoreBatchManager | None = None
    sampler: Sampler | None = None
    runner: ModelRunner | None = None
    phases: list[tuple[str, float]] = field(default_factory=list)
    quant_plan: QuantPlan | None = None  # the formats quantize-on-load chose, tensor by tensor
    prequantized: PrequantizedSpec | None = None  # an AWQ / GPTQ checkpoint's quantization_config
    gguf_header: gguf.GGUFHeader | None = None  # a GGUF file's tensor table, until the weights are read
    # where the weights came from: "gguf", "awq", "gptq", "quantized at load" or "checkpoint"
    weights_source: str = "checkpoint"
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)  # eos ids, sampling defaults
    kv_loaded: dict[str, Any] | None = None  # KvCacheConfig.load_from's load_kv_cache report
    step_cost: StepCostModel | None = None  # the start-up step cost model (time-budgeted steps)
    step_cost_calibrated: bool = False  # fitted at start-up (else SchedulerConfig.step_cost_model)
    draft_config: ModelConfig | None = None  # speculative decoding's draft model, if any
    draft_model: LlamaFamilyModel | None = None  # (until the executor phase hands it to its runner)
    drafter: DraftModelRunner | None = None
    draft_costs: dict[str, float] | None = None  # the adaptive draft length's (None: not adaptive)


@contextlib.contextmanager
def _phase(phases: list[tuple[str, float]], name: str) -> Iterator[None]:
    """Times a start-up phase; a failure in it raises StartupError naming the phase."""
    start = time.perf_counter()
    try:
        yield
    except Exception as e:
        # The error keeps its traceback (file and line for the report) but not the locals of its
        # frames: weights loaded before the failure are freed even while the caller holds it.
        traceback.clear_frames(e.__traceback__)
        raise StartupError(name, e) from e
    phases.append((name, time.perf_counter() - start))


def start_engine(**engine_args: Any) -> EngineParts:
    """Runs the phases on Engine(...)'s arguments; raises StartupError."""
    try:
        return _run_phases(engine_args)
    except StartupError as e:
        # what the phases built (the model, the KV pool) goes now, not when the caller drops the error
        traceback.clear_frames(e.__traceback__)
        raise


def _run_phases(engine_args: dict[str, Any]) -> EngineParts:
    phases: list[tuple[str, float]] = []
    with _phase(phases, "config"):
        parts = _configure(EngineConfig(**engine_args))
        parts.phases = phases
    with _phase(phases, "weights"):
        model = _load_model(parts)
        if parts.draft_config is not None:
            parts.draft_model = _load_draft_model(parts)
        if parts.graph_sizes and not model.cuda_graphs_ok:
            logger.info("pyengine: %s decodes eagerly (no CUDA graphs): its forward keeps bookkeeping a graph "
                        "replay would skip", type(model).__name__)
            parts.graph_sizes = []
    with _phase(phases, "kv_capacity"):
        parts.capacity = _kv_capacity(parts, model)
    with _phase(phases, "scheduler"):
        parts.bm = _batch_manager(parts, parts.capacity.num_blocks, model)
        parts.sampler = Sampler(parts.bm.num_slots, parts.model_config.vocab_size, parts.config.seed, parts.device)
    with _phase(phases, "executor"):
        sc = parts.config.scheduler_config
        parts.runner = _runner(parts, model, parts.bm, sc.max_batch_size, parts.capacity.num_blocks,
                               sc.max_num_tokens)
        if parts.draft_model is not None:
            parts.drafter = DraftModelRunner(parts.draft_model, parts.capacity.num_blocks,
                                             parts.config.kv_cache_config.tokens_per_block, parts.kv_dtype,
                                             parts.bm.max_blocks_per_seq, parts.model_config.vocab_size)
            parts.draft_model = None
        if parts.graph_sizes:  # after the KV pool: graphs read it at a fixed address
            try:
                parts.runner.decode_pad_sizes = parts.graph_sizes
                spec = parts.config.speculative_config
                drafts = range(1, spec.num_speculative_tokens + 1) if spec is not None else ()
                parts.runner.graphs = DecodeGraphs(parts.runner, parts.graph_sizes, drafts)
                parts.runner.verify_pad_drafts = parts.runner.graphs.verify_drafts
            except BaseException:
                parts.runner.close()
                raise
        try:  # before a KV file is loaded: the dummy batches write into free blocks
            _step_cost_model(parts)
        except BaseException:
            parts.runner.close()
            raise
        if parts.config.kv_cache_config.load_from is not None:
            try:
                parts.kv_loaded = kv_persistence.load(parts.config.kv_cache_config.load_from, parts.bm,
                                                      kv_pools(parts), kv_fingerprint(parts))
            except BaseException:
                parts.runner.close()
                raise
    if parts.device.type == "cpu":
        # what start-up freed since the load's own trim: the dummy batches of the KV capacity probe
        # and of the step cost model (qwen3-0.6b shape, Q8_0: 34 MB more returned here)
        release_free_heap()
    return parts


def kv_pools(parts: EngineParts) -> list[Any]:
    """The KV pools a block id indexes: the target's, then the draft model's if there is one."""
    return [parts.runner.kv_pool] + ([] if parts.drafter is None else [parts.drafter.kv_pool])


def kv_fingerprint(parts: EngineParts) -> dict[str, Any]:
    """The facts a saved KV cache must share with this engine (pyengine/engine/kv_persistence.py)."""
    return kv_persistence.fingerprint(parts.config, parts.kv_dtype, kv_pools(parts))


def _load_model(parts: EngineParts) -> Any:
    """The weights phase: reads (and converts) the weights and builds the model. Its own frame,
    so that a failure's traceback, once cleared, holds none of the tensors read so far."""
    mc = parts.model_config
    cls = model_class(mc)
    names, optional = cls.weight_names(mc)
    if parts.config.quantization is not None:
        parts.quant_plan = QuantPlan.create(parts.config.quantization, mc.tie_word_embeddings,
                                            parts.config.quantize_lm_head, mc.num_layers,
                                            parts.config.lm_head_quantization)
    if parts.gguf_header is not None:
        weights = gguf.load_weights(parts.gguf_header, mc, names, parts.config.dtype, optional)
        parts.gguf_header = None
        parts.weights_source = "gguf"
    elif parts.prequantized is not None:  # AWQ / GPTQ: repacked, not quantized again
        parts.weights_source = parts.prequantized.method
        weights = load_prequantized(parts.config.model, names, parts.config.dtype, optional, parts.prequantized,
                                    LINEAR_SUFFIXES)
    else:
        weights = _load_checkpoint(parts.config.model, names, parts.config.dtype, optional, parts.quant_plan)
        parts.weights_source = "checkpoint" if parts.quant_plan is None else "quantized at load"
    model = cls(mc, weights, parts.config.dtype, parts.max_seq_len, parts.device,
                exact_fp32=parts.config.exact_fp32)
    _place_weights(parts.config.huge_page_weights, model)
    _pack_bf16_weights(parts.config.pack_bf16_weights, model)
    if parts.quant_plan is not None:
        logger.info("quantized at load to %s: %s", parts.config.quantization, parts.quant_plan.summary())
    if parts.quant_plan is not None or model.quantized:  # (AWQ / GPTQ checkpoints are quantized models)
        del weights
        release_free_heap()  # the float copies converted one at a time, the blocks before interleaving
    return model


def _load_checkpoint(model_dir: Any, names: list[str], dtype: torch.dtype, optional: tuple[str, ...],
                     plan: QuantPlan | None) -> dict[str, Any]:
    """A Hugging Face checkpoint's tensors in `dtype`, quantized at load where `plan` says. The
    quantizers read fp32 values: with 16-bit activations (a GPU's) the tensors load in fp32, and
    those that stay float are rounded to `dtype` after."""
    if plan is None:
        return load_tensors(model_dir, names, dtype, optional)
    if dtype == torch.float32:
        return load_tensors(model_dir, names, dtype, optional, convert=plan.convert)

    def convert(name: str, t: torch.Tensor) -> torch.Tensor | QuantizedWeight:
        w = plan.convert(name, t)
        return w if isinstance(w, QuantizedWeight) else w.to(dtype)

    return load_tensors(model_dir, names, torch.float32, optional, convert=convert)


def _place_weights(setting: bool, model: LlamaFamilyModel) -> None:
    """EngineConfig.huge_page_weights: a CPU model's weights move into one region of huge pages
    (pyengine/runtime/weight_arena.py)."""
    if not setting:
        return
    arena = model.place_weights_in_huge_pages()
    if arena is not None:
        logger.info("pyengine: weights (%.0f MB) copied into anonymous memory, huge pages %s", arena.used / 1e6,
                    "advised" if arena.huge_pages_advised else "not available")


# pack_bf16_weights=None packs while the copies take at most this share of the available memory
PACKED_WEIGHTS_MAX_MEMORY_SHARE = 0.25


def _pack_bf16_weights(setting: bool | None, model: LlamaFamilyModel) -> None:
    """EngineConfig.pack_bf16_weights: True packs what can be packed, False nothing, None what
    fits in a quarter of the available memory (a copy of the weights must not crowd out the KV
    cache, nor fail to fit)."""
    if setting is False:
        return
    weights = model.packable_bf16_weights()
    if not weights:
        return
    size = sum(w.nbytes for w in weights)
    if setting is None and size > PACKED_WEIGHTS_MAX_MEMORY_SHARE * host_memory.available_bytes():
        logger.info("pyengine: bf16 weights not packed for oneDNN: the copy (%.0f MB) would take more than a "
                    "quarter of the available memory (pack_bf16_weights=True packs anyway)", size / 1e6)
        return
    model.pack_bf16_weights(weights)


def _load_draft_model(parts: EngineParts) -> LlamaFamilyModel:
    """Speculative decoding's draft model, in the engine's dtype (quantized at load with
    draft_quantization)."""
    spec = parts.config.speculative_config
    mc = parts.draft_config
    cls = model_class(mc)
    names, optional = cls.weight_names(mc)
    plan = None
    if spec.draft_quantization is not None:
        plan = QuantPlan.create(spec.draft_quantization, mc.tie_word_embeddings, True, mc.num_layers)
    weights = _load_checkpoint(spec.draft_model, names, parts.config.dtype, optional, plan)
    model = cls(mc, weights, parts.config.dtype, parts.max_seq_len, parts.device, exact_fp32=parts.config.exact_fp32)
    _place_weights(parts.config.huge_page_weights, model)
    if plan is not None:
        logger.info("draft model quantized at load to %s: %s", spec.draft_quantization, plan.summary())
        del weights
        release_free_heap()
    return model


def _check_draft_model(spec: SpeculativeConfig, target: ModelConfig, tokenizer: Any, max_seq_len: int) -> ModelConfig:
    """The draft model's config, once it is known to fit the target: a context of
    max_seq_len, the same tokenizer (same vocabulary: the ids it proposes mean the same tokens)."""
    path = spec.draft_model
    if check_model_dir(path).is_file():
        raise ValueError(f"draft_model {str(path)!r} is a file: give a Hugging Face checkpoint directory")
    mc = ModelConfig.from_model_dir(path)
    if mc.quantization_config is not None:
        raise ValueError(f"draft_model {str(path)!r} is a quantized checkpoint; the draft model loads float weights")
    if mc.max_position_embeddings < max_seq_len:
        raise ValueError(f"draft_model {str(path)!r} handles {mc.max_position_embeddings} positions "
                         f"(max_position_embeddings), fewer than the engine's max_seq_len={max_seq_len}: "
                         "lower max_seq_len")
    draft_tokenizer = load_tokenizer(path)
    if tokenizer is not None and draft_tokenizer is not None:
        if tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise ValueError(f"draft_model {str(path)!r} has another tokenizer than the model: its vocabulary "
                             f"({len(draft_tokenizer.get_vocab())} tokens) differs; a draft model must share "
                             "the model's tokenizer")
    elif mc.vocab_size != target.vocab_size:
        raise ValueError(f"draft_model {str(path)!r} has vocab_size {mc.vocab_size}, the model {target.vocab_size}, "
                         "and no tokenizer to compare: a draft model must share the model's tokenizer")
    return mc


def _configure(cfg: EngineConfig) -> EngineParts:
    device = resolve_device(cfg.device)
    isa = cpu_info()  # a bad PYENGINE_CPU_ISA fails here, naming the levels this CPU has
    logger.info("%s", isa)
    kv = cfg.kv_cache_config.dtype
    kv_dtype = None if kv == "auto" else KV_CACHE_DTYPES[kv]  # "auto": once the weights' kind is known
    if kv == "float8_e4m3":
        if device.type != "cuda":
            raise ValueError("KvCacheConfig.dtype='float8_e4m3' needs device='cuda' (the CPU kernels have no fp8)")
        if cfg.dtype == torch.float32:
            raise ValueError("KvCacheConfig.dtype='float8_e4m3' needs a bfloat16 or float16 model, got dtype=float32")
    header = tokenizer = None
    if check_model_dir(cfg.model).is_file():  # a GGUF file
        header = gguf.read_header(cfg.model)
        mc = gguf.model_config(header)
        _check_gguf_args(cfg, header, device)
        tokenizer = gguf.load_tokenizer(header)
    else:
        mc = ModelConfig.from_model_dir(cfg.model)
    max_seq_len = mc.max_position_embeddings if cfg.max_seq_len is None else cfg.max_seq_len
    if not 1 <= max_seq_len <= mc.max_position_embeddings:
        raise ValueError(f"max_seq_len must be in [1, max_position_embeddings={mc.max_position_embeddings}], "
                         f"got {max_seq_len!r}")
    prequantized = None
    if mc.quantization_config is not None:
        prequantized = PrequantizedSpec.from_config(mc.quantization_config)
        if cfg.quantization is not None:
            raise ValueError(f"quantization={cfg.quantization!r}: the checkpoint is already quantized "
                             f"({prequantized.method}); leave quantization unset")
        if device.type == "cpu" and cfg.dtype != torch.float32:
            raise ValueError(f"a {prequantized.method} checkpoint computes with float32 activations on the CPU: "
                             f"dtype must be 'float32', got {cfg.dtype}")
    if cfg.tokenizer is not None:
        tokenizer = load_tokenizer(cfg.tokenizer, required=True)
    elif header is None:
        tokenizer = load_tokenizer(cfg.model)
    if kv_dtype is None:
        # quantized weights compute in float32 but keep K and V in float16, as llama.cpp does: half
        # the bytes every decode step reads per token of context
        quantized = cfg.quantization is not None or prequantized is not None or (
            header is not None and bool(gguf_quantized_types(header)))
        kv_dtype = torch.float16 if quantized and device.type == "cpu" else cfg.dtype
    parts = EngineParts(config=cfg, model_config=mc, tokenizer=tokenizer, device=device,
                        kv_dtype=kv_dtype, max_seq_len=max_seq_len, graph_sizes=_graph_sizes(cfg, device),
                        gguf_header=header)
    parts.prequantized = prequantized
    if cfg.speculative_config is not None and cfg.speculative_config.method == "draft_model":
        parts.draft_config = _check_draft_model(cfg.speculative_config, mc, tokenizer, max_seq_len)
    parts.generation = generation_defaults(cfg.generation_config, cfg.model, mc.eos_token_ids, tokenizer,
                                           mc.vocab_size)
    return parts


def gguf_quantized_types(header: gguf.GGUFHeader) -> list[str]:
    """The block formats of a GGUF file's quantized tensors (none: a float file)."""
    blocks = gguf.quant_types()
    return sorted({t.type_name for t in header.tensors.values() if t.type_name in blocks})


def _check_gguf_args(cfg: EngineConfig, header: gguf.GGUFHeader, device: torch.device) -> None:
    """Engine arguments that a GGUF file rules out: quantization= (the file's tensors load as it
    stores them), and for quantized tensors on the CPU a dtype other than float32."""
    path = str(header.path)
    if cfg.quantization is not None:
        raise ValueError(f"quantization={cfg.quantization!r} does not apply to a GGUF file ({path!r}): its tensors "
                         "load as the file stores them, quantized or float; quantize with llama.cpp's llama-quantize, "
                         "or load the Hugging Face checkpoint with quantization=")
    quantized = gguf_quantized_types(header)
    if quantized and device.type == "cpu" and cfg.dtype != torch.float32:
        raise ValueError(f"GGUF file {path!r} holds quantized tensors ({', '.join(quantized)}), which compute with "
                         f"float32 activations on the CPU: dtype must be 'float32', got {cfg.dtype}")


def _graph_sizes(cfg: EngineConfig, device: torch.device) -> list[int]:
    """The decode batch sizes to capture (none on the CPU or with cuda_graphs=False)."""
    sc = cfg.scheduler_config
    sizes = cfg.cuda_graph_batch_sizes
    if sizes is not None:
        sizes = check_graph_batch_sizes(sizes, sc.max_batch_size, sc.max_num_tokens)
    if not cfg.cuda_graphs or device.type != "cuda":
        return []
    if sizes is None:
        sizes = [s for s in default_graph_batch_sizes(sc.max_batch_size) if s <= sc.max_num_tokens]
    return sizes


def _step_cost_model(parts: EngineParts) -> None:
    """The step cost model of time-budgeted steps: SchedulerConfig.step_cost_model as given, else
    fitted from a few timed dummy batches through the engine's own batch manager and runner."""
    sc, bm = parts.config.scheduler_config, parts.bm
    if sc.step_cost_model is not None:
        parts.step_cost = sc.step_cost_model
    else:
        shapes = step_cost.calibration_shapes(sc.max_batch_size, sc.max_num_tokens, parts.max_seq_len,
                                              parts.config.kv_cache_config.tokens_per_block)
        parts.step_cost = step_cost.calibrate(bm, parts.runner, shapes)
        parts.step_cost_calibrated = True
    m = parts.step_cost
    bm.set_step_cost_model(m.fixed_ms, m.per_seq_ms, m.per_token_ms, m.per_kpair_ms)


def _batch_manager(parts: EngineParts, num_blocks: int, model: LlamaFamilyModel) -> CoreBatchManager:
    sc, kc = parts.config.scheduler_config, parts.config.kv_cache_config
    return CoreBatchManager(
        max_batch_size=sc.max_batch_size, max_num_tokens=sc.max_num_tokens, max_seq_len=parts.max_seq_len,
        tokens_per_block=kc.tokens_per_block, num_blocks=num_blocks, enable_chunked_context=sc.enable_chunked_prefill,
        policy=sc.capacity_scheduler_policy, vocab_size=parts.model_config.vocab_size,
        num_seq_slots=parts.config.num_seq_slots, enable_block_reuse=kc.enable_block_reuse,
        queue_policy=sc.queue_policy, **_speculation(parts, model))


# The cost of one more query row relative to a one-row decode step, where SpeculativeConfig
# leaves it to the engine. CPU: the fp32 one-call decode of smollm-135m-shape took 16.5 ms
# for one row and 18.3 / 20.9 / 24.3 ms for 2 / 3 / 5 (2 threads, AVX-512). GPU: a decode
# step's weight reads dwarf a few more rows.
DRAFT_ROW_COST_CPU = 0.12
DRAFT_ROW_COST_CUDA = 0.02


def _speculation(parts: EngineParts, model: LlamaFamilyModel) -> dict[str, Any]:
    """The batch manager's speculative-decoding arguments (and parts.draft_costs: the adaptive
    draft length's costs, for startup_report())."""
    spec = parts.config.speculative_config
    if spec is None:
        return {}
    args = {"num_speculative_tokens": spec.num_speculative_tokens, "ngram_drafts": spec.method == "ngram",
            "model_drafts": spec.method == "draft_model",
            "prompt_lookup_min": spec.prompt_lookup_min, "prompt_lookup_max": spec.prompt_lookup_max}
    if spec.adaptive_draft_length:
        row = spec.draft_row_cost
        if row is None:
            row = DRAFT_ROW_COST_CUDA if parts.device.type == "cuda" else DRAFT_ROW_COST_CPU
        propose = spec.draft_propose_cost
        if propose is None:  # a batch-1 forward of either model reads its weights
            propose = 0.0 if parts.draft_model is None else \
                parts.draft_model.decode_weight_bytes / model.decode_weight_bytes
        parts.draft_costs = {"draft_row_cost": row, "draft_propose_cost": propose}
        args.update(adaptive_draft_length=True, **parts.draft_costs)
    return args


def _runner(parts: EngineParts, model: LlamaFamilyModel, bm: CoreBatchManager, rows: int, num_blocks: int,
            max_num_tokens: int) -> ModelRunner:
    kc = parts.config.kv_cache_config
    return ModelRunner(model, bm, rows, num_blocks, kc.tokens_per_block, parts.kv_dtype,
                       max_seq_len=parts.max_seq_len, max_num_tokens=max_num_tokens,
                       kv_scales=(kc.k_scale, kc.v_scale))


# ---- KV capacity: the two passes ---------------------------------------------------------------

def _kv_capacity(parts: EngineParts, model: LlamaFamilyModel) -> KvCapacity:
    kc, mc = parts.config.kv_cache_config, parts.model_config
    num_seq_slots = parts.config.num_seq_slots
    tpb = kc.tokens_per_block
    elems_per_token = mc.kv_bytes_per_token_per_elem
    if parts.draft_config is not None:  # the draft model's pool has a block for each of the model's
        elems_per_token += parts.draft_config.kv_bytes_per_token_per_elem
    bytes_per_block = elems_per_token * tpb * torch.empty((), dtype=parts.kv_dtype).element_size()
    if kc.free_memory_fraction is None or skip_requested():
        if kc.max_tokens is None:
            raise ValueError(f"{SKIP_ENV} is set but KvCacheConfig.max_tokens is not: the pool size must come "
                             "from somewhere")
        cap = configured_capacity(kc.max_tokens, tpb, bytes_per_block)
    else:
        reading = _measure_worst_case_batch(parts, model)
        cap = capacity_from_reading(
            reading, tokens_per_block=tpb, bytes_per_block=bytes_per_block,
            free_memory_fraction=kc.free_memory_fraction, max_tokens=kc.max_tokens,
            max_memory_bytes=kc.max_memory_bytes,
            seq_slot_cap_blocks=num_seq_slots * math.ceil(parts.max_seq_len / tpb))
    if cap.num_blocks < num_seq_slots:
        raise ValueError(f"the KV pool ({cap.num_blocks} blocks) cannot cover the sequence slot pool "
                         f"({num_seq_slots} sequence slots, one block each at least): raise KvCacheConfig.max_tokens "
                         "or max_memory_bytes, or lower max_batch_size")
    if cap.max_tokens_in_pool < parts.max_seq_len:
        raise ValueError(f"the KV pool holds {cap.max_tokens_in_pool} tokens ({cap.num_blocks} blocks of {tpb}), "
                         f"fewer than max_seq_len={parts.max_seq_len}: one request of max_seq_len tokens would "
                         "never fit; raise KvCacheConfig.max_tokens or lower max_seq_len")
    return cap


def _measure_worst_case_batch(parts: EngineParts, model: LlamaFamilyModel) -> MemoryReading:
    """Pass 1: a small cache, a worst-case dummy batch -- max_num_tokens in one forward, one long
    context plus a full batch of one-token rows -- and its memory peak."""
    sc, tpb = parts.config.scheduler_config, parts.config.kv_cache_config.tokens_per_block
    rows = max(1, min(sc.max_batch_size, sc.max_num_tokens))
    context = max(1, min(sc.max_num_tokens - (rows - 1), parts.max_seq_len - 1))
    blocks = math.ceil((context + 1) / tpb) + rows
    bm = CoreBatchManager(max_batch_size=rows, max_num_tokens=context + rows - 1,
                          max_seq_len=max(context + 1, rows), tokens_per_block=tpb, num_blocks=blocks,
                          enable_chunked_context=False, vocab_size=parts.model_config.vocab_size)
    runner = _runner(parts, model, bm, rows, blocks, context + rows - 1)
    bm.add_request(0, array.array("i", [1] * context), 1)
    for i in range(1, rows):
        bm.add_request(i, array.array("i", [1]), 1)

    def dummy_batch() -> None:
        num_tokens, num_seqs, num_logits = bm.schedule(0.0)
        runner.forward(num_tokens, num_seqs, num_logits)

    probe = CudaMemoryProbe(parts.device) if parts.device.type == "cuda" else CpuMemoryProbe()
    try:
        reading = probe.measure(dummy_batch)
    finally:
        bm.rollback()
        runner.close()
    del runner, bm  # pass 1's cache goes before pass 2 builds the real one
    if parts.device.type == "cuda":
        torch.cuda.empty_cache()
    return reading
