"""Hugging Face transformers as the correctness reference."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig


@lru_cache(maxsize=8)
def hf_model(model_dir: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int, dtype: torch.dtype = torch.float32,
              stop_at_eos: bool = False, device: str = "cpu") -> list[int]:
    """Greedy continuation by transformers' generate (one prompt, no padding)."""
    model = hf_model(str(model_dir), dtype, device)
    # Not stopping: an id past the vocabulary, which is never generated. (None is no answer: some
    # transformers versions fill an unset eos_token_id from the model's generation config.)
    eos = model.config.eos_token_id if stop_at_eos else model.config.get_text_config().vocab_size
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=eos)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=device),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                             generation_config=cfg)
    return out[0, len(prompt):].tolist()


def hf_topk_agrees(model_dir: Path, prompt: list[int], generated: list[int], dtype: torch.dtype, k: int,
                   device: str = "cpu") -> list[int]:
    """Positions where `generated` (teacher-forced) is NOT among transformers' top-k tokens."""
    model = hf_model(str(model_dir), dtype, device)
    ids = torch.tensor([prompt + generated], device=device)
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1: -1].float()
    topk = logits.topk(k, dim=-1).indices
    return [i for i, t in enumerate(generated) if t not in topk[i].tolist()]


def hf_teacher_forced_gaps(model_dir: Path, prompt: list[int], generated: list[int],
                           noisy_dtype: torch.dtype = torch.bfloat16,
                           device: str = "cpu") -> tuple[list[float], list[float]]:
    """Per generated position, teacher-forced (one forward over prompt + generated), with
    transformers in fp32 as the true model:

    gaps[i]: fp32's top logit minus fp32's logit of generated[i], relative to the largest
        |fp32 logit| at that position (0 where generated[i] is fp32's argmax);
    noise[i]: how far transformers' own `noisy_dtype` forward over the same tokens moves that
        position's logits, max_j |logit_j - fp32 logit_j|, relative to the same scale (the
        noise measure of pyengine/testing/checkpoints.py's "Logit margins")."""
    ids = torch.tensor([prompt + generated], device=device)
    with torch.inference_mode():
        ref = hf_model(str(model_dir), torch.float32, device)(ids).logits[0, len(prompt) - 1: -1].double()
        noisy = hf_model(str(model_dir), noisy_dtype, device)(ids).logits[0, len(prompt) - 1: -1].double()
    scale = ref.abs().amax(dim=-1)
    chosen = ref.gather(-1, torch.tensor(generated, device=device)[:, None])[:, 0]
    gaps = (ref.amax(dim=-1) - chosen) / scale
    noise = (noisy - ref).abs().amax(dim=-1) / scale
    return gaps.tolist(), noise.tolist()


#: A half-precision token may differ from the true (fp32) argmax only by a gap within this
#: many times the half-precision noise at that position (see tests/test_correctness.py's
#: test_bf16_greedy_is_close_to_transformers for the derivation).
NEAR_TIE_NOISES = 3.0
#: At most this fraction of half-precision tokens may differ from the true argmax (bf16 flips ~4%).
MAX_FLIP_FRACTION = 1 / 8


def near_tie_check(model_dir: Path, prompts: list[list[int]], outputs: list[list[int]],
                   noisy_dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> tuple[list, int, int]:
    """Teacher-forced agreement of half-precision greedy outputs with the fp32 model: (the
    (prompt length, position, gap, noise) of every token beyond a near-tie, the number of tokens
    that are not the fp32 argmax, the number of tokens)."""
    beyond, flips, positions = [], 0, 0
    for p, generated in zip(prompts, outputs):
        gaps, noise = hf_teacher_forced_gaps(model_dir, p, generated, noisy_dtype, device)
        beyond += [(len(p), i, round(g, 4), round(n, 4)) for i, (g, n) in enumerate(zip(gaps, noise))
                   if g > NEAR_TIE_NOISES * n]
        flips += sum(g > 0 for g in gaps)
        positions += len(gaps)
    return beyond, flips, positions


#: pyengine's fp32 GEMV adds in another order than torch's GEMM: its logits differ from
#: transformers' fp32 ones by at most 3.1e-6 of the largest |logit| (measured at every
#: instruction-set level on an AVX2 EPYC, 256 forwards of the tiny llama). Two logits then move
#: apart by at most ~6.2e-6, so a greedy token may differ from transformers' only where its
#: logit is within that of the top one; 3e-5 leaves a 5x margin. Real bugs move logits by 1e-3
#: and more.
FP32_NEAR_TIE = 3e-5


def fp32_first_divergence(model_dir: Path, prompt: list[int], tokens: list[int], reference: list[int],
                          device: str = "cpu") -> tuple[int, float] | None:
    """Where greedy `tokens` first differ from transformers' greedy `reference` (None if
    nowhere), and how near a tie that position is: (index, gap), gap = transformers' top fp32
    logit minus its logit of tokens[index], relative to the largest |logit| there. Later
    positions are not compared: the two continuations condition on different prefixes (as
    vLLM's check_outputs_equal / check_logprobs_close stop at the first mismatch)."""
    i = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
    if i is None:
        return None
    ids = torch.tensor([prompt + reference[:i]], device=device)
    with torch.inference_mode():
        logits = hf_model(str(model_dir), torch.float32, device)(ids).logits[0, -1].double()
    return i, float((logits.max() - logits[tokens[i]]) / logits.abs().max())


# ---- quantized weights ----

def _fake_quantize(x: torch.Tensor, block: int) -> torch.Tensor:
    """x through pyengine's 8-bit activation blocks (csrc/kernels/cpu/quant_blocks.h): per `block`
    values d = max|x| / 127, q = round-half-even(x * (1 / d)), x ~= q * d, in fp32."""
    v = x.reshape(-1, block)
    d = v.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    return (torch.round(v * inv) * d).reshape(x.shape)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


def _amx_prompt_rows(module: torch.nn.Module, prompt: dict, block: int) -> None:
    """Makes `module` (a quantized linear layer) compute the rows of the prompt's positions (the
    first prompt["len"] of the sequence) as the kernels' AMX path does -- input and weights
    rounded to bf16 -- and the other rows through the 8-bit activation blocks. (The hooks hold
    no reference to the model: it is freed, and its checkpoint's memory map closed, with its
    last reference.)"""
    weight_bf16 = _bf16(module.weight.detach())

    def stash(m, args):
        m.raw_input = args[0]
        return (_fake_quantize(args[0], block),)

    def prompt_rows(m, args, out):
        p = prompt["len"]
        out = out.clone()
        out[:, :p] = torch.nn.functional.linear(_bf16(m.raw_input[:, :p]), weight_bf16, m.bias)
        return out

    module.register_forward_pre_hook(stash)
    module.register_forward_hook(prompt_rows)


def quantized_hf_model(model_dir: Path, formats: dict[str, str], quantize_activations: bool = True,
                       amx_prompt: bool = False):
    """transformers' model of `model_dir` in fp32 with each weight named in `formats` (tensor name
    -> format, as pyengine's QuantPlan.report) replaced by its quantized-then-dequantized values,
    and with `quantize_activations` each such linear layer's input passed through the 8-bit
    activation blocks pyengine's kernels multiply with: the same math as pyengine's quantized
    forward, in another order of fp32 additions.

    `amx_prompt`: the math of an engine whose kernels have their AMX path (16 rows of x or more,
    where pyengine.cpu_info().amx) and that prefills its prompts in one step of 16 tokens or more
    but decodes fewer than 16 sequences at a time: the linear layers but the output projection
    compute the prompt's positions with bf16 inputs and weights, everything else as above. The
    caller sets `model.prompt_state["len"]` before each forward (quantized_teacher_forced_gaps
    does)."""
    from pyengine.quant import QuantizedWeight, quant_format

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    model.prompt_state = {"len": 0}
    with torch.no_grad():
        for name, fmt in formats.items():
            if fmt.startswith("kept"):
                continue
            fmt = fmt.split(" ")[0]
            p = params[name]
            p.copy_(QuantizedWeight.quantize(p.detach(), fmt).dequantize())
            module = model.get_submodule(name.rsplit(".", 1)[0])
            if amx_prompt and isinstance(module, torch.nn.Linear) and module is not model.lm_head:
                _amx_prompt_rows(module, model.prompt_state, 32 if quant_format(fmt).block_elems == 32 else 256)
            elif quantize_activations and isinstance(module, torch.nn.Linear):
                block = 32 if quant_format(fmt).block_elems == 32 else 256
                module.register_forward_pre_hook(lambda m, args, block=block: (_fake_quantize(args[0], block),))
        if model.config.tie_word_embeddings and "lm_head.weight" not in formats:
            # tied: the embedding table is the output projection too, and its input is quantized
            fmt = formats.get("model.embed_tokens.weight", "kept")
            if quantize_activations and not fmt.startswith("kept"):
                block = 32 if quant_format(fmt.split(" ")[0]).block_elems == 32 else 256
                model.lm_head.register_forward_pre_hook(lambda m, args, block=block: (_fake_quantize(args[0], block),))
    return model


def quantized_teacher_forced_gaps(reference, float_activations, prompt: list[int],
                                  generated: list[int]) -> tuple[list[float], list[float]]:
    """Per generated position, teacher-forced: gaps[i] = `reference`'s top logit minus its logit of
    generated[i], relative to its largest |logit| (0 where generated[i] is its argmax);
    noise[i] = how far quantizing the activations moves that position's logits, max_j
    |reference logit_j - float_activations logit_j|, relative to the same scale."""
    ids = torch.tensor([prompt + generated])
    for m in (reference, float_activations):
        if hasattr(m, "prompt_state"):
            m.prompt_state["len"] = len(prompt)  # (read by amx_prompt models)
    with torch.inference_mode():
        ref = reference(ids).logits[0, len(prompt) - 1: -1].double()
        flt = float_activations(ids).logits[0, len(prompt) - 1: -1].double()
    scale = ref.abs().amax(dim=-1)
    chosen = ref.gather(-1, torch.tensor(generated)[:, None])[:, 0]
    return ((ref.amax(dim=-1) - chosen) / scale).tolist(), ((ref - flt).abs().amax(dim=-1) / scale).tolist()


def check_greedy_near_reference(engine, reference, float_activations, prompts: list[list[int]], max_tokens: int,
                                tolerance: float | None = None) -> None:
    """Greedy outputs of `engine` teacher-forced through `reference` (quantized_teacher_forced_gaps):
    every generated token is the reference's argmax or within a near-tie of it -- the gap at
    most the activation quantization's noise at that position (`tolerance` None) or at most
    `tolerance` (weight-only engines, whose reference differs only in the order of additions:
    `float_activations` unused) -- and at most MAX_FLIP_FRACTION of them are not its argmax."""
    from pyengine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    results = engine.generate(prompts, params, use_tqdm=False)
    beyond, flips, positions = [], 0, 0
    for p, r in zip(prompts, results):
        assert len(r.token_ids) == max_tokens
        gaps, noise = quantized_teacher_forced_gaps(reference, reference if tolerance is not None else
                                                    float_activations, p, r.token_ids)
        limits = noise if tolerance is None else [tolerance] * len(gaps)
        beyond += [(len(p), i, g, n) for i, (g, n) in enumerate(zip(gaps, limits)) if g > n]
        flips += sum(g > 0 for g in gaps)
        positions += len(gaps)
    assert not beyond, f"tokens beyond a near-tie (prompt length, position, gap, allowed): {beyond}"
    assert flips <= MAX_FLIP_FRACTION * positions, f"{flips} of {positions} tokens are not the reference argmax"
