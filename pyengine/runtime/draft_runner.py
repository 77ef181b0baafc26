"""The draft model of speculative decoding (SpeculativeConfig(method="draft_model")): a smaller
model of the same vocabulary proposes each generating request's draft tokens, which the
target's forward then verifies.

Its KV pool is its own tensor, indexed by the target's block ids: block b of the draft pool
holds the draft's K/V for the same positions as block b of the target's. So the batch
manager's one block table serves both models, and what it does to blocks -- allocation,
the rewind of rejected drafts, prefix reuse, preemption -- needs no second bookkeeping.
The draft pool costs `num_blocks` x the draft's bytes per block, which the KV capacity
estimate counts.

Each step, between the schedule and the target's forward, `propose` runs the draft model
1 + (k - 1) times:

- first forward: every context chunk the target computes this step (the draft keeps the
  KV of every prompt position), and each drafting request's last sampled token t0 at its
  position P, preceded by the tokens it has not seen yet (see below); its logits row
  proposes draft 1;
- forward j = 2..k: draft j - 1 at position P + j - 1, one row per request, proposing draft j.

A generating request that carries no drafts this step (the batch manager's back-off or
adaptive draft length paused it, or max_tokens is near) costs the draft model nothing: its
tokens are kept (`behind`) and fed as a chunk before its t0 the next time it drafts. The
last draft, k, is verified by the target but never fed to the draft model in the step that
proposed it: when the target accepts all k drafts, the draft lacks its K/V at P + k, which
starts the request's `behind` tokens. When the target rejects some, the positions the
draft wrote past the accepted ones are rewritten with the right tokens next step, as the
target's are.

What the draft pool holds only ever changes which tokens are proposed, never which are
emitted: the target verifies every draft. (A block registered for prefix reuse while its
request's draft was behind -- its last step accepted all drafts, or it is not drafting --
lacks the draft's K/V at those positions until the request drafts again; a request reusing
it in between gets worse drafts, the same outputs.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pyengine.layers._attention_cuda import workspace_bytes
from pyengine.models import AttentionMetadata
from pyengine.runtime.model_runner import allocate_kv_pool, one_call_decode
from pyengine.sampling import Sampler


@dataclass
class Proposal:
    """One step's drafts (also written into the target's input rows). `tokens`: all drafts in
    batch order (what the batch manager verifies); `probs`: row i the distribution the draft
    after the target's logits row i was drawn from (the sampler's rejection rule; None when
    every draft was greedy); `last`: core id -> (the request's number of drafts, its last
    draft's position, that draft) for the requests that got drafts; `fed`: core ids whose
    draft K/V this step brought up to date; `skipped`: core id -> (position, token) of the
    t0 of each generating request that may speculate but carries no drafts this step."""

    tokens: list[int]
    probs: torch.Tensor | None
    last: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    fed: set[int] = field(default_factory=set)
    skipped: dict[int, tuple[int, int]] = field(default_factory=dict)


class DraftModelRunner:
    """The draft model, its KV pool, and the drafting loop of a step."""

    def __init__(self, model, num_blocks: int, tokens_per_block: int, kv_dtype: torch.dtype,
                 max_blocks_per_seq: int, target_vocab_size: int) -> None:
        self.model = model
        self.device = model.device
        self.tokens_per_block = tokens_per_block
        self.target_vocab_size = target_vocab_size
        # zeroed: a position the draft never wrote (see the module docstring) reads finite values
        self.kv_pool, self.kv_caches = allocate_kv_pool(model.config, num_blocks, tokens_per_block, kv_dtype,
                                                        self.device, zeroed=True)
        self.cpu_decode = one_call_decode(model, self.kv_caches, max_blocks_per_seq)
        # on a GPU, the attention's split-K scratch, grown to the largest batch seen (the first
        # forward's rows vary with the requests' catch-up tokens)
        self.workspace = torch.empty(0, dtype=torch.uint8, device=self.device) if self.device.type == "cuda" else None
        # core id -> (first position, tokens): the tokens of a generating request the draft
        # model has not been fed yet (the last draft of a step that accepted all, the steps
        # it did not draft in), fed before its t0 the next time it drafts
        self.behind: dict[int, tuple[int, list[int]]] = {}

    @property
    def kv_pool_bytes(self) -> int:
        return self.kv_pool.numel() * self.kv_pool.element_size()

    # ---- the step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, runner, num_seqs: int, num_generation_seqs: int, num_logits: int, speculates,
                sampler: Sampler) -> Proposal | None:
        """Runs the draft model on the batch the batch manager just scheduled (in `runner`'s
        host buffers) and writes the drafts into the target's input rows. `speculates(core_id)`:
        whether a request may carry drafts. Changes no state of its own (`commit` does, after
        the step's update), so a step that fails and is retried proposes the same drafts."""
        qsl = runner.query_start_loc[: num_seqs + 1].tolist()
        req_ids = runner.request_ids[:num_seqs].tolist()
        total = qsl[num_seqs]
        inputs = runner.input_ids[:total].tolist()
        positions = runner.positions[:total].tolist()
        slot_mapping = runner.slot_mapping[:total].tolist()
        seq_lens = runner.seq_lens[:num_seqs].tolist()
        tpb = self.tokens_per_block

        # first forward: context chunks, and each generating request's catch-up rows
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        starts = [0]
        lens: list[int] = []
        seqs: list[int] = []
        drafting: list[tuple[int, int, int]] = []  # (batch index, drafts, first target row)
        logit_rows: list[int] = []
        fed: set[int] = set()
        skipped: dict[int, tuple[int, int]] = {}
        for s in range(num_seqs):
            a, b = qsl[s], qsl[s + 1]
            d = b - a - 1 if s < num_generation_seqs else 0
            cid = req_ids[s]
            if s < num_generation_seqs:
                p = positions[a]
                if d <= 0:
                    if speculates(cid):  # fed later, with the tokens after it
                        skipped[cid] = (p, inputs[a])
                    continue
                start, behind = self.behind.get(cid, (p, []))
                if start + len(behind) != p:  # (not this request's latest tokens: draft from t0 alone)
                    start, behind = p, []
                for i, token in enumerate(behind):
                    block = int(runner.block_tables[s, (start + i) // tpb])
                    ids.append(token)
                    pos.append(start + i)
                    slots.append(block * tpb + (start + i) % tpb)
                ids.append(inputs[a])
                pos.append(p)
                slots.append(slot_mapping[a])
                lens.append(p + 1)
                drafting.append((s, d, a))
                logit_rows.append(len(ids) - 1)
            elif not speculates(cid):
                continue
            else:
                ids += inputs[a:b]
                pos += positions[a:b]
                slots += slot_mapping[a:b]
                lens.append(seq_lens[s])
            fed.add(cid)
            seqs.append(s)
            starts.append(len(ids))
        if not seqs:
            return Proposal([], None, {}, fed, skipped) if skipped else None
        seq_index = torch.tensor(seqs, dtype=torch.int64)
        logits = self._forward(ids, pos, slots, starts, lens, runner.block_tables[seq_index], logit_rows)
        if not drafting:
            return Proposal([], None, {}, fed, skipped)

        # forwards 2..k: one row per request still drafting
        batch_slots = runner.seq_slots[:num_seqs].to(torch.int64)
        d_max = max(d for _, d, _ in drafting)
        proposed = torch.zeros(len(drafting), d_max, dtype=torch.int64)
        probs_rows: list[torch.Tensor | None] = [None] * d_max
        active = list(range(len(drafting)))
        for j in range(d_max):
            draft_slots = batch_slots[[drafting[i][0] for i in active]]
            tokens, probs = self._sample(sampler, logits, draft_slots, j)
            proposed[active, j] = tokens.cpu()
            probs_rows[j] = None if probs is None else (active, probs)
            active = [i for i in active if drafting[i][1] > j + 1]
            if not active:
                break
            rows = [drafting[i][2] + j + 1 for i in active]  # the target rows of the drafts just made
            logits = self._forward(proposed[active, j].tolist(), [positions[r] for r in rows],
                                   [slot_mapping[r] for r in rows], list(range(len(rows) + 1)),
                                   [positions[r] + 1 for r in rows],
                                   runner.block_tables[torch.tensor([drafting[i][0] for i in active])],
                                   list(range(len(rows))))

        # the drafts into the target's input rows, and as its logits rows will verify them
        flat: list[int] = []
        last: dict[int, tuple[int, int, int]] = {}
        for i, (s, d, a) in enumerate(drafting):
            mine = proposed[i, :d].tolist()
            flat += mine
            runner.input_ids[a + 1: a + 1 + d] = torch.tensor(mine, dtype=torch.int32)
            last[req_ids[s]] = (d, positions[a] + d, mine[-1])
        probs = None
        if any(entry is not None for entry in probs_rows):
            # (generation rows are logits rows one to one: the draft after row a + j is draft j + 1)
            probs = torch.zeros(num_logits, self.target_vocab_size, device=self.device)
            for j, entry in enumerate(probs_rows):
                if entry is not None:
                    members, p = entry
                    probs[[drafting[i][2] + j for i in members]] = p
        return Proposal(flat, probs, last, fed, skipped)

    def _sample(self, sampler: Sampler, logits: torch.Tensor, slots: torch.Tensor,
                j: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft j + 1 of each row's request, over the target's vocabulary (a smaller draft
        vocabulary is padded with impossible tokens, a larger one cut)."""
        v = self.target_vocab_size
        if logits.shape[1] > v:
            logits = logits[:, :v]
        elif logits.shape[1] < v:
            logits = torch.nn.functional.pad(logits, (0, v - logits.shape[1]), value=float("-inf"))
        offsets = torch.full((logits.shape[0],), j, dtype=torch.int64)
        return sampler.sample_drafts(logits, slots.to(sampler.device), offsets)

    def _forward(self, ids: list[int], pos: list[int], slots: list[int], starts: list[int], lens: list[int],
                 block_tables: torch.Tensor, logit_rows: list[int]) -> torch.Tensor:
        dev = self.device

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=dev)

        positions = i32(pos)
        max_context_len = max(lens)
        if self.workspace is not None:
            c = self.model.config
            nbytes = workspace_bytes(len(ids), c.num_heads, c.head_dim, max_context_len)
            if nbytes > self.workspace.numel():
                self.workspace = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        meta = AttentionMetadata(slot_mapping=i32(slots), query_start_loc=i32(starts), seq_lens=i32(lens),
                                 block_tables=block_tables.to(dev).contiguous(),
                                 max_query_len=max(b - a for a, b in zip(starts, starts[1:])),
                                 max_context_len=max_context_len, workspace=self.workspace,
                                 cpu_decode=self.cpu_decode)
        rows = torch.tensor(logit_rows, dtype=torch.int64, device=dev)
        return self.model.forward(i32(ids), positions, meta, self.kv_caches, rows)

    def commit(self, proposal: Proposal | None, emitted: dict[int, int], live) -> None:
        """After the step's update: `emitted` maps each request of the batch to the tokens it
        kept. A request that kept all its drafts and the token after them has its last draft
        still to feed, one that did not draft its t0; the others are up to date. Requests no
        longer `live` are forgotten."""
        if proposal is not None:
            for cid in proposal.fed:
                self.behind.pop(cid, None)
            for cid, (d, position, token) in proposal.last.items():
                if emitted.get(cid, 0) == d + 1:
                    self.behind[cid] = (position, [token])
            for cid, (position, token) in proposal.skipped.items():
                start, behind = self.behind.get(cid, (position, []))
                if start + len(behind) == position:
                    self.behind[cid] = (start, behind + [token])
                else:
                    self.behind[cid] = (position, [token])
        for cid in [cid for cid in self.behind if not live(cid)]:
            del self.behind[cid]
