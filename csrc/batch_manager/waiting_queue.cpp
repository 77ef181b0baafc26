#include "batch_manager/waiting_queue.h"

#include <algorithm>

namespace pyengine {

void WaitingQueue::push(Request* r) {
  if (policy_ == QueuePolicy::kFcfs) {
    queue_.push_back(r);
    return;
  }
  auto it = std::find_if(queue_.begin(), queue_.end(), [&](const Request* q) { return q->priority < r->priority; });
  queue_.insert(it, r);
}

void WaitingQueue::push_front(Request* r) {
  if (policy_ == QueuePolicy::kFcfs) {
    queue_.push_front(r);
    return;
  }
  auto it = std::find_if(queue_.begin(), queue_.end(), [&](const Request* q) { return q->priority <= r->priority; });
  queue_.insert(it, r);
}

void WaitingQueue::erase(Request* r) { queue_.erase(std::remove(queue_.begin(), queue_.end(), r), queue_.end()); }

}  // namespace pyengine
