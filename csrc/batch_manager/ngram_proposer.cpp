#include "batch_manager/ngram_proposer.h"

#include <algorithm>

namespace pyengine {

std::vector<TokenId> propose_ngram(const std::vector<TokenId>& tokens, int32_t n_min, int32_t n_max, int32_t k) {
  const int64_t len = static_cast<int64_t>(tokens.size());
  if (k <= 0) return {};
  for (int64_t n = std::min<int64_t>(n_max, len - 1); n >= std::max(n_min, 1); --n) {
    const TokenId* suffix = tokens.data() + (len - n);
    // an occurrence at [p, p + n) with p + n < len, so that at least one token follows it
    for (int64_t p = len - n - 1; p >= 0; --p) {
      if (!std::equal(suffix, suffix + n, tokens.data() + p)) continue;
      // The tokens that followed it; where they run past the end, the match says the text
      // repeats with period len - from, so the drafts continue that period (a recent match
      // inside a repetition would otherwise propose a single token).
      const int64_t from = p + n, period = len - from;
      std::vector<TokenId> drafts(static_cast<size_t>(k));
      for (int64_t i = 0; i < k; ++i)
        drafts[static_cast<size_t>(i)] = from + i < len ? tokens[static_cast<size_t>(from + i)]
                                                        : drafts[static_cast<size_t>(i - period)];
      return drafts;
    }
  }
  return {};
}

}  // namespace pyengine
