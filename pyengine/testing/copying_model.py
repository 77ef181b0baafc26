"""A Llama checkpoint with hand-built weights that copies its context (an induction head).

For benchmarking speculative decoding on a workload whose output repeats spans of its prompt
(prompt lookup, a draft model) with a model of realistic size (by default the shape of
``SMOLLM_135M_SHAPE``: 30 layers, hidden 576, 9 heads / 3 KV heads, vocabulary 32000).
Under greedy decoding, at position i holding token t the model attends to the earlier
position j whose previous token is t (token[j-1] == t) and predicts token[j]. With
:func:`copying_prompt` (BOS, a span of distinct tokens, then the span's first tokens again)
it continues the span, and wraps around to its start at the end, indefinitely.

The circuit
-----------
Residual stream (hidden_size dims; K = num_key_value_heads, b = the width of a code block,
head_dim or less where hidden_size is small)::

    dim 0                 constant C0 in every embedding (the positional head's "bias")
    S0  K blocks of b     the current token's code (the embedding)
    S1  K blocks of 32    the previous token's match code (written by layer 0)
    S2  K blocks of b     the output: the code of the token to predict (written by layer 1)
    rest                  zero

Token codes are +-1 vectors. Block h of a token's code is [m_h(t), e_h(t)]: m_h, its *match
code*, is a codeword of the Reed-Muller code RM(2,5) (length 32, 65536 codewords, minimum
distance 8), so two different tokens' match codes have a cosine of at most 0.5 (it takes
only the values -1, -0.5, -0.25, 0, 0.25, 0.5). e_h (b - 32 entries) is
the start of further RM(2,5) codewords. Each block draws its codewords for the vocabulary
by a seeded random permutation, so that two tokens close in one block are far apart in the
others. Every embedding has the same norm, so every RMSNorm divides by a known constant and
the weights below are exact functions of it.

* Layer 0, previous-token heads: q and k read only the constant dimension, so before RoPE
  they are constant vectors; on RoPE pair f (frequency w_f) k = a_f (1, 0) and
  q = a_f (cos w_f, -sin w_f), so that after RoPE q_i . k_j = sum_f a_f^2 cos(w_f (i-j-1)),
  which peaks at i - j = 1. The weights a_f^2 (0.45 of the total on the fastest pair, the rest
  evenly on the pairs that turn at least 2 rad over the context: pairs 0..8 for head_dim 64)
  keep the score at every other offset in 0..max_position_embeddings-1 at least 20.8% of the
  peak below it (checked when building: at least 10%); the peak is 160 in logits (after the
  1/sqrt(head_dim) scale), so every other offset is at least 33 logits below the previous
  position. V reads m_h of the attended token, O writes it into S1 block h. (At position 0
  the head can only attend to itself, so S1 there holds its own token: hence the BOS at the
  start of a prompt, see below.)
* Layer 1, induction heads: q reads m_h of S0 (the current token), k reads S1 block h (the
  key position's previous token), both on the 16 slowest RoPE pairs only. ``rope_theta``
  is chosen so that those pairs turn by at most 0.02 rad over max_position_embeddings, and
  rounded up to a power of ten (1e11 for head_dim 64 and 2048 positions: at most 0.0065 rad),
  so the score is the match codes' cosine times 64 logits: a matching position scores 64,
  every other one at most 32.4 (cosine <= 0.5, plus the drift). V reads the whole block h
  of S0 (the key position's own token: the one that followed the match), O writes it into
  S2 block h.
* The heads of a KV group are identical and O averages them. MLPs are exact no-ops
  (down_proj = 0). Layers 2.. are full-size random weights (std 0.02) read at every step but
  with o_proj = 0 and down_proj = 0, so they leave the residual unchanged: the first two
  layers alone (``build_truncated_checkpoint(..., 2)``) give the same logits, bit for bit.
* lm_head (untied) reads S2 only: logit(u) = 40 x cos(code(u), S2), so the copied token
  gets ~40 and every other token at most 40 x the largest cosine between two different
  tokens' codes. With seed 0: at the default shape (vocabulary 32000, K = 3, b = 64: 192-dim
  codes) the largest cosine between two different tokens' codes is 0.417, so the top1 - top2
  logit gap is at least 40 x (1 - 0.417) = 23.3 at every copied position; measured with
  transformers on prompts of up to 2048 tokens: min 23.33, mean 28.3, in float32 and in
  bfloat16. At the small test shape (hidden 256, 4 heads / 2 KV heads, vocabulary 4096, K = 2,
  b = 47) the largest cosine is 0.532: a gap >= 18.7 (measured min ~21 on 64-token spans).

Where the current token has no earlier match (its first occurrence), the induction heads
spread their attention over the positions whose previous token is closest in match code,
and the prediction is some mixture of their tokens: deterministic, but no copy.

Prompts should start with BOS (or any token that does not recur): the previous-token head
at position 0 can only attend to position 0 itself, so S1 there holds its own token, and a
later occurrence of that token also matches position 0, which predicts the token itself.
Without BOS, ``span + span[:1]`` therefore ends in a tie (both logits 20.4), and wraps to
the span's start still copy, with a smaller gap (two matches against one: 15.3 where the
small test model has ~25).
:func:`copying_prompt` starts with BOS.

The construction holds for contexts up to ``max_position_embeddings`` (the positional
margin is checked over all offsets below it); ``head_dim`` must be at least 64 (16 slow RoPE
pairs for the match codes, the faster ones for the positional head). ``hidden_size`` must hold
1 + 96 K dims (the code blocks then shrink to 32): hidden 256 fits K = 2, 576 fits K = 3 with
b = head_dim = 64.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoints import _save_quietly, _to_dtype, build_config

__all__ = ["build_copying_checkpoint", "copying_prompt", "CopyingPrompt", "copying_rope_theta",
           "POSITIONAL_PEAK_LOGIT", "MATCH_LOGIT", "OUTPUT_LOGIT", "BOS_TOKEN_ID", "EOS_TOKEN_ID"]

BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
#: Layer 0's attention logit at the previous position.
POSITIONAL_PEAK_LOGIT = 160.0
#: Layer 1's attention logit at a matching position (match codes' cosine 1).
MATCH_LOGIT = 64.0
#: The copied token's logit (codes' cosine 1).
OUTPUT_LOGIT = 40.0

_MATCH_DIMS = 32           # RM(2,5) codeword length: 16 RoPE pairs
_MAX_STABLE_ANGLE = 0.02   # radians the match pairs may turn over max_position_embeddings
_MIN_TURN = 2.0            # a positional pair turns at least this much over the context
_FASTEST_PAIR_SHARE = 0.45
_MIN_POSITIONAL_MARGIN = 0.1  # of the peak; checked at build (0.17..0.22 for head_dim 64..128, 512..8192 positions)
_CONSTANT = 8.0            # value of the constant dimension in every embedding
_RANDOM_STD = 0.02         # the weights that do not take part in the circuit


def copying_rope_theta(head_dim: int, max_position_embeddings: int) -> float:
    """The RoPE base that makes the 16 slowest pairs of a ``head_dim`` head turn by at most
    0.02 rad over ``max_position_embeddings`` positions, rounded up to a power of ten."""
    if head_dim < 64 or head_dim % 2:
        raise ValueError(f"the copying model needs an even head_dim >= 64, got {head_dim}")
    first_stable = head_dim // 2 - _MATCH_DIMS // 2
    # inv_freq[f] = theta ** (-2 f / head_dim); want inv_freq[first_stable] <= angle / positions.
    theta = (max_position_embeddings / _MAX_STABLE_ANGLE) ** (head_dim / (2 * first_stable))
    return float(10 ** math.ceil(math.log10(theta)))


def _rm25_codewords() -> torch.Tensor:
    """All 65536 codewords of the Reed-Muller code RM(2,5) as +-1 rows [65536, 32]."""
    points = torch.tensor([[(p >> v) & 1 for v in range(5)] for p in range(32)])  # [32, 5]
    rows = [torch.ones(32, dtype=torch.long)] + [points[:, v] for v in range(5)]
    rows += [points[:, a] * points[:, b] for a in range(5) for b in range(a + 1, 5)]
    gen = torch.stack(rows)                                                     # [16, 32]
    messages = (torch.arange(1 << 16)[:, None] >> torch.arange(16)) & 1         # [65536, 16]
    bits = (messages @ gen) % 2
    return (1 - 2 * bits).float()


def _token_codes(vocab_size: int, num_blocks: int, block: int, generator: torch.Generator) -> torch.Tensor:
    """[vocab, num_blocks, block] +-1 codes: each block is the concatenation of RM(2,5)
    codewords (the last one truncated), each drawn for the vocabulary by its own permutation."""
    words = _rm25_codewords()
    if vocab_size > words.shape[0]:
        raise ValueError(f"vocab_size={vocab_size} is larger than the {words.shape[0]} codes available")
    pieces = math.ceil(block / _MATCH_DIMS)
    out = torch.empty(vocab_size, num_blocks, pieces * _MATCH_DIMS)
    for h in range(num_blocks):
        for p in range(pieces):
            perm = torch.randperm(words.shape[0], generator=generator)[:vocab_size]
            out[:, h, p * _MATCH_DIMS:(p + 1) * _MATCH_DIMS] = words[perm]
    return out[:, :, :block]


def _positional_weights(head_dim: int, theta: float, max_positions: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(pair indices, their share of the peak, margin): the RoPE pairs the previous-token head
    uses and how much of the score each carries, and the smallest gap, as a fraction of the
    peak, between the score at offset 1 and at any other offset in [0, max_positions)."""
    pairs = head_dim // 2 - _MATCH_DIMS // 2
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    fast = [f for f in range(pairs) if inv_freq[f] * max_positions >= _MIN_TURN]
    if len(fast) < 2:
        raise ValueError(f"head_dim={head_dim} leaves too few fast RoPE pairs for the previous-token head")
    share = torch.full((len(fast),), (1 - _FASTEST_PAIR_SHARE) / (len(fast) - 1), dtype=torch.float64)
    share[0] = _FASTEST_PAIR_SHARE
    offsets = torch.arange(0, max_positions, dtype=torch.float64) - 1     # i - j - 1
    score = torch.cos(offsets[:, None] * inv_freq[fast][None, :]) @ share  # peak 1 at offset 0
    margin = float((1 - score[offsets != 0]).min())
    return torch.tensor(fast), share, margin


@torch.no_grad()
def build_copying_checkpoint(
    path: Path | str,
    *,
    num_layers: int = 30,
    hidden_size: int = 576,
    intermediate_size: int = 1536,
    vocab_size: int = 32000,
    num_attention_heads: int = 9,
    num_key_value_heads: int = 3,
    max_position_embeddings: int = 2048,
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
) -> Path:
    """Build the copying Llama (see the module docstring) into ``path`` with
    ``save_pretrained`` (safetensors, config.json, generation_config.json; no tokenizer) and
    return ``path``. BOS is token 1, EOS token 2 (the model never predicts them when copying
    spans without them). Deterministic for a given ``seed`` and torch version; layers from 2
    on are random (std 0.02) but leave the residual unchanged, so any ``num_layers >= 2``
    copies the same way. ``rope_theta`` is :func:`copying_rope_theta`. Raises ValueError for
    a shape the circuit does not fit in (head_dim < 64, too small a hidden_size, a vocabulary
    over 65536)."""
    import transformers

    path = Path(path)
    dtype = _to_dtype(dtype)
    if num_layers < 2:
        raise ValueError(f"the copying circuit needs num_layers >= 2, got {num_layers}")
    if hidden_size % num_attention_heads or num_attention_heads % num_key_value_heads:
        raise ValueError(f"hidden_size={hidden_size}, num_attention_heads={num_attention_heads} and "
                         f"num_key_value_heads={num_key_value_heads} do not divide")
    head_dim = hidden_size // num_attention_heads
    theta = copying_rope_theta(head_dim, max_position_embeddings)
    kv, rep = num_key_value_heads, num_attention_heads // num_key_value_heads
    # Code block width: as wide as a head (the value path) where the residual has room.
    block = min(head_dim, (hidden_size - 1 - _MATCH_DIMS * kv) // (2 * kv))
    if block < _MATCH_DIMS:
        raise ValueError(f"hidden_size={hidden_size} is too small for {kv} KV heads: the circuit needs "
                         f"1 + {3 * _MATCH_DIMS * kv} dims")
    fast, share, margin = _positional_weights(head_dim, theta, max_position_embeddings)
    if margin < _MIN_POSITIONAL_MARGIN:
        raise ValueError(f"the previous-token head's margin is only {margin:.3f} of its peak at this shape")

    s0 = 1                                  # residual layout (module docstring)
    s1 = s0 + kv * block
    s2 = s1 + _MATCH_DIMS * kv
    gen = torch.Generator().manual_seed(seed)
    codes = _token_codes(vocab_size, kv, block, gen)  # [V, kv, block], +-1

    cfg = build_config("llama", hidden_size=hidden_size, num_layers=num_layers, num_heads=num_attention_heads,
                       num_kv_heads=kv, intermediate_size=intermediate_size, vocab_size=vocab_size,
                       tie_word_embeddings=False, max_position_embeddings=max_position_embeddings,
                       rope_theta=theta, initializer_range=_RANDOM_STD, bos_token_id=BOS_TOKEN_ID,
                       eos_token_id=EOS_TOKEN_ID, dtype=dtype)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    eps = cfg.rms_norm_eps

    def rms(sq_norm: float) -> float:  # what RMSNorm divides by, for a residual of this squared norm
        return math.sqrt(sq_norm / hidden_size + eps)

    emb = torch.zeros(vocab_size, hidden_size)
    emb[:, 0] = _CONSTANT
    emb[:, s0:s1] = codes.reshape(vocab_size, kv * block)
    model.model.embed_tokens.weight.copy_(emb)
    # Residual norms at each RMSNorm (with one-hot attention; every code entry is +-1).
    sq0 = _CONSTANT ** 2 + kv * block
    sq1 = sq0 + kv * _MATCH_DIMS
    sq2 = sq1 + kv * block
    r0, r1, r2 = rms(sq0), rms(sq1), rms(sq2)

    for layer in model.model.layers:
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    model.model.norm.weight.fill_(1.0)
    half = head_dim // 2
    stable = torch.arange(half - _MATCH_DIMS // 2, half)                  # the 16 slowest pairs
    stable_dims = torch.cat([stable, stable + half])                     # their 32 head dims
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    scale = math.sqrt(head_dim)                                          # HF's score scale
    m = torch.arange(_MATCH_DIMS)

    # Layer 0: previous-token heads.
    att = model.model.layers[0].self_attn
    for w in (att.q_proj.weight, att.k_proj.weight, att.v_proj.weight):
        w.zero_()
    const = _CONSTANT / r0                                               # dim 0 after the norm
    amp = torch.sqrt(share * POSITIONAL_PEAK_LOGIT * scale)              # q_f = k_f = amp_f
    w_f = inv_freq[fast]
    for g in range(kv):
        k_rows = g * head_dim
        att.k_proj.weight[k_rows + fast, 0] = (amp / const).float()
        for r in range(rep):
            q_rows = (g * rep + r) * head_dim
            # q pair f = amp_f (cos w_f, -sin w_f): RoPE then peaks the score at i - j = 1.
            att.q_proj.weight[q_rows + fast, 0] = (amp * torch.cos(w_f) / const).float()
            att.q_proj.weight[q_rows + fast + half, 0] = (-amp * torch.sin(w_f) / const).float()
            # Head output dims 0..31 -> S1 block g (averaged over the group's heads).
            att.o_proj.weight[s1 + g * _MATCH_DIMS + m, q_rows + m] = 1 / rep
        # V: the match code m_g of the attended token, as +-1.
        att.v_proj.weight[k_rows + m, s0 + g * block + m] = r0

    # Layer 1: induction heads.
    att = model.model.layers[1].self_attn
    for w in (att.q_proj.weight, att.k_proj.weight, att.v_proj.weight):
        w.zero_()
    # q = k = sqrt(MATCH_LOGIT * scale / 32) * code on the stable dims: q.k / scale = MATCH_LOGIT * cosine.
    amp1 = math.sqrt(MATCH_LOGIT * scale / _MATCH_DIMS)
    for g in range(kv):
        k_rows = g * head_dim
        att.k_proj.weight[k_rows + stable_dims, s1 + g * _MATCH_DIMS + m] = amp1 * r1
        att.v_proj.weight[k_rows + torch.arange(block), s0 + g * block + torch.arange(block)] = r1
        for r in range(rep):
            q_rows = (g * rep + r) * head_dim
            att.q_proj.weight[q_rows + stable_dims, s0 + g * block + m] = amp1 * r1
            att.o_proj.weight[s2 + g * block + torch.arange(block), q_rows + torch.arange(block)] = 1 / rep

    # lm_head: OUTPUT_LOGIT x the cosine between S2 and the token's code.
    head = torch.zeros(vocab_size, hidden_size)
    head[:, s2:s2 + kv * block] = codes.reshape(vocab_size, kv * block) * (OUTPUT_LOGIT * r2 / (kv * block))
    model.lm_head.weight.copy_(head)

    model = model.to(dtype)
    model.config.dtype = dtype
    path.mkdir(parents=True, exist_ok=True)
    _save_quietly(model, path, {"safe_serialization": True})
    return path


@dataclass(frozen=True)
class CopyingPrompt:
    """A prompt for the copying model: ``[bos] + span + span[:repeat]`` (``repeat`` may exceed
    the span: it cycles). ``continuation(n)`` is the copying model's greedy continuation."""

    token_ids: list[int]
    span: list[int]
    repeat: int

    def continuation(self, num_tokens: int) -> list[int]:
        """The next ``num_tokens`` tokens: the span from where the prompt stops, cycling."""
        n = len(self.span)
        return [self.span[(self.repeat + k) % n] for k in range(num_tokens)]


def copying_prompt(span_length: int = 64, repeat: int = 16, *, vocab_size: int = 32000, seed: int = 0,
                   bos: bool = True, first_token_id: int = 3) -> CopyingPrompt:
    """A random span of ``span_length`` distinct token ids in [first_token_id, vocab_size)
    (ids 0..2 are PAD/BOS/EOS), then its first ``repeat`` tokens again (``repeat`` >= 1), after
    a BOS (id 1) when ``bos``; seeded by ``seed``."""
    if not 1 <= span_length <= vocab_size - first_token_id:
        raise ValueError(f"span_length={span_length} does not fit the vocabulary")
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1 (the model copies only what recurs), got {repeat}")
    span = random.Random(seed).sample(range(first_token_id, vocab_size), span_length)
    ids = ([BOS_TOKEN_ID] if bos else []) + span + [span[k % span_length] for k in range(repeat)]
    return CopyingPrompt(token_ids=ids, span=span, repeat=repeat)
