// Adaptive draft length for speculative decoding: how many drafts a request's next step
// should carry, from how often its drafts were accepted so far and what a draft costs.
#pragma once

#include <cstdint>

namespace pyengine {

// The cost of one draft token relative to a generating request's share of a plain decode
// step with `generating` requests: rho * B / (1 + (B - 1) * rho) + delta, where rho
// (row_cost) is one more query row relative to a one-row decode step, whose weights are read
// anyway, and delta (propose_cost) is proposing it (a draft model's forward) in the same
// unit. A plain step of B rows costs 1 + (B - 1) * rho such units, a request's share of it
// 1/B of that: the larger the batch, the dearer a draft row.
double draft_token_cost(double row_cost, double propose_cost, int32_t generating);

// The k in [0, limit] that maximizes the tokens a step yields per unit of its cost,
// (1 + a + ... + a^k) / (1 + k * cost), when each draft is accepted with probability
// `acceptance` given the ones before it were; ties go to the smaller k.
int32_t best_draft_count(double acceptance, double cost, int32_t limit);

// A request's acceptance rate, estimated from its verifications: decayed counts of accepted
// drafts and of rejections (a verification that rejected one), starting from a prior of
// 0.6 weighing two verifications, so that a new request drafts and the estimate follows the
// text as it changes.
struct DraftAcceptance {
  static constexpr double kDecay = 0.875;
  double accepted = 1.2;
  double rejected = 0.8;
  void observe(int32_t num_accepted, int32_t num_drafts) {
    accepted = accepted * kDecay + num_accepted;
    rejected = rejected * kDecay + (num_accepted < num_drafts ? 1.0 : 0.0);
  }
  double rate() const { return accepted / (accepted + rejected); }
};

}  // namespace pyengine
