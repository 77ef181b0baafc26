#include "batch_manager/draft_length.h"

#include <algorithm>

namespace pyengine {

double draft_token_cost(double row_cost, double propose_cost, int32_t generating) {
  const double b = std::max<int32_t>(generating, 1);
  return row_cost * b / (1.0 + (b - 1.0) * row_cost) + propose_cost;
}

int32_t best_draft_count(double acceptance, double cost, int32_t limit) {
  int32_t best = 0;
  double best_rate = 1.0;  // k = 0: one token for one unit
  double expected = 1.0, term = 1.0;
  for (int32_t k = 1; k <= limit; ++k) {
    term *= acceptance;
    expected += term;
    const double rate = expected / (1.0 + k * cost);
    if (rate > best_rate * (1.0 + 1e-9)) {
      best = k;
      best_rate = rate;
    }
  }
  return best;
}

}  // namespace pyengine
