"""Sampling: logits rows -> tokens, with per-request state indexed by sequence slot.

Every parameter lives in a tensor with one row per slot plus a scratch row past the last
(for padding rows that own no slot), so a batch mixing greedy, seeded and unseeded requests
with different parameters is processed in one vectorized pass. Randomness is counter-based:
a request's i-th token uses a uniform number derived from (its seed, i) alone, so a seeded
request yields the same tokens whatever it is batched with, and a paused request that is
recomputed draws the same numbers again. Sampling is by inverse CDF over the transformed
distribution.

Transforms, in transformers' order: repetition penalty, presence/frequency penalties,
min_tokens masking, then for sampled rows temperature, top-k, top-p, min-p.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

import pyengine.core._core as _core
from pyengine.sampling.logprobs import top_logprobs
from pyengine.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1


def _signed64(v: int) -> int:
    v &= _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


_GOLDEN = _signed64(0x9E3779B97F4A7C15)
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 values."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def counter_uniform(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """A uniform float64 in (0, 1] for each (seed, counter) pair: splitmix64 of a mix of both (the
    top value, (2**53 - 0.5) / 2**53, rounds to 1.0)."""
    x = seeds * _GOLDEN + (counters + 1) * _MIX2  # wraps modulo 2**64
    for _ in range(2):
        x = x ^ _shr(x, 30)
        x = x * _MIX1
        x = x ^ _shr(x, 27)
        x = x * _MIX2
        x = x ^ _shr(x, 31)
    return (_shr(x, 11).to(torch.float64) + 0.5) / float(1 << 53)


# ---- the transforms, each on a [n, vocab] float32 tensor with per-row parameters ----------

def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) as int32 (ties: the first; NaN: the first NaN). fp32 rows on
    the CPU take pyengine's kernel: one vectorized pass, a long row split between the threads
    (each reads about the share the output projection's thread wrote, from its own cache): ~10 us
    for a 152k vocabulary where torch's argmax and cast cost ~0.15 ms."""
    if logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1 \
            and logits.shape[1] > 0:
        out = torch.empty(logits.shape[0], dtype=torch.int32)
        _core._argmax_rows(out.data_ptr(), logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1],
                           torch.get_num_threads())
        return out
    return torch.argmax(logits, dim=-1).to(torch.int32)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor with one penalty per row."""
    p = penalty[:, None]
    penalized = torch.where(logits < 0, logits * p, logits / p)
    return torch.where(seen, penalized, logits)


def apply_presence_frequency(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                             frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI: logit -= frequency * count + presence * (count > 0), counts of generated tokens."""
    c = counts.to(logits.dtype)
    return logits - frequency[:, None] * c - presence[:, None] * (c > 0).to(logits.dtype)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """transformers' TopKLogitsWarper (ties with the k-th value are kept); k >= vocab disables."""
    vocab = logits.shape[-1]
    k = top_k.clamp(1, vocab)
    kmax = int(k.max())
    kth = logits.topk(kmax, dim=-1).values.gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor, candidates: int = 1024,
                tail_candidates: int | None = None) -> torch.Tensor:
    """transformers' TopPLogitsWarper: sort ascending, drop the tokens whose cumulative
    probability is <= 1 - p (the most likely token always stays). Sorting a whole
    vocabulary row is slow, so two partial sorts are tried first: when the `candidates`
    most likely tokens of every row already hold mass p (a peaked distribution), only they
    are sorted; when the `tail_candidates` (default: a quarter of the vocabulary) least likely
    hold more than 1 - p (a flat one), only they are. Otherwise the rows are sorted whole."""
    vocab = logits.shape[-1]
    probs = logits.softmax(dim=-1)
    limited = top_p < 1  # p = 1 keeps everything
    k = min(candidates, vocab)
    top_probs, top_idx = probs.topk(k, dim=-1)
    if bool(((top_probs.sum(dim=-1) >= top_p) | ~limited).all()):
        mass_before = top_probs.cumsum(dim=-1) - top_probs  # of the more likely tokens
        keep_sorted = mass_before < top_p[:, None]
        keep_sorted[:, 0] = True
        remove = torch.ones_like(logits, dtype=torch.bool).scatter_(1, top_idx, ~keep_sorted)
        return logits.masked_fill(remove & limited[:, None], float("-inf"))
    k = min(vocab // 4 if tail_candidates is None else tail_candidates, vocab - 1)
    if k > 0:
        low_probs, low_idx = probs.topk(k, dim=-1, largest=False)  # ascending
        cum = low_probs.cumsum(dim=-1)
        if bool((cum[:, -1] > (1 - top_p)).all()):
            remove_sorted = cum <= (1 - top_p)[:, None]
            remove = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, low_idx, remove_sorted)
            return logits.masked_fill(remove & limited[:, None], float("-inf"))
    sorted_logits, sorted_idx = torch.sort(logits, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= (1 - top_p)[:, None]
    remove[:, -1] = False
    return logits.masked_fill(remove.scatter(1, sorted_idx, remove), float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """transformers' MinPLogitsWarper: drop tokens with prob < min_p * max prob."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def sample_inverse_cdf(logits: torch.Tensor, uniform: torch.Tensor, group: int = 256) -> torch.Tensor:
    """One token per row from softmax(logits), chosen by the row's uniform number (see
    sample_probs_inverse_cdf)."""
    return sample_probs_inverse_cdf(logits.softmax(dim=-1), uniform, group)


def sample_probs_inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor, group: int = 256) -> torch.Tensor:
    """One token per row of `probs` (non-negative, not necessarily normalized), chosen by the
    row's uniform number: the first token whose cumulative probability exceeds u times the
    row's total. Two levels, so that only small cumulative sums are needed: pick the group of
    `group` tokens by the groups' masses, then the token inside it."""
    n, vocab = probs.shape
    padded = -(-vocab // group) * group
    if padded != vocab:
        probs = torch.nn.functional.pad(probs, (0, padded - vocab))
    groups = probs.view(n, -1, group)
    group_cdf = groups.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)
    target = uniform * group_cdf[:, -1]
    g = torch.searchsorted(group_cdf, target[:, None], right=True).clamp_(max=group_cdf.shape[1] - 1)
    before = torch.where(g > 0, group_cdf.gather(1, (g - 1).clamp(min=0)), torch.zeros_like(target[:, None]))
    inner_cdf = groups.gather(1, g[:, :, None].expand(n, 1, group)).squeeze(1).to(torch.float64).cumsum(dim=-1)
    t = torch.searchsorted(inner_cdf, target[:, None] - before, right=True).clamp_(max=group - 1)
    token = (g * group + t).squeeze(1)
    return _skip_zero_probability(token, probs, vocab)


def _skip_zero_probability(token: torch.Tensor, probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """A token of zero probability is never returned. Rounding can land on one: u * total at or
    past the last cumulative sum (u rounds up to 1.0 once in 2**53 draws) ends in the last
    group, and the two levels' float64 sums may differ in their last bit. Such a row takes the
    nearest earlier token of probability > 0 (the first later one if there is none)."""
    zero = probs.gather(1, token[:, None]).squeeze(1) <= 0
    if not bool(zero.any()):
        return token
    rows = probs[zero] > 0
    idx = torch.arange(rows.shape[1], device=token.device)
    at = token[zero][:, None]
    earlier = torch.where(rows & (idx <= at), idx, -1).amax(dim=1)
    later = torch.where(rows, idx, rows.shape[1]).amin(dim=1)
    token = token.clone()
    # clamp: a row whose probabilities are all zero or NaN keeps an in-vocabulary token
    token[zero] = torch.where(earlier >= 0, earlier, later).clamp_(max=vocab - 1)
    return token


# Seeds of the other random streams a sampled row may need (xor-ed into the request's seed):
# the draft model's draws, and the target's draw from the residual distribution after it
# rejects a draft.
_DRAFT_STREAM = _signed64(0x5DEECE66D2B7E151)
_RESIDUAL_STREAM = _signed64(0x2545F4914F6CDD1D)


@dataclass
class DraftRows:
    """A draft model's proposals as the verifying rows see them: `next_tokens` [n] (int64) is
    the draft that follows logits row i in its sequence (-1: none), `probs` [n, vocab] the
    distribution it was drawn from (rows without a draft, and greedy rows, unused), None when
    every draft was greedy."""

    next_tokens: torch.Tensor
    probs: torch.Tensor | None


def _verify_drafts(p: torch.Tensor, u: torch.Tensor, drafts: DraftRows, seeds: torch.Tensor,
                   generated: torch.Tensor) -> torch.Tensor:
    """Speculative sampling's rule (Leviathan et al. 2023; Chen et al. 2023): a row whose next
    row holds draft x, drawn from q, emits x with probability min(1, p(x) / q(x)), else a token
    drawn from max(p - q, 0) renormalized -- never x, so the batch manager sees the rejection
    --, which makes every emitted token distributed as p. Rows without a draft draw from p.
    p: the rows' target probabilities; u: their uniform numbers."""
    tokens = sample_probs_inverse_cdf(p, u)
    has = drafts.next_tokens >= 0
    if not bool(has.any()):
        return tokens
    idx = torch.nonzero(has).flatten()
    x = drafts.next_tokens[idx]
    p_rows, q_rows = p[idx], drafts.probs[idx].to(p.dtype)
    px = p_rows.gather(1, x[:, None]).squeeze(1)
    qx = q_rows.gather(1, x[:, None]).squeeze(1)
    accept = u[idx] * qx <= px
    residual = (p_rows - q_rows).clamp_(min=0)
    empty = residual.sum(dim=-1) <= 0  # p == q (then x is always accepted): anything valid
    residual = torch.where(empty[:, None], p_rows, residual)
    u2 = counter_uniform(seeds[idx] ^ _RESIDUAL_STREAM, generated[idx])
    tokens[idx] = torch.where(accept, x, sample_probs_inverse_cdf(residual, u2))
    return tokens


@dataclass
class SampleResult:
    tokens: torch.Tensor                 # int32 [n]
    logprobs: list[dict[int, float] | None]  # per row: top-N + chosen, or None
    rows: torch.Tensor | None = None     # the slots sampled (None on the all-greedy path)
    host_tokens: torch.Tensor | None = None  # `tokens` on the host (set by the engine)
    ready: "torch.cuda.Event | None" = None  # a GPU copy of host_tokens is complete once this fires


def drafts_allowed(params: SamplingParams) -> bool:
    """Whether a request may carry draft tokens (speculative decoding): its rows sample
    independently given the row's position (`offsets` in Sampler.sample), or, under a grammar,
    given the drafts before it (the matcher advances through them and rolls back). Penalties
    and logits processors make a row depend on the tokens before it in the same step, state the
    sampler keeps per slot, not per draft: such requests do not speculate."""
    return (params.repetition_penalty == 1 and params.presence_penalty == 0 and params.frequency_penalty == 0
            and not params.logits_processors)


class Sampler:
    """Per-slot sampling state and the vectorized sampling pass."""

    def __init__(self, num_slots: int, vocab_size: int, seed: int | None = None,
                 device: torch.device | str = "cpu") -> None:
        rows = num_slots + 1  # the last row is the scratch row for padding
        self.scratch_slot = num_slots
        self.vocab_size = vocab_size
        self.device = dev = torch.device(device)  # where the logits arrive; all state lives there
        self.temperature = torch.zeros(rows, device=dev)
        self.top_k = torch.full((rows,), vocab_size, dtype=torch.int64, device=dev)
        self.top_p = torch.ones(rows, device=dev)
        self.min_p = torch.zeros(rows, device=dev)
        self.repetition_penalty = torch.ones(rows, device=dev)
        self.presence_penalty = torch.zeros(rows, device=dev)
        self.frequency_penalty = torch.zeros(rows, device=dev)
        self.seed = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.num_generated = torch.zeros(rows, dtype=torch.int64, device=dev)  # the random counter
        self.min_tokens = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.num_logprobs = torch.full((rows,), -1, dtype=torch.int64, device=dev)
        self.counts = torch.zeros(rows, vocab_size, dtype=torch.int32, device=dev)      # generated tokens
        self.prompt_mask = torch.zeros(rows, vocab_size, dtype=torch.bool, device=dev)  # tokens in the prompt
        self.stop_mask = torch.zeros(rows, vocab_size, dtype=torch.bool, device=dev)    # masked under min_tokens
        self._features = {slot: frozenset() for slot in range(rows)}
        self._active = {"sample": 0, "repetition": 0, "penalty": 0, "min_tokens": 0, "logprobs": 0,
                        "processors": 0, "guided": 0}
        # Per slot: (user logits processors, the request's generated token ids, a live list).
        self._processors: dict[int, tuple[list, list[int]]] = {}
        # Per slot: the grammar matcher of a constrained request (its request's, kept across
        # pauses), and the token bitmask rows they fill (host, int32 words; made on first use)
        self._matchers: dict[int, Any] = {}
        self._bitmask: torch.Tensor | None = None
        self._batch_matcher: Any = None
        self._seed_source = torch.Generator().manual_seed(seed) if seed is not None else torch.Generator()
        if seed is None:
            self._seed_source.seed()

    def init_slot(self, slot: int, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                  stop_ids: list[int], seed: int, matcher: Any = None) -> None:
        """Sets the row of a request that just got this slot. `output_ids`: the tokens it generated so far
        (non-empty for a paused request being recomputed, so that its counts and random
        counter continue); the list is kept and read by logits processors. `matcher`: the
        request's grammar matcher (guided decoding), which has accepted `output_ids` already."""
        self.release_slot(slot)
        self.temperature[slot] = float(params.temperature)
        self.top_k[slot] = self.vocab_size if params.top_k == -1 else params.top_k
        self.top_p[slot] = float(params.top_p)
        self.min_p[slot] = float(params.min_p)
        self.repetition_penalty[slot] = float(params.repetition_penalty)
        self.presence_penalty[slot] = float(params.presence_penalty)
        self.frequency_penalty[slot] = float(params.frequency_penalty)
        self.seed[slot] = seed
        self.num_generated[slot] = len(output_ids)
        self.min_tokens[slot] = params.min_tokens
        self.num_logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        features = set()
        if params.temperature > 0:
            features.add("sample")
        # Rows of the vocab-sized tables are rewritten whole when a request uses them, so
        # nothing a previous holder of the slot left there is ever read.
        if params.repetition_penalty != 1:
            features.add("repetition")
            self.prompt_mask[slot] = False
            self.prompt_mask[slot, self._ids(prompt_ids)] = True
        if params.presence_penalty != 0 or params.frequency_penalty != 0:
            features.add("penalty")
        if params.repetition_penalty != 1 or "penalty" in features:
            self.counts[slot] = 0
            if output_ids:
                self.counts[slot].index_put_((self._ids(output_ids),),
                                             torch.ones(len(output_ids), dtype=torch.int32, device=self.device),
                                             accumulate=True)
        if params.min_tokens > len(output_ids) and stop_ids:
            features.add("min_tokens")
            self.stop_mask[slot] = False
            self.stop_mask[slot, self._ids(stop_ids)] = True
        else:  # nothing to mask: the row's stop_mask (a previous holder's) must never apply
            self.min_tokens[slot] = 0
        if params.logprobs is not None:
            features.add("logprobs")
        if params.logits_processors:
            features.add("processors")
            self._processors[slot] = (list(params.logits_processors), output_ids)
        if matcher is not None:
            features.add("guided")
            self._matchers[slot] = matcher
        self._features[slot] = frozenset(features)
        for f in features:
            self._active[f] += 1

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=self.device)

    def release_slot(self, slot: int) -> None:
        """Forgets a slot's request (idempotent)."""
        for f in self._features[slot]:
            self._active[f] -= 1
        self._features[slot] = frozenset()
        self._processors.pop(slot, None)
        self._matchers.pop(slot, None)

    def new_seed(self) -> int:
        """A seed for a request that did not give one."""
        return int(torch.randint(0, 2**62, (1,), generator=self._seed_source))

    @property
    def all_greedy(self) -> bool:
        return not any(self._active.values())

    def sample(self, logits: torch.Tensor, slots: torch.Tensor, offsets: torch.Tensor | None = None,
               drafts: DraftRows | None = None) -> SampleResult:
        """logits [n, vocab] float32, slots [n] -> tokens and logprobs. Changes no state
        (see commit()), so a failure here — in a user's logits processor, say — leaves the
        sampler as it was. `offsets` [n] (speculative decoding): row i samples the slot's
        token num_generated + offsets[i] (its random counter and min_tokens), for a slot with
        several rows (its next token and its drafts'); None: all 0. `drafts`: the draft
        model's proposals the rows verify; a sampled row followed by one takes it by the
        rejection rule of speculative sampling (see _verify_drafts); None: drafts are point
        masses (prompt lookup) and each row samples on its own."""
        n = logits.shape[0]
        if self.all_greedy:  # fast path: nothing but argmax
            return SampleResult(greedy_tokens(logits), [None] * n)
        rows = slots.to(torch.int64)
        raw_logprobs = None
        if self._active["logprobs"]:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        x = logits
        if self._active["processors"]:
            x = x.clone()
            for i, slot in enumerate(rows.tolist()):
                entry = self._processors.get(slot)
                if entry is not None:
                    for fn in entry[0]:
                        x[i] = fn(entry[1], x[i])
        if self._active["guided"]:
            x = (self._apply_grammar_masks(x, rows) if offsets is None or drafts is None
                 else self._apply_grammar_masks_with_drafts(x, rows, drafts.next_tokens))
        if self._active["repetition"] or self._active["penalty"]:
            counts = self.counts[rows]
            if self._active["repetition"]:
                seen = self.prompt_mask[rows] | (counts > 0)
                x = apply_repetition_penalty(x, seen, self.repetition_penalty[rows])
            if self._active["penalty"]:
                x = apply_presence_frequency(x, counts, self.presence_penalty[rows], self.frequency_penalty[rows])
        generated = self.num_generated[rows] if offsets is None else self.num_generated[rows] + offsets.to(self.device)
        x = self._mask_stop_tokens(x, rows, generated)
        tokens = greedy_tokens(x).to(torch.int64)
        warped = self._warp(x, rows) if self._active["sample"] else None
        if warped is not None:
            xs, sampled = warped
            u = counter_uniform(self.seed[rows], generated)
            if drafts is not None and drafts.probs is not None:
                chosen = _verify_drafts(xs.softmax(dim=-1), u, drafts, self.seed[rows], generated)
            else:
                chosen = sample_inverse_cdf(xs, u)
            tokens = torch.where(sampled, chosen, tokens)
        logprobs: list[dict[int, float] | None] = [None] * n
        if raw_logprobs is not None:
            wanted = self.num_logprobs[rows]
            for i in torch.nonzero(wanted >= 0).flatten().tolist():
                logprobs[i] = top_logprobs(raw_logprobs[i], int(wanted[i]), int(tokens[i]))
        return SampleResult(tokens.to(torch.int32), logprobs, rows)

    def _mask_stop_tokens(self, x: torch.Tensor, rows: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
        """min_tokens: the stop tokens masked on the rows whose token `generated` is below it."""
        if not self._active["min_tokens"]:
            return x
        under = (generated < self.min_tokens[rows])[:, None]
        return x.masked_fill(self.stop_mask[rows] & under, float("-inf"))

    def _warp(self, x: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sampled rows' logits after temperature, top-k, top-p and min-p (greedy rows pass
        through unscaled), and which rows are sampled; None when no row is."""
        temperature = self.temperature[rows]
        sampled = temperature > 0
        if not bool(sampled.any()):
            return None
        xs = x / torch.where(sampled, temperature, torch.ones_like(temperature))[:, None]
        top_k = self.top_k[rows]
        if bool((top_k < self.vocab_size).any()):
            xs = apply_top_k(xs, top_k)
        top_p = self.top_p[rows]
        if bool((top_p < 1).any()):
            xs = apply_top_p(xs, top_p)
        min_p = self.min_p[rows]
        if bool((min_p > 0).any()):
            xs = apply_min_p(xs, min_p)
        return xs, sampled

    def sample_drafts(self, logits: torch.Tensor, slots: torch.Tensor,
                      offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A draft model's proposals: for each row of its logits [n, vocab] (float32), the
        token it proposes for the slot's token num_generated + offsets[i], and the distribution
        it was drawn from ([n, vocab] probabilities, the request's own temperature, top-k,
        top-p and min-p applied; None when every row is greedy). Greedy rows propose their
        argmax. The draws use the request's seed on a stream of their own, so seeded requests
        stay reproducible. Only requests that may speculate (drafts_allowed) get here: no
        penalties, processors or grammars; min_tokens masks the stop tokens as the target does."""
        rows = slots.to(torch.int64)
        generated = self.num_generated[rows] + offsets.to(self.device)
        x = logits
        x = self._mask_stop_tokens(x, rows, generated)
        tokens = greedy_tokens(x).to(torch.int64)  # (int64: the draft runner keeps its proposals so)
        warped = self._warp(x, rows) if self._active["sample"] else None
        if warped is None:
            return tokens, None
        xs, sampled = warped
        probs = xs.softmax(dim=-1)
        u = counter_uniform(self.seed[rows] ^ _DRAFT_STREAM, generated)
        return torch.where(sampled, sample_probs_inverse_cdf(probs, u), tokens), probs

    def _apply_grammar_masks(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """x with the tokens the constrained rows' grammars do not allow next set to -inf (a
        copy: the forward's logits stay as they were). The matchers fill their slots' rows of
        the bitmask in one call (xgrammar, threads, no GIL); a terminated matcher (its request
        ended by its grammar, still in a batch scheduled before that -- overlap) masks nothing."""
        import xgrammar as xgr
        picked = [(i, slot) for i, slot in enumerate(rows.tolist())
                  if slot in self._matchers and not self._matchers[slot].is_terminated()]
        if not picked:
            return x
        if self._bitmask is None:
            self._bitmask = xgr.allocate_token_bitmask(self.scratch_slot + 1, self.vocab_size)
            self._batch_matcher = xgr.BatchGrammarMatcher()
        slots = [slot for _, slot in picked]
        self._batch_matcher.batch_fill_next_token_bitmask([self._matchers[s].matcher for s in slots], self._bitmask,
                                                          indices=slots)
        for slot in slots:
            if self._matchers[slot].allowed is not None:
                self._bitmask[slot] &= self._matchers[slot].allowed
        mask = torch.full((x.shape[0], self._bitmask.shape[1]), -1, dtype=torch.int32)  # -1: every token allowed
        mask[[i for i, _ in picked]] = self._bitmask[slots]
        return self._masked(x, mask)

    def _masked(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """A float32 copy of x with the tokens each row's bitmask row (host, int32 words) does not
        allow set to -inf."""
        import xgrammar as xgr
        out = x.to(torch.float32, copy=True).contiguous()
        if out.is_cuda:
            xgr.apply_token_bitmask_inplace(out, mask.to(out.device, non_blocking=True), vocab_size=self.vocab_size)
        else:  # pyengine's kernel: xgrammar's CPU path tests every bit (~10x slower at a 49k vocabulary)
            _core._apply_token_bitmask(out.data_ptr(), out.stride(0), mask.data_ptr(), mask.stride(0), out.shape[0],
                                       self.vocab_size, torch.get_num_threads())
        return out

    def _apply_grammar_masks_with_drafts(self, x: torch.Tensor, rows: torch.Tensor,
                                         next_tokens: torch.Tensor) -> torch.Tensor:
        """x masked by the constrained rows' grammars where a request's rows carry drafts (a
        copy): a request's row j is masked by its grammar after drafts 1..j, the matcher
        advancing through them and rolling back after. A draft the grammar rejects is never
        allowed at the row before it, so the draft is rejected there and the rows after it
        are dropped (their masks do not matter); after a draft that completes the grammar,
        only that draft's row ends the request (RequestGrammar.terminated_at)."""
        import xgrammar as xgr
        slots = rows.tolist()
        following = next_tokens.tolist()
        picked = [i for i, slot in enumerate(slots) if slot in self._matchers]
        if not picked:
            return x
        mask = torch.full((x.shape[0], xgr.get_bitmask_shape(1, self.vocab_size)[1]), -1, dtype=torch.int32)
        advanced: dict[int, int] = {}  # slot -> drafts its matcher accepted for this call
        stuck: set[int] = set()        # slots whose grammar rejected a draft (or ended)
        for i in picked:
            slot = slots[i]
            grammar = self._matchers[slot]
            if slot in stuck or grammar.is_terminated():
                continue
            grammar.matcher.fill_next_token_bitmask(mask, i)
            if grammar.allowed is not None:
                mask[i] &= grammar.allowed
            draft = following[i]
            if draft >= 0 and i + 1 < len(slots) and slots[i + 1] == slot:
                if grammar.matcher.accept_token(draft) and not grammar.is_terminated():
                    advanced[slot] = advanced.get(slot, 0) + 1
                else:
                    if grammar.is_terminated():
                        advanced[slot] = advanced.get(slot, 0) + 1
                    stuck.add(slot)
        for slot, n in advanced.items():
            self._matchers[slot].matcher.rollback(n)
        return self._masked(x, mask)

    def commit(self, result: SampleResult, emitted: list[int] | None = None) -> None:
        """Records the sampled tokens in the rows' state (random counters, penalty counts, the
        grammar matchers). `emitted` (speculative decoding): the rows whose tokens the request
        kept, in order (None: every row)."""
        if result.rows is None:
            return
        rows, tokens_dev = result.rows, result.tokens
        host = result.host_tokens if result.host_tokens is not None else result.tokens
        if emitted is not None:
            picked = torch.tensor(emitted, dtype=torch.int64)
            host = host[picked]
            picked = picked.to(self.device)
            rows, tokens_dev = rows[picked], tokens_dev[picked]
        if self._active["guided"]:
            tokens = host.tolist()
            for slot, token in zip(rows.tolist(), tokens):
                m = self._matchers.get(slot)
                if m is not None and not m.is_terminated() and not m.accept_token(token):
                    logger.error("the grammar matcher of slot %d rejected token %d, which its mask allowed", slot, token)
        # index_add_: a slot with several rows (accepted drafts) counts each
        self.num_generated.index_add_(0, rows, torch.ones_like(rows, dtype=self.num_generated.dtype))
        if self._active["repetition"] or self._active["penalty"]:  # rows without penalties may count too: unused
            self.counts.index_put_((rows, tokens_dev.to(torch.int64)),
                                   torch.ones(rows.shape[0], dtype=torch.int32, device=self.device), accumulate=True)

