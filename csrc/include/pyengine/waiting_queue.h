// The queue of requests waiting to start (or to be recomputed after a pause).
#pragma once

#include <deque>

#include "pyengine/request.h"

namespace pyengine {

enum class QueuePolicy : int32_t {
  kFcfs = 0,      // arrival order
  kPriority = 1,  // higher priority first, arrival order among equals
};

class WaitingQueue {
 public:
  explicit WaitingQueue(QueuePolicy policy) : policy_(policy) {}

  // A new request: behind everyone (FCFS) or behind every request of its priority or higher.
  void push(Request* r);
  // A paused request: ahead of everyone (FCFS) or ahead of every request of its priority or lower.
  void push_front(Request* r);
  void erase(Request* r);

  bool empty() const { return queue_.empty(); }
  size_t size() const { return queue_.size(); }
  const std::deque<Request*>& requests() const { return queue_; }
  void restore(std::deque<Request*> queue) { queue_ = std::move(queue); }
  QueuePolicy policy() const { return policy_; }

 private:
  QueuePolicy policy_;
  std::deque<Request*> queue_;
};

}  // namespace pyengine
