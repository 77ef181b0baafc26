#include "batch_manager/seq_slot_manager.h"
#include "test_harness.h"

using namespace pyengine;

TEST(slots_are_given_once_and_returned) {
  SeqSlotManager slots(2);
  CHECK_EQ(slots.acquire(10), 0);
  CHECK_EQ(slots.acquire(11), 1);
  CHECK_EQ(slots.num_free(), 0);
  CHECK_THROWS(slots.acquire(12), NoFreeSeqSlotError, "no free sequence slot for request 12");
  CHECK_THROWS(slots.acquire(10), std::logic_error, "request 10 already holds slot 0");
  CHECK_THROWS(slots.check_all_free(), std::logic_error, "2 sequence slot(s) still held");
  slots.release(10);
  CHECK_EQ(slots.slot_of(10), -1);
  CHECK_EQ(slots.acquire(12), 0);
  CHECK_THROWS(slots.release(10), std::logic_error, "request 10 holds no sequence slot");
  slots.release(11);
  slots.release(12);
  CHECK_EQ(slots.num_free(), 2);
  slots.check_all_free();
}

TEST(slot_pool_must_be_positive) {
  CHECK_THROWS(SeqSlotManager(0), std::invalid_argument, "num_slots must be positive, got 0");
}

TEST_MAIN()
