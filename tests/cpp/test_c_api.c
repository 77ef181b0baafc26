/* The C API (pyengine/c_api.h), compiled as C99: a schedule/update loop with a fake model
 * (every sampled token is 42) with its exact schedules, the KV cache's view, the error codes and
 * messages of bad input, and the CPU kernels on a case small enough to know the answer. */
#include <stdio.h>
#include <string.h>

#include "pyengine/c_api.h"

static int failures = 0;

#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      fprintf(stderr, "%s:%d: FAILED: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                     \
    }                                                                 \
  } while (0)

#define CHECK_INT(actual, expected)                                                             \
  do {                                                                                          \
    long long a_ = (long long)(actual), e_ = (long long)(expected);                             \
    if (a_ != e_) {                                                                             \
      fprintf(stderr, "%s:%d: FAILED: %s is %lld, expected %lld\n", __FILE__, __LINE__, #actual, a_, e_); \
      ++failures;                                                                               \
    }                                                                                           \
  } while (0)

/* The call returned `status` and the thread's message contains `text`. */
#define CHECK_ERROR(call, status, text)                                                        \
  do {                                                                                         \
    pe_status s_ = (call);                                                                     \
    if (s_ != (status) || strstr(pe_last_error_message(), (text)) == NULL) {                   \
      fprintf(stderr, "%s:%d: FAILED: %s gave %s '%s', expected %s containing '%s'\n", __FILE__, \
              __LINE__, #call, pe_status_name(s_), pe_last_error_message(), #status, (text));    \
      ++failures;                                                                              \
    }                                                                                          \
  } while (0)

#define CHECK_OK(call)                                                                          \
  do {                                                                                          \
    pe_status s_ = (call);                                                                      \
    if (s_ != PE_OK || pe_last_error_message()[0] != '\0') {                                    \
      fprintf(stderr, "%s:%d: FAILED: %s gave %s '%s'\n", __FILE__, __LINE__, #call, pe_status_name(s_), \
              pe_last_error_message());                                                         \
      ++failures;                                                                               \
    }                                                                                           \
  } while (0)

static void check_ints(const char* what, const int32_t* actual, const int32_t* expected, int n) {
  int i;
  for (i = 0; i < n; ++i)
    if (actual[i] != expected[i]) {
      fprintf(stderr, "FAILED: %s[%d] is %d, expected %d\n", what, i, actual[i], expected[i]);
      ++failures;
    }
}

static pe_batch_manager_config small_config(void) {
  pe_batch_manager_config c = pe_batch_manager_config_default();
  c.max_batch_size = 4;
  c.max_num_tokens = 32; /* the 40-token prompt takes two steps */
  c.max_seq_len = 128;
  c.tokens_per_block = 16;
  c.num_blocks = 8;
  c.vocab_size = 100;
  return c;
}

static void test_schedule_update_loop(void) {
  pe_batch_manager_config config = small_config();
  pe_batch_manager* bm = NULL;
  pe_request_params p = pe_request_params_default();
  int32_t prompt1[40], prompt2[10], sampled[4] = {42, 42, 42, 42};
  pe_forward_metadata m;
  pe_step_events e;
  pe_batch_manager_stats st;
  pe_kv_cache_stats kvs;
  pe_request_info info;
  int32_t table[8], n = -1;
  int i;
  pe_kv_cache* kv;

  for (i = 0; i < 40; ++i) prompt1[i] = i + 1;
  for (i = 0; i < 10; ++i) prompt2[i] = 50 + i;
  CHECK_OK(pe_batch_manager_create(&config, &bm));
  kv = pe_batch_manager_kv_cache(bm);
  CHECK(kv != NULL && kv == pe_batch_manager_kv_cache(bm));
  p.prompt = prompt1;
  p.prompt_len = 40;
  p.max_new_tokens = 2;
  CHECK_OK(pe_batch_manager_add_request(bm, 1, &p, 0.0));
  p.prompt = prompt2;
  p.prompt_len = 10;
  p.max_new_tokens = 3;
  CHECK_OK(pe_batch_manager_add_request(bm, 2, &p, 0.0));
  CHECK_OK(pe_batch_manager_stats_get(bm, &st));
  CHECK_INT(st.num_requests, 2);
  CHECK_INT(st.num_waiting, 2);
  CHECK_INT(st.has_unfinished, 1);

  /* step 0: request 1's first 32 prompt tokens (blocks 0, 1), request 2 does not fit the budget */
  CHECK_OK(pe_batch_manager_schedule(bm, 1.0, &m));
  CHECK_INT(m.num_tokens, 32);
  CHECK_INT(m.num_seqs, 1);
  CHECK_INT(m.num_generation_seqs, 0);
  CHECK_INT(m.num_logits, 0);
  CHECK_INT(m.request_ids[0], 1);
  CHECK_INT(m.input_ids[0], 1);
  CHECK_INT(m.input_ids[31], 32);
  CHECK_INT(m.positions[31], 31);
  CHECK_INT(m.query_start_loc[1], 32);
  CHECK_INT(m.seq_lens[0], 32);
  {
    const int32_t slots[4] = {0, 1, 16, 31};
    const int32_t got[4] = {m.slot_mapping[0], m.slot_mapping[1], m.slot_mapping[16], m.slot_mapping[31]};
    check_ints("step 0 slot_mapping[0, 1, 16, 31]", got, slots, 4);
  }
  CHECK_OK(pe_kv_cache_block_table(kv, 1, table, 8, &n));
  CHECK_INT(n, 2); /* blocks for the tokens computed so far (the rest is only reserved) */
  {
    const int32_t expected[2] = {0, 1};
    check_ints("request 1 blocks", table, expected, 2);
    check_ints("step 0 block_tables row 0", m.block_tables, expected, 2);
  }
  CHECK_OK(pe_batch_manager_update(bm, sampled, 0, 1.0));
  CHECK_OK(pe_batch_manager_events(bm, &e));
  CHECK_INT(e.num_outputs, 0);
  CHECK_INT(e.num_assigned, 1);
  CHECK_INT(e.assigned[0], 1);
  CHECK_OK(pe_batch_manager_free_finished(bm));

  /* step 1: the rest of request 1's prompt (8 tokens) and request 2's prompt (10): 2 logits rows */
  CHECK_OK(pe_batch_manager_schedule(bm, 2.0, &m));
  CHECK_INT(m.num_tokens, 18);
  CHECK_INT(m.num_seqs, 2);
  CHECK_INT(m.num_generation_seqs, 0);
  CHECK_INT(m.num_logits, 2);
  CHECK_INT(m.request_ids[0], 1);
  CHECK_INT(m.request_ids[1], 2);
  {
    const int32_t qsl[3] = {0, 8, 18}, lens[2] = {40, 10}, logits[2] = {7, 17};
    check_ints("step 1 query_start_loc", m.query_start_loc, qsl, 3);
    check_ints("step 1 seq_lens", m.seq_lens, lens, 2);
    check_ints("step 1 logits_indices", m.logits_indices, logits, 2);
  }
  CHECK_INT(m.input_ids[0], 33);
  CHECK_INT(m.positions[0], 32);
  CHECK_INT(m.slot_mapping[0], 2 * 16 + 0); /* position 32: block 2, offset 0 */
  CHECK_INT(m.input_ids[8], 50);
  CHECK_INT(m.slot_mapping[8], 3 * 16 + 0); /* request 2's first block is block 3 */
  CHECK_INT(m.block_tables[2], 2); /* request 1 took block 2 for positions 32.. */
  CHECK_INT(m.block_tables[m.max_blocks_per_seq], 3);
  CHECK_OK(pe_batch_manager_update(bm, sampled, 2, 2.0));
  CHECK_OK(pe_batch_manager_events(bm, &e));
  CHECK_INT(e.num_outputs, 2);
  CHECK_INT(e.output_request_ids[0], 1);
  CHECK_INT(e.output_request_ids[1], 2);
  CHECK_INT(e.tokens[0], 42);
  CHECK_INT(e.finished[0], 0);
  CHECK_OK(pe_batch_manager_free_finished(bm));

  /* step 2: two generation rows; request 1 reaches max_new_tokens = 2 */
  CHECK_OK(pe_batch_manager_schedule(bm, 3.0, &m));
  CHECK_INT(m.num_tokens, 2);
  CHECK_INT(m.num_generation_seqs, 2);
  CHECK_INT(m.input_ids[0], 42);
  CHECK_INT(m.positions[0], 40);
  CHECK_INT(m.positions[1], 10);
  CHECK_INT(m.slot_mapping[0], 2 * 16 + 8);
  CHECK_INT(m.slot_mapping[1], 3 * 16 + 10);
  CHECK_OK(pe_batch_manager_update(bm, sampled, 2, 3.0));
  CHECK_OK(pe_batch_manager_events(bm, &e));
  CHECK_INT(e.num_outputs, 2);
  CHECK_INT(e.finished[0], 1);
  CHECK_INT(e.finish_reasons[0], PE_FINISH_LENGTH);
  CHECK_INT(e.finished[1], 0);
  CHECK_OK(pe_batch_manager_request_info(bm, 1, &info));
  CHECK_INT(info.state, PE_REQUEST_FINISHED);
  CHECK_INT(info.num_generated, 2);
  CHECK_INT(info.prompt_len, 40);
  CHECK(info.first_token_time == 2.0 && info.finish_time == 3.0);
  CHECK_OK(pe_batch_manager_free_finished(bm));
  CHECK_ERROR(pe_batch_manager_request_info(bm, 1, &info), PE_ERR_NOT_FOUND, "unknown request id 1");
  CHECK_ERROR(pe_kv_cache_block_table(kv, 1, table, 8, &n), PE_ERR_NOT_FOUND, "1");
  CHECK_OK(pe_kv_cache_stats_get(kv, &kvs));
  CHECK_INT(kvs.num_blocks, 8);
  CHECK_INT(kvs.tokens_per_block, 16);
  CHECK_INT(kvs.num_free_blocks, 7); /* request 2 holds one block */

  /* step 3: request 2 alone; its third token finishes it */
  CHECK_OK(pe_batch_manager_schedule(bm, 4.0, &m));
  CHECK_INT(m.num_seqs, 1);
  CHECK_INT(m.request_ids[0], 2);
  CHECK_INT(m.positions[0], 11);
  CHECK_OK(pe_batch_manager_update(bm, sampled, 1, 4.0));
  CHECK_OK(pe_batch_manager_events(bm, &e));
  CHECK_INT(e.finished[0], 1);
  CHECK_OK(pe_batch_manager_free_finished(bm));
  CHECK_OK(pe_batch_manager_stats_get(bm, &st));
  CHECK_INT(st.has_unfinished, 0);
  CHECK_INT(st.num_free_seq_slots, 4);
  CHECK_OK(pe_kv_cache_stats_get(kv, &kvs));
  CHECK_INT(kvs.num_free_blocks, 8);
  CHECK_OK(pe_batch_manager_check_invariants(bm));
  pe_batch_manager_free(bm);
}

static void test_bad_input(void) {
  pe_batch_manager_config config = small_config();
  pe_batch_manager* bm = NULL;
  pe_request_params p = pe_request_params_default();
  int32_t prompt[4] = {1, 2, 100, 3}, tokens[2] = {0, 0};
  pe_forward_metadata m;
  pe_request_info info;
  int32_t table[1], n = 0;

  /* NULL handles and pointers */
  CHECK_ERROR(pe_batch_manager_schedule(NULL, 0.0, &m), PE_ERR_INVALID_ARGUMENT, "bm: must not be NULL");
  CHECK_ERROR(pe_batch_manager_create(&config, NULL), PE_ERR_INVALID_ARGUMENT, "out: must not be NULL");
  CHECK_ERROR(pe_batch_manager_create(NULL, &bm), PE_ERR_INVALID_ARGUMENT, "config: must not be NULL");
  CHECK(bm == NULL);
  CHECK_ERROR(pe_kv_cache_stats_get(NULL, NULL), PE_ERR_INVALID_ARGUMENT, "kv: must not be NULL");
  CHECK(pe_batch_manager_kv_cache(NULL) == NULL);
  pe_batch_manager_free(NULL); /* ignored */

  /* a configuration the C++ constructor refuses, and enum values out of range */
  config.num_blocks = 0;
  CHECK_ERROR(pe_batch_manager_create(&config, &bm), PE_ERR_INVALID_ARGUMENT, "num_blocks");
  CHECK(bm == NULL);
  config = small_config();
  config.policy = 3;
  CHECK_ERROR(pe_batch_manager_create(&config, &bm), PE_ERR_INVALID_ARGUMENT, "policy: must be 0, 1 or 2, got 3");
  config = small_config();
  CHECK_OK(pe_batch_manager_create(&config, &bm));

  /* bad requests change nothing */
  p.prompt = prompt;
  p.prompt_len = 2;
  p.max_new_tokens = -1;
  CHECK_ERROR(pe_batch_manager_add_request(bm, 1, &p, 0.0), PE_ERR_INVALID_ARGUMENT,
              "max_tokens must be at least 1, got -1");
  p.max_new_tokens = 4;
  p.prompt_len = 4;
  CHECK_ERROR(pe_batch_manager_add_request(bm, 1, &p, 0.0), PE_ERR_INVALID_ARGUMENT,
              "prompt token id 100 at position 2");
  p.prompt_len = 2;
  p.num_stop_token_ids = 1;
  CHECK_ERROR(pe_batch_manager_add_request(bm, 1, &p, 0.0), PE_ERR_INVALID_ARGUMENT,
              "stop_token_ids: must not be NULL");
  p.num_stop_token_ids = 0;
  CHECK_ERROR(pe_batch_manager_add_request(bm, 1, NULL, 0.0), PE_ERR_INVALID_ARGUMENT, "params: must not be NULL");
  CHECK_OK(pe_batch_manager_add_request(bm, 1, &p, 0.0));
  CHECK_ERROR(pe_batch_manager_add_request(bm, 1, &p, 0.0), PE_ERR_INVALID_ARGUMENT,
              "request_id 1 is already in use");

  /* unknown ids */
  CHECK_ERROR(pe_batch_manager_abort(bm, 99), PE_ERR_NOT_FOUND, "unknown request id 99");
  CHECK_ERROR(pe_batch_manager_request_info(bm, 99, &info), PE_ERR_NOT_FOUND, "unknown request id 99");
  CHECK_ERROR(pe_batch_manager_finish_request(bm, 99, PE_FINISH_STOP_STRING, 0.0), PE_ERR_NOT_FOUND,
              "unknown request id 99");
  CHECK_ERROR(pe_kv_cache_block_table(pe_batch_manager_kv_cache(bm), 1, table, 1, &n), PE_ERR_NOT_FOUND,
              "1"); /* queued: no block table yet */

  /* calls out of order */
  CHECK_ERROR(pe_batch_manager_rollback(bm), PE_ERR_INVALID_STATE, "rollback: no schedule to undo");
  CHECK_OK(pe_batch_manager_schedule(bm, 1.0, &m));
  CHECK_INT(m.num_logits, 1);
  CHECK_ERROR(pe_batch_manager_update(bm, tokens, 2, 1.0), PE_ERR_INVALID_ARGUMENT, "update() got 2 tokens for 1");
  CHECK_ERROR(pe_kv_cache_block_table(pe_batch_manager_kv_cache(bm), 1, table, 0, &n), PE_ERR_INVALID_ARGUMENT,
              "capacity: 0 is less than the 1 blocks of request 1");
  CHECK_INT(n, 1);
  CHECK_OK(pe_batch_manager_rollback(bm)); /* the failed step undone: schedule again */
  CHECK_OK(pe_batch_manager_schedule(bm, 2.0, &m));
  CHECK_INT(m.num_tokens, 2);
  CHECK_OK(pe_batch_manager_abort(bm, 1));
  CHECK_OK(pe_batch_manager_check_invariants(bm));
  pe_batch_manager_free(bm);

  CHECK(strcmp(pe_status_name(PE_ERR_NOT_FOUND), "PE_ERR_NOT_FOUND") == 0);
  CHECK(strcmp(pe_status_name((pe_status)77), "unknown") == 0);
}

/* One sequence, one head, head_dim 4: store two K/V rows, attend with a zero query (equal
 * weights): the output is the mean of the V rows. */
static void test_kernels(void) {
  float k[8] = {1, 0, 0, 0, 0, 1, 0, 0};
  float v[8] = {1, 2, 3, 4, 3, 6, 9, 12};
  float k_cache[2 * 16 * 4], v_cache[2 * 16 * 4], q[8] = {0}, out[8] = {0};
  int32_t slots[2] = {16, 17}, bad_slots[2] = {16, 32};
  int32_t qsl[2] = {0, 2}, lens[1] = {2}, tables[1] = {1};
  float x[2] = {1, 2}, w[6] = {1, 0, 0, 1, 2, 3}, b[3] = {0, 0, 1}, y[3] = {0};
  const char* isa = NULL;
  int i;
  memset(k_cache, 0, sizeof k_cache);
  memset(v_cache, 0, sizeof v_cache);
  CHECK_OK(pe_store_kv(k, v, 4, 4, PE_FLOAT32, k_cache, v_cache, PE_FLOAT32, slots, 2, 1, 4, 16, 2));
  CHECK(k_cache[16 * 4] == 1.0f && v_cache[17 * 4 + 3] == 12.0f);
  CHECK_ERROR(pe_store_kv(k, v, 4, 4, PE_FLOAT32, k_cache, v_cache, PE_FLOAT32, bad_slots, 2, 1, 4, 16, 2),
              PE_ERR_INVALID_ARGUMENT, "slot_mapping");
  CHECK_ERROR(pe_store_kv(k, v, 4, 4, 9, k_cache, v_cache, PE_FLOAT32, slots, 2, 1, 4, 16, 2),
              PE_ERR_INVALID_ARGUMENT, "src_dtype: not a pe_dtype: 9");
  CHECK_OK(pe_paged_attention(out, 4, q, 4, PE_FLOAT32, k_cache, v_cache, PE_FLOAT32, qsl, lens, tables, 1, 2, 1,
                              1, 1, 4, 16, 2, 0.5f, 0, 0.0f, 1));
  for (i = 0; i < 4; ++i) {
    CHECK(out[i] == v[i]);                      /* row 0 sees only itself */
    CHECK(out[4 + i] == (v[i] + v[4 + i]) / 2); /* row 1: the mean of both */
  }
  CHECK_ERROR(pe_paged_attention(NULL, 4, q, 4, PE_FLOAT32, k_cache, v_cache, PE_FLOAT32, qsl, lens, tables, 1, 2,
                                 1, 1, 1, 4, 16, 2, 0.5f, 0, 0.0f, 1),
              PE_ERR_INVALID_ARGUMENT, "out: null pointer");
  CHECK_OK(pe_linear_f32(y, x, w, b, 1, 3, 2, 1));
  CHECK(y[0] == 1.0f && y[1] == 2.0f && y[2] == 9.0f);
  CHECK_ERROR(pe_linear_f32(y, x, w, b, 0, 3, 2, 1), PE_ERR_INVALID_ARGUMENT, "M");
  y[0] = y[1] = y[2] = 0.0f;
  CHECK_OK(pe_gemm_f32(y, x, w, b, 1, 3, 2, 1));
  CHECK(y[0] == 1.0f && y[1] == 2.0f && y[2] == 9.0f);
  CHECK_ERROR(pe_gemm_f32(y, x, w, b, 1, 3, 0, 1), PE_ERR_INVALID_ARGUMENT, "K: must be > 0, got 0");
  CHECK_OK(pe_cpu_isa_name(&isa));
  CHECK(isa != NULL && (strcmp(isa, "generic") == 0 || strcmp(isa, "avx2") == 0 || strcmp(isa, "avx512") == 0 ||
                        strcmp(isa, "neon") == 0));
}

/* Speculative decoding through the C API: caller drafts, one logits row per token, the
 * accepted drafts and the token after them as output entries, the rejected one rewound. */
static void test_speculative_drafts(void) {
  pe_batch_manager_config c = small_config();
  pe_batch_manager* bm = NULL;
  pe_forward_metadata m;
  pe_step_events e;
  pe_request_info info;
  pe_request_params p = pe_request_params_default();
  const int32_t prompt[5] = {10, 11, 12, 13, 14};
  const int32_t drafts[3] = {21, 22, 23};
  const int32_t first = 20, sampled[4] = {21, 22, 99, 50};
  c.num_speculative_tokens = 3;
  CHECK_OK(pe_batch_manager_create(&c, &bm));
  p.prompt = prompt;
  p.prompt_len = 5;
  p.max_new_tokens = 10;
  CHECK_OK(pe_batch_manager_add_request(bm, 1, &p, 0.0));
  CHECK_ERROR(pe_batch_manager_set_draft_tokens(bm, 1, drafts, 3), PE_ERR_NOT_FOUND, "not generating");
  CHECK_OK(pe_batch_manager_schedule(bm, 0.0, &m));
  CHECK_OK(pe_batch_manager_update(bm, &first, 1, 0.0));
  CHECK_OK(pe_batch_manager_set_draft_tokens(bm, 1, drafts, 3));
  CHECK_OK(pe_batch_manager_schedule(bm, 0.0, &m));
  CHECK(m.num_tokens == 4 && m.num_logits == 4 && m.num_draft_tokens == 3);
  {
    const int32_t inputs[4] = {20, 21, 22, 23}, offsets[4] = {0, 1, 2, 3};
    check_ints("input_ids", m.input_ids, inputs, 4);
    check_ints("logits_offsets", m.logits_offsets, offsets, 4);
  }
  CHECK_OK(pe_batch_manager_update(bm, sampled, 4, 0.0));
  CHECK_OK(pe_batch_manager_events(bm, &e));
  CHECK(e.num_outputs == 3);
  {
    const int32_t tokens[3] = {21, 22, 99}, rows[3] = {0, 1, 2};
    check_ints("tokens", e.tokens, tokens, 3);
    check_ints("logits_rows", e.logits_rows, rows, 3);
  }
  CHECK_OK(pe_batch_manager_request_info(bm, 1, &info));
  CHECK(info.num_computed_tokens == 8 && info.num_draft_tokens == 3 && info.num_accepted_draft_tokens == 2);
  CHECK_ERROR(pe_batch_manager_set_max_draft_tokens(bm, 1, 4), PE_ERR_INVALID_ARGUMENT, "num_speculative_tokens=3");
  CHECK_OK(pe_batch_manager_set_max_draft_tokens(bm, 1, 0));
  CHECK_OK(pe_batch_manager_check_invariants(bm));
  pe_batch_manager_free(bm);
}

/* A draft model's drafts: placeholders at the schedule, filled before the update. */
static void test_model_drafts(void) {
  pe_batch_manager_config c = small_config();
  pe_batch_manager* bm = NULL;
  pe_forward_metadata m;
  pe_step_events e;
  pe_request_params p = pe_request_params_default();
  const int32_t prompt[3] = {10, 11, 12};
  const int32_t first = 20, drafts[2] = {21, 22}, sampled[3] = {21, 77, 5};
  c.num_speculative_tokens = 2;
  c.model_drafts = 1;
  CHECK_OK(pe_batch_manager_create(&c, &bm));
  p.prompt = prompt;
  p.prompt_len = 3;
  p.max_new_tokens = 10;
  CHECK_OK(pe_batch_manager_add_request(bm, 1, &p, 0.0));
  CHECK_OK(pe_batch_manager_schedule(bm, 0.0, &m));
  CHECK_OK(pe_batch_manager_update(bm, &first, 1, 0.0));
  CHECK_OK(pe_batch_manager_schedule(bm, 0.0, &m));
  CHECK(m.num_tokens == 3 && m.num_draft_tokens == 2);
  CHECK_ERROR(pe_batch_manager_set_scheduled_draft_tokens(bm, drafts, 1), PE_ERR_INVALID_ARGUMENT,
              "the batch has 2 draft tokens, got 1");
  CHECK_OK(pe_batch_manager_set_scheduled_draft_tokens(bm, drafts, 2));
  {
    const int32_t inputs[3] = {20, 21, 22};
    check_ints("input_ids", m.input_ids, inputs, 3);
  }
  CHECK_OK(pe_batch_manager_update(bm, sampled, 3, 0.0));
  CHECK_OK(pe_batch_manager_events(bm, &e));
  {
    const int32_t tokens[2] = {21, 77};  /* 21 accepted, 22 rejected (77 sampled there) */
    CHECK(e.num_outputs == 2);
    check_ints("tokens", e.tokens, tokens, 2);
  }
  CHECK_OK(pe_batch_manager_check_invariants(bm));
  pe_batch_manager_free(bm);
}

int main(void) {
  test_schedule_update_loop();
  test_speculative_drafts();
  test_model_drafts();
  test_bad_input();
  test_kernels();
  if (failures != 0) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("test_c_api: all checks passed\n");
  return 0;
}
