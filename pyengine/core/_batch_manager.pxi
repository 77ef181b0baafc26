# Cython wrapper of pyengine::BatchManager (csrc/include/pyengine/batch_manager.h), through
# the C++ core's public headers only. The forward metadata lives in C++ buffers allocated
# once; they are exposed as writable buffers that the Python side wraps once with
# torch.frombuffer (zero copy). Each buffer keeps its CoreBatchManager alive.

from cpython.buffer cimport PyBUF_FORMAT, PyBUF_ND, PyBUF_STRIDES
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libcpp cimport bool as cbool
from libcpp.string cimport string
from libcpp.vector cimport vector


cdef extern from "pyengine/types.h" namespace "pyengine":
    cpdef enum class QueuePolicy(int32_t):
        kFcfs
        kPriority

    cpdef enum class CapacitySchedulerPolicy(int32_t):
        kGuaranteedNoEvict
        kMaxUtilization
        kStaticBatch

    cpdef enum class RequestState(int32_t):
        kWaiting
        kContextInProgress
        kGenerationInProgress
        kFinished

    cpdef enum class FinishReason(int32_t):
        kNone
        kEndId
        kStopToken
        kLength
        kAbort
        kStopString


cdef extern from "pyengine/types.h" namespace "pyengine":
    cdef cppclass CachedBlockRecord:
        int32_t block
        uint64_t key
        uint64_t parent
        vector[int32_t] tokens

cdef extern from "pyengine/batch_manager.h" namespace "pyengine":
    cdef cppclass BatchManagerConfig:
        int32_t max_batch_size
        int32_t max_num_tokens
        int32_t max_seq_len
        int32_t tokens_per_block
        int32_t num_blocks
        int32_t num_seq_slots
        cbool enable_chunked_context
        CapacitySchedulerPolicy policy
        int32_t vocab_size
        cbool enable_block_reuse
        QueuePolicy queue_policy
        int32_t num_speculative_tokens
        cbool ngram_drafts
        cbool model_drafts
        int32_t prompt_lookup_min
        int32_t prompt_lookup_max
        cbool adaptive_draft_length
        double draft_row_cost
        double draft_propose_cost

    cdef cppclass ForwardMetadata:
        int32_t num_tokens
        int32_t num_seqs
        int32_t num_generation_seqs
        int32_t num_logits
        int32_t num_draft_tokens
        int32_t max_blocks_per_seq
        vector[int32_t] input_ids, positions, slot_mapping
        vector[int32_t] query_start_loc, seq_lens, seq_slots
        vector[int64_t] request_ids
        vector[int32_t] block_tables
        vector[int32_t] logits_indices, logits_slots
        vector[int64_t] logits_request_ids
        vector[int32_t] logits_offsets

    cdef cppclass StepEvents:
        vector[int64_t] aborted
        vector[int32_t] aborted_slots
        vector[int64_t] paused
        vector[int32_t] paused_slots
        vector[int64_t] assigned
        vector[int32_t] assigned_slots
        vector[int64_t] output_request_ids
        vector[int32_t] logits_rows
        vector[int32_t] tokens
        vector[uint8_t] finished
        vector[int32_t] finish_reasons

    cdef cppclass RequestInfo:
        int64_t id
        RequestState state
        int32_t seq_slot
        int32_t prompt_len
        int32_t num_generated
        int32_t context_len
        int32_t num_computed_tokens
        int32_t num_blocks
        int32_t num_pauses
        int32_t num_reused_tokens
        double arrival_time
        double first_scheduled_time
        double first_token_time
        double finish_time
        FinishReason finish_reason
        int32_t stop_token
        int64_t num_draft_tokens
        int64_t num_accepted_draft_tokens

cdef extern from "pyengine/step_cost.h" namespace "pyengine":
    cdef cppclass StepCostModel:
        double fixed_ms, per_seq_ms, per_token_ms, per_kpair_ms
    cdef cppclass BatchShape:
        int64_t seqs, tokens, pairs
    BatchShape batch_shape(const int32_t* query_start_loc, const int32_t* seq_lens, int32_t num_seqs)

cdef extern from "pyengine/batch_manager.h" namespace "pyengine":
    cdef cppclass BatchManager:
        BatchManager(const BatchManagerConfig&) except +
        void add_request(int64_t, const int32_t*, int32_t, int32_t, int32_t, const vector[int32_t]&,
                         int32_t, double, float, uint64_t, cbool) except +
        cbool abort_request(int64_t)
        cbool remove_waiting(int64_t)
        cbool set_max_draft_tokens(int64_t, int32_t) except +
        cbool set_draft_tokens(int64_t, const int32_t*, int32_t) except +
        void set_scheduled_draft_tokens(const int32_t*, int32_t) except +
        const ForwardMetadata& schedule(double) except +
        const ForwardMetadata& schedule(double, double) except +
        void set_step_cost_model(const StepCostModel&) except +
        const StepCostModel& step_cost_model()
        void update(const int32_t*, int32_t, double) except +
        void free_finished() except +
        cbool rollback()
        void inject_fault(const string&) except +
        cbool finish_request(int64_t, FinishReason, double)
        cbool has_unfinished()
        int32_t num_requests()
        int32_t num_waiting()
        int32_t num_active()
        cbool contains(int64_t)
        RequestInfo request_info(int64_t) except +
        vector[int32_t] block_table(int64_t) except +
        vector[CachedBlockRecord] export_cached_blocks() except +
        vector[int32_t] import_cached_blocks(const vector[CachedBlockRecord]&) except +
        int64_t total_reused_tokens()
        int64_t num_reuse_hits()
        int64_t total_draft_tokens()
        int64_t total_accepted_draft_tokens()
        int32_t num_blocks()
        int32_t num_free_blocks()
        int32_t num_reusable_blocks()
        int32_t tokens_per_block()
        int32_t num_seq_slots()
        int32_t num_free_seq_slots()
        void check_all_seq_slots_free() except +
        const ForwardMetadata& metadata()
        const StepEvents& events()
        void check_invariants() except +


cdef class _OwnedBuffer:
    """A writable 1-D buffer over memory that `owner` keeps alive (a C++ vector inside it).

    memoryview(_OwnedBuffer) holds the _OwnedBuffer, which holds the owner: a tensor made with
    torch.frombuffer from the memoryview keeps the owner (the CoreBatchManager) alive."""

    cdef object owner
    cdef char* data
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]
    cdef Py_ssize_t itemsize
    cdef const char* format  # a string literal (static)

    def __getbuffer__(self, Py_buffer* view, int flags):
        view.buf = self.data
        view.obj = self
        view.len = self.shape[0] * self.itemsize
        view.readonly = 0
        view.itemsize = self.itemsize
        view.ndim = 1
        view.format = NULL  # what the consumer did not ask for is NULL (format NULL: bytes)
        view.shape = NULL
        view.strides = NULL
        if (flags & PyBUF_FORMAT) == PyBUF_FORMAT:
            view.format = <char*> self.format
        if (flags & PyBUF_ND) == PyBUF_ND:
            view.shape = self.shape
        if (flags & PyBUF_STRIDES) == PyBUF_STRIDES:
            view.strides = self.strides
        view.suboffsets = NULL
        view.internal = NULL


cdef object _owned_view(object owner, void* data, size_t size, Py_ssize_t itemsize, const char* fmt):
    cdef _OwnedBuffer b = _OwnedBuffer.__new__(_OwnedBuffer)
    b.owner = owner
    b.data = <char*> data
    b.shape[0] = <Py_ssize_t> size
    b.strides[0] = itemsize
    b.itemsize = itemsize
    b.format = fmt
    return memoryview(b)


cdef object _i32_view(object owner, vector[int32_t]& v):
    return _owned_view(owner, v.data(), v.size(), sizeof(int32_t), b"i")


cdef object _i64_view(object owner, vector[int64_t]& v):
    return _owned_view(owner, v.data(), v.size(), sizeof(int64_t), b"q")


# The user-facing names of the C++ policies (pyengine.config validates against these).
QUEUE_POLICIES = {"fcfs": QueuePolicy.kFcfs, "priority": QueuePolicy.kPriority}

CAPACITY_POLICIES = {
    "guaranteed_no_evict": CapacitySchedulerPolicy.kGuaranteedNoEvict,
    "max_utilization": CapacitySchedulerPolicy.kMaxUtilization,
    "static_batch": CapacitySchedulerPolicy.kStaticBatch,
}


cdef class CoreBatchManager:
    """The C++ batch manager. See csrc/include/pyengine/batch_manager.h for the contract."""

    cdef BatchManager* bm
    cdef object __weakref__

    def __cinit__(self, *, int max_batch_size, int max_num_tokens, int max_seq_len,
                  int tokens_per_block, int num_blocks, int num_seq_slots=0,
                  bint enable_chunked_context=True, str policy="guaranteed_no_evict",
                  int vocab_size=0, bint enable_block_reuse=False, str queue_policy="fcfs",
                  int num_speculative_tokens=0, bint ngram_drafts=False, int prompt_lookup_min=2,
                  int prompt_lookup_max=4, bint model_drafts=False, bint adaptive_draft_length=False,
                  double draft_row_cost=0.0, double draft_propose_cost=0.0):
        if policy not in CAPACITY_POLICIES:
            raise ValueError(f"capacity_scheduler_policy must be one of {sorted(CAPACITY_POLICIES)}, got {policy!r}")
        if queue_policy not in QUEUE_POLICIES:
            raise ValueError(f"queue_policy must be one of {sorted(QUEUE_POLICIES)}, got {queue_policy!r}")
        cdef BatchManagerConfig c
        c.max_batch_size = max_batch_size
        c.max_num_tokens = max_num_tokens
        c.max_seq_len = max_seq_len
        c.tokens_per_block = tokens_per_block
        c.num_blocks = num_blocks
        c.num_seq_slots = num_seq_slots
        c.enable_chunked_context = enable_chunked_context
        c.policy = <CapacitySchedulerPolicy> CAPACITY_POLICIES[policy]
        c.vocab_size = vocab_size
        c.enable_block_reuse = enable_block_reuse
        c.queue_policy = <QueuePolicy> QUEUE_POLICIES[queue_policy]
        c.num_speculative_tokens = num_speculative_tokens
        c.ngram_drafts = ngram_drafts
        c.model_drafts = model_drafts
        c.prompt_lookup_min = prompt_lookup_min
        c.prompt_lookup_max = prompt_lookup_max
        c.adaptive_draft_length = adaptive_draft_length
        c.draft_row_cost = draft_row_cost
        c.draft_propose_cost = draft_propose_cost
        self.bm = new BatchManager(c)

    def __dealloc__(self):
        del self.bm

    @property
    def buffers(self) -> dict:
        """Name -> writable memoryview over a C++ metadata buffer (zero copy: the buffers are
        allocated once and never move). Each view, and a tensor made from it with
        torch.frombuffer, keeps this manager alive. A new dict of views per access (the
        manager does not hold its views, so no reference cycle): wrap them once."""
        cdef ForwardMetadata* m = <ForwardMetadata*> &self.bm.metadata()
        return {
            "input_ids": _i32_view(self, m.input_ids),
            "positions": _i32_view(self, m.positions),
            "slot_mapping": _i32_view(self, m.slot_mapping),
            "query_start_loc": _i32_view(self, m.query_start_loc),
            "seq_lens": _i32_view(self, m.seq_lens),
            "seq_slots": _i32_view(self, m.seq_slots),
            "request_ids": _i64_view(self, m.request_ids),
            "block_tables": _i32_view(self, m.block_tables),
            "logits_indices": _i32_view(self, m.logits_indices),
            "logits_slots": _i32_view(self, m.logits_slots),
            "logits_request_ids": _i64_view(self, m.logits_request_ids),
            "logits_offsets": _i32_view(self, m.logits_offsets),
        }

    def add_request(self, int64_t request_id, const int32_t[::1] prompt, int max_new_tokens,
                    int end_id=-1, stop_token_ids=(), int min_new_tokens=0, double now=0.0,
                    float priority=0.5, uint64_t cache_salt=0, bint reuse_prefix=True):
        cdef vector[int32_t] stops = list(stop_token_ids)
        cdef const int32_t* ptr = &prompt[0] if prompt.shape[0] > 0 else NULL
        self.bm.add_request(request_id, ptr, prompt.shape[0], max_new_tokens, end_id, stops,
                            min_new_tokens, now, priority, cache_salt, reuse_prefix)

    def abort_request(self, int64_t request_id) -> bool:
        return self.bm.abort_request(request_id)

    def remove_waiting(self, int64_t request_id) -> bool:
        return self.bm.remove_waiting(request_id)

    def set_max_draft_tokens(self, int64_t request_id, int n) -> bool:
        """Speculative decoding: the most draft tokens a step of this request carries (0: none)."""
        return self.bm.set_max_draft_tokens(request_id, n)

    def set_draft_tokens(self, int64_t request_id, tokens) -> bool:
        """Draft tokens for the request's next step instead of the n-gram proposer's; False if
        the request is unknown or not generating."""
        cdef vector[int32_t] v = list(tokens)
        return self.bm.set_draft_tokens(request_id, v.data(), <int32_t> v.size())

    def set_scheduled_draft_tokens(self, tokens) -> None:
        """The drafts of the batch just scheduled (model_drafts: a draft model's), each generation
        sequence's in batch order, replacing the placeholders; before update()."""
        cdef vector[int32_t] v = list(tokens)
        self.bm.set_scheduled_draft_tokens(v.data(), <int32_t> v.size())

    def update_from_ptr(self, size_t tokens_ptr, int num_tokens, double now):
        """update() reading `num_tokens` int32 tokens at address `tokens_ptr` (a tensor's data_ptr())."""
        self.bm.update(<const int32_t*> tokens_ptr, num_tokens, now)

    def schedule(self, double now, budget_ms=None):
        """Runs the scheduling half of a step; returns (num_tokens, num_seqs, num_logits).
        `budget_ms`: this step's time budget (context chunks cut to fit the step cost model's
        prediction; see BatchManager::schedule in pyengine/batch_manager.h)."""
        cdef const ForwardMetadata* m
        if budget_ms is None:
            m = &self.bm.schedule(now)
        else:
            m = &self.bm.schedule(now, <double> budget_ms)
        return m.num_tokens, m.num_seqs, m.num_logits

    def scheduled_shape(self) -> tuple:
        """(sequences, tokens, attention pairs) of the batch the last schedule() made: the step
        cost model's regressors (batch_shape in pyengine/step_cost.h)."""
        cdef const ForwardMetadata* m = &self.bm.metadata()
        cdef BatchShape b = batch_shape(m.query_start_loc.data(), m.seq_lens.data(), m.num_seqs)
        return b.seqs, b.tokens, b.pairs

    def set_step_cost_model(self, double fixed_ms, double per_seq_ms, double per_token_ms,
                            double per_kpair_ms) -> None:
        """The linear model of a step's time that schedule(now, budget_ms) cuts chunks by
        (pyengine/step_cost.h): ms = fixed + per_seq * sequences + per_token * tokens
        + per_kpair * attention pairs / 1000."""
        cdef StepCostModel model
        model.fixed_ms, model.per_seq_ms, model.per_token_ms, model.per_kpair_ms = (
            fixed_ms, per_seq_ms, per_token_ms, per_kpair_ms)
        self.bm.set_step_cost_model(model)

    def step_cost_model(self) -> tuple:
        """(fixed_ms, per_seq_ms, per_token_ms, per_kpair_ms) in force."""
        cdef const StepCostModel* m = &self.bm.step_cost_model()
        return m.fixed_ms, m.per_seq_ms, m.per_token_ms, m.per_kpair_ms

    def update(self, const int32_t[::1] tokens, double now):
        cdef const int32_t* ptr = &tokens[0] if tokens.shape[0] > 0 else NULL
        self.bm.update(ptr, tokens.shape[0], now)

    def finish_stopped(self, int64_t request_id, double now) -> bool:
        """Ends a generating request that the caller found a stop string in."""
        return self.bm.finish_request(request_id, FinishReason.kStopString, now)

    def rollback(self) -> bool:
        """Undoes the last schedule() after a failed forward/sampling."""
        return self.bm.rollback()

    def _inject_fault(self, str point) -> None:
        """Test hook: the next schedule() throws once at `point` (see BatchManager::inject_fault
        in pyengine/batch_manager.h); "" disarms."""
        self.bm.inject_fault(point.encode())

    def free_finished(self):
        self.bm.free_finished()

    def events(self) -> dict:
        """What schedule() changed: aborted, paused and newly assigned requests with their
        sequence slots (StepEvents)."""
        cdef const StepEvents* e = &self.bm.events()
        return {
            "aborted": e.aborted, "aborted_slots": e.aborted_slots,
            "paused": e.paused, "paused_slots": e.paused_slots,
            "assigned": e.assigned, "assigned_slots": e.assigned_slots,
        }

    def step_outputs(self):
        """What update() produced, one entry per token (a request that accepted draft tokens
        has several, in order), as a list of
        (request id, token, finished, finish reason, logits row) tuples."""
        cdef const StepEvents* e = &self.bm.events()
        cdef size_t i, n = e.output_request_ids.size()
        return [(e.output_request_ids[i], e.tokens[i], e.finished[i] != 0, e.finish_reasons[i],
                 e.logits_rows[i]) for i in range(n)]

    @property
    def num_finished(self) -> int:
        """Requests the last update() finished."""
        cdef const StepEvents* e = &self.bm.events()
        cdef size_t i, n = 0
        for i in range(e.finished.size()):
            n += e.finished[i]
        return n

    def request_metrics(self, int64_t request_id) -> dict:
        """The request's times and counters; raises IndexError for an unknown id."""
        cdef RequestInfo r = self.bm.request_info(request_id)
        return {
            "arrival_time": r.arrival_time,
            "first_scheduled_time": r.first_scheduled_time,
            "first_token_time": r.first_token_time,
            "finish_time": r.finish_time,
            "num_pauses": r.num_pauses,
            "num_reused_tokens": r.num_reused_tokens,
            "stop_token": r.stop_token,
            "seq_slot": r.seq_slot,
            "num_draft_tokens": r.num_draft_tokens,
            "num_accepted_draft_tokens": r.num_accepted_draft_tokens,
        }

    def block_table(self, int64_t request_id) -> list:
        """The request's KV block ids; raises RuntimeError if it holds no block table."""
        return list(self.bm.block_table(request_id))

    def export_cached_blocks(self) -> list:
        """The reusable prefix-cache blocks, most recently used first: (block, key, parent,
        tokens) tuples. Raises RuntimeError unless idle."""
        cdef vector[CachedBlockRecord] rs = self.bm.export_cached_blocks()
        return [(r.block, r.key, r.parent, list(r.tokens)) for r in rs]

    def import_cached_blocks(self, records) -> list:
        """Puts (key, parent, tokens) records back as reusable blocks, most recent first, as
        many as fit; returns the block each got (-1: skipped). Raises ValueError (changing
        nothing) for a malformed record, RuntimeError unless idle."""
        cdef vector[CachedBlockRecord] rs
        cdef CachedBlockRecord r
        for key, parent, tokens in records:
            r.key = key
            r.parent = parent
            r.tokens = tokens
            rs.push_back(r)
        return list(self.bm.import_cached_blocks(rs))

    def contains(self, int64_t request_id) -> bool:
        return self.bm.contains(request_id)

    def has_unfinished(self) -> bool:
        return self.bm.has_unfinished()

    def check_invariants(self):
        self.bm.check_invariants()

    def check_all_slots_free(self):
        """Raises RuntimeError naming the holders if any sequence slot is still held."""
        self.bm.check_all_seq_slots_free()

    @property
    def num_generation_seqs(self) -> int:
        return self.bm.metadata().num_generation_seqs

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens in the last schedule()'s batch (speculative decoding)."""
        return self.bm.metadata().num_draft_tokens

    @property
    def max_blocks_per_seq(self) -> int:
        return self.bm.metadata().max_blocks_per_seq

    @property
    def num_requests(self) -> int:
        return self.bm.num_requests()

    @property
    def num_waiting(self) -> int:
        return self.bm.num_waiting()

    @property
    def num_active(self) -> int:
        return self.bm.num_active()

    @property
    def num_blocks(self) -> int:
        return self.bm.num_blocks()

    @property
    def num_free_blocks(self) -> int:
        return self.bm.num_free_blocks()

    @property
    def num_reusable_blocks(self) -> int:
        return self.bm.num_reusable_blocks()

    @property
    def total_reused_tokens(self) -> int:
        return self.bm.total_reused_tokens()

    @property
    def num_reuse_hits(self) -> int:
        return self.bm.num_reuse_hits()

    @property
    def total_draft_tokens(self) -> int:
        """Speculative decoding: draft tokens verified over all steps."""
        return self.bm.total_draft_tokens()

    @property
    def total_accepted_draft_tokens(self) -> int:
        return self.bm.total_accepted_draft_tokens()

    @property
    def num_slots(self) -> int:
        """Sequence slots in the pool (C++ num_seq_slots())."""
        return self.bm.num_seq_slots()

    @property
    def num_free_slots(self) -> int:
        """Sequence slots no request holds (C++ num_free_seq_slots())."""
        return self.bm.num_free_seq_slots()
