"""Phi-3 and Phi-4-mini (``model_type`` "phi3"), as transformers' ``Phi3ForCausalLM`` computes it
and as its ``generate()`` drives it.

The layer is Llama's, with q, k, v stored as one matrix (``self_attn.qkv_proj``) and gate, up as
one (``mlp.gate_up_proj``, gate first); RoPE may rotate only the leading ``partial_rotary_factor``
of each head (Phi-4-mini: 0.75), the rest passing through.

LongRoPE (``rope_type`` "longrope", formerly "su") scales each frequency by a short or a long
factor, and cos/sin by the attention factor ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))``
(factor: ``max_position_embeddings / original_max_position_embeddings`` unless given). Which
factors, as transformers decides it:

* one forward call uses one set for all its tokens: the long factors when its sequence length
  ``max(position_ids) + 1`` exceeds ``original_max_position_embeddings`` (``dynamic_rope_update``);
* ``generate()`` (Phi3ForCausalLM.prepare_inputs_for_generation) drops the KV cache on the step at
  which the sequence first grows past ``original_max_position_embeddings`` and recomputes every
  token with the long factors.

So each token's logits are those of one forward over the whole sequence so far, with the long
factors iff its length exceeds original_max_position_embeddings. pyengine gives the same:

* in each forward a sequence uses the long factors iff its KV length after the step (seq_lens, its
  last position + 1) exceeds original_max_position_embeddings, its rows' cos/sin picked per token;
* the model records, per KV cache slot, the token it holds and which factors computed it; before
  a forward, a sequence whose cached prefix was computed with the other factors (the step that
  crosses the switch point, a later chunk of a chunked prompt longer than it, a prefix reused
  from a request on the other side) has that prefix recomputed in place from the recorded tokens
  (positions below the switch point only: later ones are always long) -- what transformers'
  cache drop does, for that sequence alone;
* sequences in one batch that want different factors and whose prefix needs recomputing run as
  two sub-batches, each after its own recompute (so blocks shared by prefix reuse across the switch
  hold, at each forward, what that forward's sequences need).

No request metadata is needed beyond what a forward gets (positions, seq_lens, block tables).
On CUDA the bookkeeping reads values back to the host every step, and decode steps replayed from
a CUDA graph bypass it: a LongRoPE model must run without CUDA graphs there.
The one-call CPU decode kernel computes whole-head RoPE from one table: a model with partial
rotary or LongRoPE runs its Python forward (LlamaFamilyModel.fused_cpu_decode_ok).
"""

from __future__ import annotations

import torch

from pyengine.layers.rotary import rope_tables
from pyengine.models.config import ModelConfig
from pyengine.models.llama import AttentionMetadata, LlamaFamilyModel, Take

# the factors a KV slot's K was computed with (0: not written by this model's forward)
_SHORT, _LONG = 1, 2


class Phi3Model(LlamaFamilyModel):
    @classmethod
    def _layer_names(cls, c: ModelConfig, p: str) -> list[str]:
        return [p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                p + "self_attn.qkv_proj.weight", p + "self_attn.o_proj.weight",
                p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"]

    def _load_qkv(self, take: Take, p: str):
        return take(p + "self_attn.qkv_proj.weight", (self.q_size + 2 * self.kv_size, self.config.hidden_size))

    def _load_gate_up(self, take: Take, p: str):
        c = self.config
        return take(p + "mlp.gate_up_proj.weight", (2 * c.intermediate_size, c.hidden_size))

    @property
    def cuda_graphs_ok(self) -> bool:
        # LongRoPE's forward keeps per-slot bookkeeping (which factors computed each cached
        # token) and may recompute a prefix: a graph replay would skip both
        return not self.longrope

    # ---- LongRoPE ----------------------------------------------------------------------------

    def _init_rope(self, max_seq_len: int) -> None:
        s = self.config.rope_scaling
        self.longrope = s is not None and s.get("rope_type") == "longrope"
        super()._init_rope(max_seq_len)
        if self.longrope:  # rope_tables: [short factors, long factors]; one per-token table per forward
            self.original_max_position = int(s["original_max_position_embeddings"])
            self.rope_tables.append(rope_tables(self.config, max_seq_len, self.dtype, self.device, long=True))
            self._token_long: torch.Tensor | None = None   # per row of the forward running
            self._slot_key: tuple | None = None
            self._slot_tokens = self._slot_phase = None

    def _rope_rows(self, positions: torch.Tensor, meta: AttentionMetadata, fused: bool) -> list[tuple]:
        if not self.longrope:
            return super()._rope_rows(positions, meta, fused)
        (cos_s, sin_s), (cos_l, sin_l) = self.rope_tables
        long = self._token_long[:, None]
        cos = torch.where(long, cos_l[positions], cos_s[positions])
        sin = torch.where(long, sin_l[positions], sin_s[positions])
        return [(cos.unsqueeze(1), sin.unsqueeze(1))]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits_indices: torch.Tensor) -> torch.Tensor:
        if not self.longrope:
            return super().forward(input_ids, positions, meta, kv_caches, logits_indices)
        T = input_ids.shape[0]
        qsl = meta.query_start_loc.long()
        q_lens = qsl[1:] - qsl[:-1]
        seq_lens = meta.seq_lens.long()
        # per sequence: the factors of this forward (transformers: seq_len > original_max_position_embeddings)
        want = torch.where(seq_lens > self.original_max_position, _LONG, _SHORT).to(torch.int8)
        tokens, phases = self._slot_state(kv_caches)
        tpb = kv_caches[0][0].shape[2]
        # record what this step writes: a row's token and its sequence's factors (padding rows: slot < 0)
        valid = meta.slot_mapping >= 0
        written = meta.slot_mapping[valid].long()
        tokens[written] = input_ids[valid].to(torch.int32)
        phases[written] = torch.repeat_interleave(want, q_lens)[valid]
        groups = [torch.nonzero(want == w).flatten() for w in (_SHORT, _LONG)]
        groups = [g for g in groups if g.numel()]
        # the cached prefix each sequence attends to: positions below the switch point (later ones are long)
        prefix = torch.clamp(seq_lens - q_lens, max=self.original_max_position)
        if len(groups) == 1 or not self._prefixes_to_redo(prefix, want, meta.block_tables, tpb).any():
            self._redo_prefixes(torch.arange(want.shape[0]), prefix, want, meta, kv_caches, tpb)
            self._token_long = torch.repeat_interleave(want == _LONG, q_lens)
            try:
                h = self._hidden(input_ids, positions, meta, kv_caches)
            finally:
                self._token_long = None
            return self._logits(h[logits_indices])
        # both kinds of sequences, and some prefix to recompute: one sub-batch per kind, each after its
        # own recomputes (a block shared across the two kinds holds, at each forward, what it needs)
        h = torch.empty((T, self.config.hidden_size), dtype=self.dtype, device=self.device)
        for group in groups:
            rows = torch.cat([torch.arange(int(qsl[i]), int(qsl[i + 1]), device=qsl.device) for i in group.tolist()])
            sub_qsl = torch.zeros(group.numel() + 1, dtype=torch.int32, device=qsl.device)
            sub_qsl[1:] = torch.cumsum(q_lens[group], 0)
            sub = AttentionMetadata(
                slot_mapping=meta.slot_mapping[rows], query_start_loc=sub_qsl, seq_lens=meta.seq_lens[group],
                block_tables=meta.block_tables[group].contiguous(), max_query_len=meta.max_query_len,
                max_context_len=meta.max_context_len, workspace=meta.workspace, k_scale=meta.k_scale,
                v_scale=meta.v_scale)
            self._redo_prefixes(group, prefix, want, meta, kv_caches, tpb)
            self._token_long = torch.full((rows.numel(),), bool(want[group[0]] == _LONG), device=rows.device)
            try:
                h[rows] = self._hidden(input_ids[rows], positions[rows], sub, kv_caches)
            finally:
                self._token_long = None
        return self._logits(h[logits_indices])

    def _slot_state(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(token, factors) per slot of the KV pool these caches are, zeroed when the pool is new."""
        k0 = kv_caches[0][0]
        key = (k0.data_ptr(), k0.shape[0], k0.shape[2])
        if self._slot_key != key:
            slots = k0.shape[0] * k0.shape[2]
            self._slot_tokens = torch.zeros(slots, dtype=torch.int32, device=k0.device)
            self._slot_phase = torch.zeros(slots, dtype=torch.int8, device=k0.device)
            self._slot_key = key
        return self._slot_tokens, self._slot_phase

    @staticmethod
    def _prefix_slots(block_table: torch.Tensor, n: int, tpb: int) -> torch.Tensor:
        """The KV slots of positions 0 .. n-1 of the sequence with this block table."""
        pos = torch.arange(n, device=block_table.device)
        return block_table.long()[pos // tpb] * tpb + pos % tpb

    def _prefixes_to_redo(self, prefix: torch.Tensor, want: torch.Tensor, block_tables: torch.Tensor,
                          tpb: int) -> torch.Tensor:
        """Per sequence, whether its cached prefix (`prefix` positions) holds K/V of other factors."""
        out = torch.zeros(want.shape[0], dtype=torch.bool)
        for i in torch.nonzero(prefix > 0).flatten().tolist():
            slots = self._prefix_slots(block_tables[i], int(prefix[i]), tpb)
            out[i] = bool((self._slot_phase[slots] != want[i]).any())
        return out

    def _redo_prefixes(self, seqs: torch.Tensor, prefix: torch.Tensor, want: torch.Tensor, meta: AttentionMetadata,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]], tpb: int) -> None:
        """Recomputes in place the cached prefix of each sequence in `seqs` that holds K/V of other
        factors than its own (from the recorded tokens, with its factors): what transformers'
        generate() does when it drops its cache at the switch point."""
        for i in seqs.tolist():
            n = int(prefix[i])
            if n == 0:
                continue
            slots = self._prefix_slots(meta.block_tables[i], n, tpb)
            phase = self._slot_phase[slots]
            if bool((phase == want[i]).all()):  # (already redone for a sequence sharing its blocks)
                continue
            if bool((phase == 0).any()):
                raise RuntimeError("longrope: a sequence's cached prefix holds K/V this model's forward did not "
                                   "write (decode steps replayed from a CUDA graph?); it cannot be recomputed")
            sub = AttentionMetadata(
                slot_mapping=slots.to(torch.int32),
                query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=slots.device),
                seq_lens=torch.tensor([n], dtype=torch.int32, device=slots.device),
                block_tables=meta.block_tables[i: i + 1].contiguous(), max_query_len=n, max_context_len=n,
                workspace=meta.workspace, k_scale=meta.k_scale, v_scale=meta.v_scale)
            self._token_long = torch.full((n,), bool(want[i] == _LONG), device=slots.device)
            try:
                self._hidden(self._slot_tokens[slots], torch.arange(n, dtype=torch.int32, device=slots.device),
                             sub, kv_caches)
            finally:
                self._token_long = None
            self._slot_phase[slots] = want[i]
