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
      const int64_t from = p + n, to = std::min<int64_t>(from + k, len);
      return std::vector<TokenId>(tokens.begin() + from, tokens.begin() + to);
    }
  }
  return {};
}

}  // namespace pyengine
