// A linear model of how long one step takes, for time-budgeted steps
// (BatchManager::schedule with a budget; docs/step_budget.md):
//
//   ms = fixed_ms + per_seq_ms * sequences + per_token_ms * tokens + per_kpair_ms * pairs / 1000
//
// where `pairs` counts the attention work: each token attends to every position up to its
// own, so a generation row of a sequence holding L tokens adds L pairs, and a context chunk
// of c tokens starting at position s adds c * s + c * (c + 1) / 2. The caller fits the
// coefficients (pyengine fits them at start-up and corrects them from measured steps).
#pragma once

#include <cstdint>

namespace pyengine {

struct StepCostModel {
  double fixed_ms = 0.0;
  double per_seq_ms = 0.0;
  double per_token_ms = 0.0;
  double per_kpair_ms = 0.0;  // per 1,000 attention pairs

  double cost_ms(int64_t seqs, int64_t tokens, int64_t pairs) const {
    return fixed_ms + per_seq_ms * static_cast<double>(seqs) + per_token_ms * static_cast<double>(tokens) +
           per_kpair_ms * static_cast<double>(pairs) * 1e-3;
  }
};

// One step's time budget and the model that predicts a batch's time against it.
struct StepBudget {
  StepCostModel model;
  double budget_ms = 0.0;
};

// Attention pairs of a chunk of `chunk` tokens starting at position `start`.
inline int64_t chunk_attention_pairs(int64_t start, int64_t chunk) {
  return chunk * start + chunk * (chunk + 1) / 2;
}

// A scheduled batch as the model sees it: sequences, tokens, attention pairs.
struct BatchShape {
  int64_t seqs = 0, tokens = 0, pairs = 0;
};

// The shape of a batch from its forward metadata: sequence i computes the tokens
// query_start_loc[i] .. query_start_loc[i + 1] - 1, ending at position seq_lens[i] - 1.
inline BatchShape batch_shape(const int32_t* query_start_loc, const int32_t* seq_lens, int32_t num_seqs) {
  BatchShape b;
  b.seqs = num_seqs;
  for (int32_t i = 0; i < num_seqs; ++i) {
    const int64_t chunk = query_start_loc[i + 1] - query_start_loc[i];
    b.tokens += chunk;
    b.pairs += chunk_attention_pairs(seq_lens[i] - chunk, chunk);
  }
  return b;
}

}  // namespace pyengine
