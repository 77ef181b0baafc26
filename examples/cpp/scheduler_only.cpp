// The C++ core on its own: a C++ service can schedule with pyengine's batch manager and
// run its own model. This example plays the model (every sampled token is 42) and prints
// what each step runs.
//
//   cmake -S . -B build/examples -DPYENGINE_BUILD_EXAMPLES=ON && cmake --build build/examples
//   build/examples/scheduler_only
#include <cstdio>
#include <vector>

#include "pyengine/batch_manager.h"

int main() {
  pyengine::BatchManagerConfig config;
  config.max_batch_size = 4;
  config.max_num_tokens = 32;  // small: long prompts are chunked
  config.max_seq_len = 256;
  config.tokens_per_block = 16;
  config.num_blocks = 64;
  config.enable_block_reuse = true;
  pyengine::BatchManager bm(config);

  std::vector<pyengine::TokenId> prompt(50, 7);
  bm.add_request(/*id=*/1, prompt.data(), 50, /*max_new_tokens=*/4, /*end_id=*/-1, {}, 0, 0.0);
  bm.add_request(/*id=*/2, prompt.data(), 20, /*max_new_tokens=*/3, /*end_id=*/-1, {}, 0, 0.0);

  for (int step = 0; bm.has_unfinished(); ++step) {
    const pyengine::ForwardMetadata& m = bm.schedule(step);
    std::printf("step %d: %d sequences, %d tokens (%d generation rows), %d logits rows\n", step, m.num_seqs,
                m.num_tokens, m.num_generation_seqs, m.num_logits);
    // ... run the model on m.input_ids / m.positions / m.slot_mapping / m.block_tables ...
    std::vector<pyengine::TokenId> sampled(m.num_logits, 42);
    bm.update(sampled.data(), m.num_logits, step);
    const pyengine::StepEvents& e = bm.events();
    for (size_t i = 0; i < e.output_request_ids.size(); ++i)
      std::printf("  request %lld: token %d%s\n", static_cast<long long>(e.output_request_ids[i]), e.tokens[i],
                  e.finished[i] ? " (finished)" : "");
    bm.free_finished();
  }
  std::printf("free blocks %d of %d; reused tokens %lld\n", bm.num_free_blocks(), bm.num_blocks(),
              static_cast<long long>(bm.total_reused_tokens()));
  return 0;
}
