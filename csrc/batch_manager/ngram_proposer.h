// Prompt lookup (n-gram) drafts for speculative decoding: the tokens that followed the most
// recent earlier occurrence of the sequence's last n tokens.
#pragma once

#include <vector>

#include "pyengine/types.h"

namespace pyengine {

// Tries n = n_max down to n_min: the last n tokens of `tokens` are looked up among the
// earlier positions, the most recent occurrence first; the first match proposes the `k`
// tokens that followed it, continued periodically where they reach the end (a match P
// tokens back means the text repeats with period P). Returns no tokens when nothing
// matches, when k <= 0 or when `tokens` is shorter than n_min + 1.
std::vector<TokenId> propose_ngram(const std::vector<TokenId>& tokens, int32_t n_min, int32_t n_max, int32_t k);

}  // namespace pyengine
