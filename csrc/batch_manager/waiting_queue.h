// The queue of requests waiting to start (or to be recomputed after a pause).
#pragma once

#include <deque>

#include "batch_manager/request.h"

namespace pyengine {

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
