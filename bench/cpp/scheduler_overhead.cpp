// W3 — scheduler overhead, from C++: the batch manager alone with 256 requests in
// generation (16-token blocks). Each step schedules, fills the forward metadata, takes one
// token per request and retires the finished; new requests arrive as others finish.
// Prints microseconds per step (median of 5 rounds of 2,000 steps).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "pyengine/batch_manager.h"

using namespace pyengine;

int main() {
  BatchManagerConfig c;
  c.max_batch_size = 256;
  c.max_num_tokens = 8192;
  c.max_seq_len = 1024;
  c.tokens_per_block = 16;
  c.num_blocks = 256 * 64 + 64;
  c.enable_block_reuse = true;
  BatchManager bm(c);
  std::mt19937 rng(0);
  // Arrivals are drawn beforehand, so that the timed loop measures the batch manager.
  std::vector<std::vector<TokenId>> prompts(1024, std::vector<TokenId>(128));
  std::vector<int32_t> max_new(1024);
  for (size_t i = 0; i < prompts.size(); ++i) {
    for (auto& t : prompts[i]) t = static_cast<TokenId>(rng() % 32000);
    max_new[i] = 64 + static_cast<int32_t>(rng() % 193);
  }
  RequestId next = 0;
  auto add = [&] {
    const size_t i = static_cast<size_t>(next) % prompts.size();
    bm.add_request(next++, prompts[i].data(), 128, max_new[i], -1, {}, 0, 0.0);
  };
  for (int i = 0; i < 256; ++i) add();
  std::vector<TokenId> tokens(256, 5);
  auto step = [&] {
    const ForwardMetadata& m = bm.schedule(0.0);
    bm.update(tokens.data(), m.num_logits, 0.0);
    const size_t finished = std::count(bm.events().finished.begin(), bm.events().finished.end(), 1);
    bm.free_finished();
    for (size_t i = 0; i < finished; ++i) add();
    return m.num_generation_seqs;
  };
  for (int i = 0; i < 300; ++i) step();  // all in generation, arrivals flowing
  std::vector<double> rounds;
  int gen = 0;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 2000; ++i) gen = step();
    const auto t1 = std::chrono::steady_clock::now();
    rounds.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / 2000);
  }
  std::sort(rounds.begin(), rounds.end());
  std::printf("W3 C++: %.2f us per step (median of 5 x 2000 steps; %d generation rows in the last step)\n",
              rounds[2], gen);
  return 0;
}
