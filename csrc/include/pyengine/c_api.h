/* The C API of pyengine's C++ core: the batch manager, its KV cache, and the CPU attention and
 * linear kernels, for C programs and for bindings from other languages (in the spirit of
 * llama.h). C99; the C++ API (pyengine/batch_manager.h, pyengine/kernels.h, ...) stays for C++.
 *
 * Handles are opaque. Errors: every function that can fail returns a pe_status; PE_OK is 0.
 * No C++ exception crosses this API: each function catches everything and turns it into a
 * status. After every call that returns a pe_status, pe_last_error_message() holds the calling
 * thread's message of that call ("" after PE_OK).
 *
 * Thread-safety: a pe_batch_manager (and its pe_kv_cache) is used by one thread at a time;
 * different handles may be used from different threads at once. The kernel functions are
 * reentrant (they may run on several threads at once, on disjoint outputs). The error message is
 * per thread.
 *
 * Ownership: the caller owns what it creates (pe_batch_manager_create) and frees it once with
 * the matching free function. Pointers the API hands out (metadata, events, messages) are
 * borrowed: valid for as long as the function documenting them says, never freed by the caller.
 */
#ifndef PYENGINE_C_API_H
#define PYENGINE_C_API_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- errors ---- */

typedef enum pe_status {
  PE_OK = 0,
  PE_ERR_INVALID_ARGUMENT = 1, /* a bad value or a NULL handle/pointer; nothing was changed */
  PE_ERR_NOT_FOUND = 2,        /* an unknown request id */
  PE_ERR_INVALID_STATE = 3,    /* not allowed now (e.g. rollback without a schedule) */
  PE_ERR_OUT_OF_MEMORY = 4,
  PE_ERR_RUNTIME = 5,          /* any other failure (e.g. an injected fault, an internal error) */
} pe_status;

/* The calling thread's message of its last call that returned a pe_status ("" after PE_OK). The
 * string is owned by the library and valid until the thread's next call into this API. */
const char* pe_last_error_message(void);

/* "PE_OK", "PE_ERR_INVALID_ARGUMENT", ...; "unknown" for other values. A static string. */
const char* pe_status_name(pe_status status);

/* ---- the batch manager (pyengine/batch_manager.h) ---- */

typedef struct pe_batch_manager pe_batch_manager;

typedef enum pe_capacity_policy {
  PE_POLICY_GUARANTEED_NO_EVICT = 0,
  PE_POLICY_MAX_UTILIZATION = 1,
  PE_POLICY_STATIC_BATCH = 2,
} pe_capacity_policy;

typedef enum pe_queue_policy { PE_QUEUE_FCFS = 0, PE_QUEUE_PRIORITY = 1 } pe_queue_policy;

typedef enum pe_request_state {
  PE_REQUEST_WAITING = 0,
  PE_REQUEST_CONTEXT_IN_PROGRESS = 1,
  PE_REQUEST_GENERATION_IN_PROGRESS = 2,
  PE_REQUEST_FINISHED = 3,
} pe_request_state;

typedef enum pe_finish_reason {
  PE_FINISH_NONE = 0,
  PE_FINISH_END_ID = 1,
  PE_FINISH_STOP_TOKEN = 2,
  PE_FINISH_LENGTH = 3,
  PE_FINISH_ABORT = 4,
  PE_FINISH_STOP_STRING = 5,
} pe_finish_reason;

/* Fields as pyengine::BatchManagerConfig's; booleans are 0/1. */
typedef struct pe_batch_manager_config {
  int32_t max_batch_size;
  int32_t max_num_tokens;
  int32_t max_seq_len;
  int32_t tokens_per_block;
  int32_t num_blocks;
  int32_t num_seq_slots; /* 0: max_batch_size */
  int32_t enable_chunked_context;
  int32_t policy;        /* pe_capacity_policy */
  int32_t vocab_size;    /* > 0: prompt token ids are range-checked */
  int32_t enable_block_reuse;
  int32_t queue_policy;  /* pe_queue_policy */
  /* speculative decoding (docs/speculative_decoding.md): draft tokens a step of a request may
   * carry (0: off); whether schedule proposes them by prompt lookup, and its n-gram sizes */
  int32_t num_speculative_tokens;
  int32_t ngram_drafts;
  int32_t prompt_lookup_min;
  int32_t prompt_lookup_max;
  /* whether schedule gives every generating request its draft limit of placeholders, which
   * pe_batch_manager_set_scheduled_draft_tokens fills (a draft model run after the schedule) */
  int32_t model_drafts;
  /* adaptive draft length (pyengine::BatchManagerConfig): each step a request carries the
   * draft count that its acceptance so far and these costs make worth most */
  int32_t adaptive_draft_length;
  double draft_row_cost;
  double draft_propose_cost;
} pe_batch_manager_config;

/* The C++ defaults (num_blocks 0: set it). Thread-safe. */
pe_batch_manager_config pe_batch_manager_config_default(void);

/* Creates a batch manager in *out (NULL on failure). PE_ERR_INVALID_ARGUMENT for NULL
 * pointers, a policy out of range or a configuration the C++ constructor refuses. Owned by the
 * caller: free it with pe_batch_manager_free. */
pe_status pe_batch_manager_create(const pe_batch_manager_config* config, pe_batch_manager** out);

/* Frees the manager and everything it handed out (metadata, events, its pe_kv_cache). NULL is
 * ignored. */
void pe_batch_manager_free(pe_batch_manager* bm);

/* One request's parameters, as BatchManager::add_request's. */
typedef struct pe_request_params {
  const int32_t* prompt;          /* prompt_len token ids, copied */
  int32_t prompt_len;
  int32_t max_new_tokens;
  int32_t min_new_tokens;
  int32_t end_id;                 /* -1: none */
  const int32_t* stop_token_ids;  /* num_stop_token_ids ids, copied (NULL if 0) */
  int32_t num_stop_token_ids;
  float priority;                 /* under PE_QUEUE_PRIORITY: higher first */
  uint64_t cache_salt;            /* 0: the shared prefix-cache chain */
  int32_t reuse_prefix;           /* 0: never take blocks from the prefix cache */
} pe_request_params;

/* Defaults: no prompt, max_new_tokens 16, min 0, end_id -1, no stop tokens, priority 0.5,
 * salt 0, reuse_prefix 1. Thread-safe. */
pe_request_params pe_request_params_default(void);

/* Queues request `id`. PE_ERR_INVALID_ARGUMENT (nothing changed) for a duplicate id, an empty
 * prompt, a token id outside the vocabulary, max_new_tokens < 1, min_new_tokens outside
 * [0, max_new_tokens], a request longer than max_seq_len or one that could never fit. */
pe_status pe_batch_manager_add_request(pe_batch_manager* bm, int64_t id, const pe_request_params* params,
                                       double now);

/* Speculative decoding: draft tokens for request `id`'s next step instead of the n-gram
 * proposer's (e.g. a draft model's), as BatchManager::set_draft_tokens. PE_ERR_NOT_FOUND if
 * unknown or not generating; PE_ERR_INVALID_ARGUMENT for a token outside the vocabulary. */
pe_status pe_batch_manager_set_draft_tokens(pe_batch_manager* bm, int64_t id, const int32_t* tokens, int32_t n);

/* The drafts of the batch the last schedule returned, replacing its placeholders (model_drafts):
 * n == the metadata's num_draft_tokens, each generation sequence's in batch order; also written
 * into the metadata's input_ids. Call it before the forward and before update, which accepts
 * drafts against them. PE_ERR_INVALID_ARGUMENT (nothing changed) for another count or a token
 * outside the vocabulary. */
pe_status pe_batch_manager_set_scheduled_draft_tokens(pe_batch_manager* bm, const int32_t* tokens, int32_t n);

/* The most draft tokens a step of request `id` may carry (0: it never speculates).
 * PE_ERR_NOT_FOUND if unknown; PE_ERR_INVALID_ARGUMENT outside [0, num_speculative_tokens]. */
pe_status pe_batch_manager_set_max_draft_tokens(pe_batch_manager* bm, int64_t id, int32_t n);

/* Marks request `id` to be dropped at the next schedule. PE_ERR_NOT_FOUND if unknown. */
pe_status pe_batch_manager_abort(pe_batch_manager* bm, int64_t id);

/* Ends a generating request for a reason the caller found (PE_FINISH_STOP_STRING, ...); it is
 * retired by the next free_finished. PE_ERR_NOT_FOUND if unknown or not generating. */
pe_status pe_batch_manager_finish_request(pe_batch_manager* bm, int64_t id, int32_t reason, double now);

/* The forward's inputs of one step (see ForwardMetadata in pyengine/batch_manager.h). The arrays
 * belong to the manager: their addresses stay the same for its lifetime, their contents are
 * those of the last schedule until the next one. Per token: input_ids, positions, slot_mapping
 * [num_tokens]; per sequence: query_start_loc [num_seqs + 1], seq_lens, seq_slots, request_ids
 * [num_seqs], block_tables [num_seqs * max_blocks_per_seq] (rows padded); per logits row:
 * logits_indices, logits_slots, logits_request_ids, logits_offsets [num_logits]. A generation
 * sequence with draft tokens has one logits row per token (offsets 0, 1, ...). */
typedef struct pe_forward_metadata {
  int32_t num_tokens;
  int32_t num_seqs;
  int32_t num_generation_seqs; /* generation rows come first */
  int32_t num_logits;
  int32_t max_blocks_per_seq;
  const int32_t* input_ids;
  const int32_t* positions;
  const int32_t* slot_mapping;
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  const int32_t* seq_slots;
  const int64_t* request_ids;
  const int32_t* block_tables;
  const int32_t* logits_indices;
  const int32_t* logits_slots;
  const int64_t* logits_request_ids;
  const int32_t* logits_offsets;
  int32_t num_draft_tokens;
} pe_forward_metadata;

/* Schedules one step and fills *out (may be NULL: read it later with pe_batch_manager_metadata).
 * On an error the step is undone as by rollback (the aborts it dropped stand: see the events);
 * PE_ERR_INVALID_STATE if a finished request was not retired by free_finished. */
pe_status pe_batch_manager_schedule(pe_batch_manager* bm, double now, pe_forward_metadata* out);

/* The last schedule's metadata (as pe_batch_manager_schedule fills it). */
pe_status pe_batch_manager_metadata(const pe_batch_manager* bm, pe_forward_metadata* out);

/* Appends one sampled token per logits row of the last schedule. PE_ERR_INVALID_ARGUMENT if
 * num_tokens differs from its num_logits, or tokens is NULL while num_tokens > 0. */
pe_status pe_batch_manager_update(pe_batch_manager* bm, const int32_t* tokens, int32_t num_tokens, double now);

/* Retires the requests the last update finished (their KV blocks, then sequence slots). */
pe_status pe_batch_manager_free_finished(pe_batch_manager* bm);

/* Undoes the last schedule (the forward failed). PE_ERR_INVALID_STATE outside schedule..update. */
pe_status pe_batch_manager_rollback(pe_batch_manager* bm);

/* What the last schedule and update changed (StepEvents). Arrays owned by the manager, valid
 * until its next schedule, update, free_finished or rollback. */
typedef struct pe_step_events {
  int32_t num_aborted;          /* dropped by schedule: ids and the slots they held (-1: none) */
  const int64_t* aborted;
  const int32_t* aborted_slots;
  int32_t num_paused;           /* paused by schedule, to be recomputed */
  const int64_t* paused;
  const int32_t* paused_slots;
  int32_t num_assigned;         /* given a sequence slot by schedule */
  const int64_t* assigned;
  const int32_t* assigned_slots;
  int32_t num_outputs;          /* update: one entry per token produced (several, in order, for a
                                   request that accepted draft tokens; `finished` on its last) */
  const int64_t* output_request_ids;
  const int32_t* logits_rows;
  const int32_t* tokens;
  const uint8_t* finished;      /* 0/1 */
  const int32_t* finish_reasons; /* pe_finish_reason */
} pe_step_events;

pe_status pe_batch_manager_events(const pe_batch_manager* bm, pe_step_events* out);

/* Counts of the manager's requests and pools. */
typedef struct pe_batch_manager_stats {
  int32_t num_requests;       /* known: queued, holding resources, or not yet retired */
  int32_t num_waiting;
  int32_t num_active;
  int32_t has_unfinished;     /* 0/1 */
  int32_t num_seq_slots;
  int32_t num_free_seq_slots;
} pe_batch_manager_stats;

pe_status pe_batch_manager_stats_get(const pe_batch_manager* bm, pe_batch_manager_stats* out);

/* A snapshot of one request (RequestInfo). */
typedef struct pe_request_info {
  int64_t id;
  int32_t state;              /* pe_request_state */
  int32_t seq_slot;           /* -1 while it holds none */
  int32_t prompt_len;
  int32_t num_generated;
  int32_t context_len;
  int32_t num_computed_tokens;
  int32_t num_blocks;
  int32_t num_pauses;
  int32_t num_reused_tokens;
  int32_t finish_reason;      /* pe_finish_reason */
  int32_t stop_token;         /* -1 unless stopped by end id / stop token */
  double arrival_time;
  double first_scheduled_time; /* -1: not yet */
  double first_token_time;
  double finish_time;
  int64_t num_draft_tokens;   /* speculative decoding: verified ... */
  int64_t num_accepted_draft_tokens; /* ... and accepted */
} pe_request_info;

/* PE_ERR_NOT_FOUND for an unknown id. */
pe_status pe_batch_manager_request_info(const pe_batch_manager* bm, int64_t id, pe_request_info* out);

/* Checks the pools against the requests: PE_ERR_RUNTIME with the disagreement otherwise. */
pe_status pe_batch_manager_check_invariants(const pe_batch_manager* bm);

/* ---- the KV cache of a batch manager ---- */

/* The paged KV cache's block pool, as the batch manager manages it. Borrowed from its manager
 * (the same handle on every call; valid until pe_batch_manager_free; never freed by the caller);
 * the manager's thread-safety rule covers it. */
typedef struct pe_kv_cache pe_kv_cache;

pe_kv_cache* pe_batch_manager_kv_cache(pe_batch_manager* bm); /* NULL for NULL */

typedef struct pe_kv_cache_stats {
  int32_t num_blocks;          /* pool size */
  int32_t tokens_per_block;
  int32_t num_free_blocks;     /* held by no request (some still reusable) */
  int32_t num_reusable_blocks; /* free, still holding prefix-cache content */
  int64_t total_reused_tokens; /* prefix-cache tokens taken, over all steps */
  int64_t num_reuse_hits;      /* block tables that took any cached blocks */
} pe_kv_cache_stats;

pe_status pe_kv_cache_stats_get(const pe_kv_cache* kv, pe_kv_cache_stats* out);

/* Copies request `id`'s block ids (token order) into out[0 .. capacity) and their number into
 * *num_blocks (also when it exceeds capacity: then PE_ERR_INVALID_ARGUMENT and nothing is
 * copied; pass capacity 0 to ask). PE_ERR_NOT_FOUND if the request holds no block table. */
pe_status pe_kv_cache_block_table(const pe_kv_cache* kv, int64_t id, int32_t* out, int32_t capacity,
                                  int32_t* num_blocks);

/* ---- CPU kernels (pyengine/kernels.h, cpu_linear.h, cpu_gemm.h): layouts and checks as there ---- */

typedef enum pe_dtype { PE_FLOAT32 = 0, PE_BFLOAT16 = 1, PE_FLOAT16 = 2 } pe_dtype;

/* Writes this step's K/V rows into their cache slots (kernels::store_kv). */
pe_status pe_store_kv(const void* key, const void* value, int64_t key_row_stride, int64_t value_row_stride,
                      int32_t src_dtype, void* k_cache, void* v_cache, int32_t cache_dtype,
                      const int32_t* slot_mapping, int32_t num_tokens, int32_t num_kv_heads, int32_t head_dim,
                      int32_t tokens_per_block, int32_t num_blocks);

/* Causal paged attention over prefill chunks and decode rows (kernels::paged_attention);
 * num_threads <= 0: the default. */
pe_status pe_paged_attention(void* out, int64_t out_row_stride, const void* query, int64_t query_row_stride,
                             int32_t q_dtype, const void* k_cache, const void* v_cache, int32_t cache_dtype,
                             const int32_t* query_start_loc, const int32_t* seq_lens,
                             const int32_t* block_tables, int32_t num_seqs, int32_t num_tokens,
                             int32_t max_blocks_per_seq, int32_t num_heads, int32_t num_kv_heads,
                             int32_t head_dim, int32_t tokens_per_block, int32_t num_blocks, float scale,
                             int32_t sliding_window, float softcap, int32_t num_threads);

/* y = x . W^T (+ bias), 1 <= M <= 64 rows (kernels::linear_f32 / linear_bf16; bf16 as raw bits). */
pe_status pe_linear_f32(float* y, const float* x, const float* weight, const float* bias, int32_t M, int32_t N,
                        int32_t K, int32_t num_threads);
pe_status pe_linear_bf16(uint16_t* y, const uint16_t* x, const uint16_t* weight, const uint16_t* bias,
                         int32_t M, int32_t N, int32_t K, int32_t num_threads);

/* The same for any M >= 1 rows, compute-bound (kernels::gemm_f32 / gemm_bf16: prefill, large batches). */
pe_status pe_gemm_f32(float* y, const float* x, const float* weight, const float* bias, int32_t M, int32_t N,
                      int32_t K, int32_t num_threads);
pe_status pe_gemm_bf16(uint16_t* y, const uint16_t* x, const uint16_t* weight, const uint16_t* bias, int32_t M,
                       int32_t N, int32_t K, int32_t num_threads);

/* The instruction-set level the kernels run at ("generic", "avx2", "avx512", "neon"; a static
 * string), in *out. PE_ERR_INVALID_ARGUMENT if PYENGINE_CPU_ISA names an unusable level. */
pe_status pe_cpu_isa_name(const char** out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* PYENGINE_C_API_H */
