// BatchManager::schedule() gives the strong guarantee: a fault at any point of it (injected
// with inject_fault) leaves the manager as a rollback() of that schedule would -- or, before
// the pauses, as it was -- and the run continues to the same outputs.
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "pyengine/batch_manager.h"
#include "test_harness.h"

using namespace pyengine;

namespace {

const std::vector<std::string> kLatePoints{"schedule.paused", "schedule.admitted", "schedule.prepared",
                                           "schedule.filled"};
const std::vector<std::string> kEarlyPoints{"schedule.aborted", "schedule.capacity"};
constexpr RequestId kAborted = 4;  // aborted before the 3rd step; its outputs are not compared
constexpr int kAbortStep = 3;

BatchManagerConfig config(bool reuse) {
  BatchManagerConfig c;
  c.max_batch_size = 3;
  c.max_num_tokens = 12;
  c.max_seq_len = 40;
  c.tokens_per_block = 4;
  c.num_blocks = 9;  // tight: max_utilization pauses requests
  c.policy = CapacitySchedulerPolicy::kMaxUtilization;
  c.vocab_size = 100;
  c.enable_block_reuse = reuse;
  return c;
}

// A manager driven through the same requests; tokens depend only on (request, its progress),
// so a recomputed request produces what it would have.
struct Run {
  BatchManager bm;
  std::map<RequestId, std::vector<TokenId>> outputs;
  int steps = 0;

  explicit Run(bool reuse) : bm(config(reuse)) {
    for (RequestId id = 1; id <= 5; ++id) {
      std::vector<TokenId> prompt;
      for (int i = 0; i < 3 + 3 * static_cast<int>(id); ++i) prompt.push_back(static_cast<TokenId>((id * 11 + i) % 50 + 1));
      bm.add_request(id, prompt.data(), static_cast<int32_t>(prompt.size()), 6 + static_cast<int32_t>(id), -1, {},
                     0, 0.0);
    }
  }

  void schedule_and_finish() {
    const ForwardMetadata& m = bm.schedule(steps + 1.0);
    std::vector<TokenId> tokens;
    for (int32_t i = 0; i < m.num_logits; ++i) {
      const RequestId id = m.logits_request_ids[i];
      tokens.push_back(static_cast<TokenId>((id * 13 + bm.request_info(id).num_generated * 7) % 90 + 5));
    }
    bm.update(tokens.data(), static_cast<int32_t>(tokens.size()), steps + 1.5);
    const StepEvents& e = bm.events();
    for (size_t i = 0; i < e.output_request_ids.size(); ++i) outputs[e.output_request_ids[i]].push_back(e.tokens[i]);
    bm.free_finished();
    bm.check_invariants();
    ++steps;
  }

  // Before each step: the abort the scenario makes.
  void before_step() {
    if (steps == kAbortStep && bm.contains(kAborted)) bm.abort_request(kAborted);
  }

  void finish() {
    while (bm.has_unfinished()) {
      before_step();
      schedule_and_finish();
      CHECK(steps < 200);
      if (steps >= 200) return;
    }
  }

  std::string state() const {
    std::ostringstream os;
    os << "free_blocks=" << bm.num_free_blocks() << " free_slots=" << bm.num_free_seq_slots() << " waiting=";
    for (RequestId id : bm.waiting_ids()) os << id << ",";
    os << " active=";
    for (RequestId id : bm.active_ids()) os << id << ",";
    for (RequestId id = 1; id <= 5; ++id) {
      if (!bm.contains(id)) continue;
      const RequestInfo r = bm.request_info(id);
      os << " | " << id << ": state=" << static_cast<int>(r.state) << " slot=" << r.seq_slot << " ctx=" << r.context_len
         << " computed=" << r.num_computed_tokens << " blocks=" << r.num_blocks << " pauses=" << r.num_pauses
         << " gen=" << r.num_generated << " first_sched=" << r.first_scheduled_time;
      if (r.num_blocks > 0)
        for (BlockId b : bm.block_table(id)) os << " b" << b;
    }
    return os.str();
  }
};

Run advanced(bool reuse, int k) {
  Run r(reuse);
  while (r.steps < k && r.bm.has_unfinished()) {
    r.before_step();
    r.schedule_and_finish();
  }
  return r;
}

void compare_outputs(const Run& got, const Run& want, const std::string& where) {
  for (const auto& [id, tokens] : want.outputs) {
    if (id == kAborted) continue;
    auto it = got.outputs.find(id);
    CHECK_EQ(it == got.outputs.end() ? std::vector<TokenId>{} : it->second, tokens);
    if (it == got.outputs.end() || it->second != tokens) std::cerr << "  at " << where << ", request " << id << "\n";
  }
}

void fault_at_every_step(bool reuse) {
  Run reference(reuse);
  reference.finish();
  int paused_steps = 0;
  for (int k = 0; k < reference.steps; ++k) {
    for (const std::string& point : kLatePoints) {
      Run faulty = advanced(reuse, k), twin = advanced(reuse, k);
      if (!faulty.bm.has_unfinished()) break;
      faulty.before_step();
      twin.before_step();
      twin.bm.schedule(k + 1.0);  // what the fault must leave: this schedule, rolled back
      const bool twin_paused = !twin.bm.events().paused.empty();
      CHECK(twin.bm.rollback());
      faulty.bm.inject_fault(point);
      CHECK_THROWS(faulty.bm.schedule(k + 1.0), std::runtime_error, "injected fault at " + point);
      CHECK_EQ(faulty.state(), twin.state());
      CHECK(faulty.bm.events().assigned.empty());
      CHECK_EQ(faulty.bm.events().paused, twin.bm.events().paused);
      CHECK(!faulty.bm.rollback());  // nothing left open for a caller's rollback to undo twice
      faulty.bm.check_invariants();
      paused_steps += twin_paused ? 1 : 0;
      faulty.finish();
      compare_outputs(faulty, reference, point + " at step " + std::to_string(k));
    }
    for (const std::string& point : kEarlyPoints) {
      Run faulty = advanced(reuse, k);
      if (!faulty.bm.has_unfinished()) break;
      faulty.before_step();
      const bool abort_pending = faulty.steps == kAbortStep && faulty.bm.contains(kAborted);
      const std::string before = faulty.state();
      faulty.bm.inject_fault(point);
      CHECK_THROWS(faulty.bm.schedule(k + 1.0), std::runtime_error, "injected fault at " + point);
      if (abort_pending) {  // the abort is committed: the request is gone, reported once
        CHECK(!faulty.bm.contains(kAborted));
        CHECK_EQ(faulty.bm.events().aborted, std::vector<RequestId>{kAborted});
      } else {
        CHECK_EQ(faulty.state(), before);
      }
      faulty.bm.check_invariants();
      faulty.finish();
      compare_outputs(faulty, reference, point + " at step " + std::to_string(k));
    }
  }
  CHECK(paused_steps > 0);  // the scenario does reach schedules that pause a request
}

}  // namespace

TEST(a_fault_anywhere_in_schedule_is_undone) { fault_at_every_step(false); }

TEST(a_fault_anywhere_in_schedule_is_undone_with_prefix_reuse) { fault_at_every_step(true); }

TEST(inject_fault_rejects_an_unknown_point) {
  BatchManager bm(config(false));
  CHECK_THROWS(bm.inject_fault("schedule.nowhere"), std::invalid_argument, "unknown point 'schedule.nowhere'");
  bm.inject_fault("schedule.filled");
  bm.inject_fault("");  // disarmed: schedule runs
  bm.schedule(0.0);
}

TEST_MAIN()
