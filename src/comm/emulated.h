// Emulated ranks: R communicators in one process, one host thread each, all on one GPU.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "megamoe/comm.h"

namespace megamoe {

// The host side every emulated rank of one group shares: a barrier and an all-gather through shared
// memory. Once any rank has failed (abort()), every waiting and every later call throws instead of
// waiting for a rank that will never come.
class EmulatedGroup {
 public:
  explicit EmulatedGroup(int32_t num_ranks);

  int32_t size() const { return num_ranks_; }
  void barrier(int32_t rank);
  std::vector<std::vector<uint8_t>> all_gather(int32_t rank, const std::vector<uint8_t>& bytes);
  void abort();

 private:
  // Waits, with `lock` held, until every rank has arrived; throws once the group is aborted.
  void arrive_and_wait(std::unique_lock<std::mutex>& lock, int32_t rank);

  const int32_t num_ranks_;
  std::mutex mutex_;
  std::condition_variable changed_;
  int32_t arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  std::vector<std::vector<uint8_t>> slots_;
};

// One emulated rank. The caller's thread must have made `device` current.
class EmulatedCommunicator final : public Communicator {
 public:
  EmulatedCommunicator(std::shared_ptr<EmulatedGroup> group, int32_t rank, int32_t device);
  ~EmulatedCommunicator() override;
  EmulatedCommunicator(const EmulatedCommunicator&) = delete;
  EmulatedCommunicator& operator=(const EmulatedCommunicator&) = delete;

  int32_t rank() const override { return rank_; }
  int32_t size() const override { return group_->size(); }
  int32_t device() const override { return device_; }
  bool emulated() const override { return true; }
  int32_t sm_budget() const override { return sm_budget_; }
  cudaStream_t stream() const override { return stream_; }
  std::vector<std::vector<uint8_t>> all_gather(const std::vector<uint8_t>& bytes) override {
    return group_->all_gather(rank_, bytes);
  }
  void barrier() override { group_->barrier(rank_); }
  ncclComm_t nccl() const override { return nullptr; }

 private:
  std::shared_ptr<EmulatedGroup> group_;
  int32_t rank_;
  int32_t device_;
  int32_t sm_budget_ = 0;
  cudaStream_t stream_ = nullptr;
};

}  // namespace megamoe
