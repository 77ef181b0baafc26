/* scheduler_only.cpp through the C API (pyengine/c_api.h): the batch manager schedules, this
 * program plays the model (every sampled token is 42) and prints what each step runs. */
#include <stdio.h>
#include <stdlib.h>

#include "pyengine/c_api.h"

static void check(pe_status s, const char* what) {
  if (s != PE_OK) {
    fprintf(stderr, "%s: %s: %s\n", what, pe_status_name(s), pe_last_error_message());
    exit(1);
  }
}

int main(void) {
  pe_batch_manager_config config = pe_batch_manager_config_default();
  pe_batch_manager* bm = NULL;
  int32_t prompt[50];
  int i, step;
  config.max_batch_size = 4;
  config.max_num_tokens = 32; /* small: long prompts are chunked */
  config.max_seq_len = 256;
  config.tokens_per_block = 16;
  config.num_blocks = 64;
  config.enable_block_reuse = 1;
  check(pe_batch_manager_create(&config, &bm), "create");

  for (i = 0; i < 50; ++i) prompt[i] = 7;
  {
    pe_request_params p = pe_request_params_default();
    p.prompt = prompt;
    p.prompt_len = 50;
    p.max_new_tokens = 4;
    check(pe_batch_manager_add_request(bm, 1, &p, 0.0), "add_request 1");
    p.prompt_len = 20;
    p.max_new_tokens = 3;
    check(pe_batch_manager_add_request(bm, 2, &p, 0.0), "add_request 2");
  }

  for (step = 0;; ++step) {
    pe_batch_manager_stats stats;
    pe_forward_metadata m;
    pe_step_events e;
    int32_t sampled[32];
    check(pe_batch_manager_stats_get(bm, &stats), "stats");
    if (!stats.has_unfinished) break;
    check(pe_batch_manager_schedule(bm, step, &m), "schedule");
    printf("step %d: %d sequences, %d tokens (%d generation rows), %d logits rows\n", step, m.num_seqs,
           m.num_tokens, m.num_generation_seqs, m.num_logits);
    /* ... run the model on m.input_ids / m.positions / m.slot_mapping / m.block_tables ... */
    for (i = 0; i < m.num_logits; ++i) sampled[i] = 42;
    check(pe_batch_manager_update(bm, sampled, m.num_logits, step), "update");
    check(pe_batch_manager_events(bm, &e), "events");
    for (i = 0; i < e.num_outputs; ++i)
      printf("  request %lld: token %d%s\n", (long long)e.output_request_ids[i], e.tokens[i],
             e.finished[i] ? " (finished)" : "");
    check(pe_batch_manager_free_finished(bm), "free_finished");
  }
  {
    pe_kv_cache_stats kv;
    check(pe_kv_cache_stats_get(pe_batch_manager_kv_cache(bm), &kv), "kv stats");
    printf("free blocks %d of %d; reused tokens %lld\n", kv.num_free_blocks, kv.num_blocks,
           (long long)kv.total_reused_tokens);
  }
  pe_batch_manager_free(bm);
  return 0;
}
