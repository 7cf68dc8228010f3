#include "comm/emulated.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "comm/check.h"
#include "megamoe/error.h"

namespace megamoe {

EmulatedGroup::EmulatedGroup(int32_t num_ranks) : num_ranks_(num_ranks) {
  require(num_ranks >= 1 && num_ranks <= kMaxRanks, "num_ranks", "must be in [1, ", kMaxRanks, "], got ", num_ranks);
  slots_.resize(static_cast<size_t>(num_ranks));
}

void EmulatedGroup::arrive_and_wait(std::unique_lock<std::mutex>& lock, int32_t rank) {
  auto throw_if_aborted = [&] {
    if (aborted_) throw Error(detail::concat("emulated rank ", rank, ": another rank failed, so the group gave up"));
  };
  throw_if_aborted();
  const uint64_t generation = generation_;
  if (++arrived_ == num_ranks_) {
    arrived_ = 0;
    ++generation_;
    changed_.notify_all();
    return;
  }
  changed_.wait(lock, [&] { return generation_ != generation || aborted_; });
  if (generation_ == generation) throw_if_aborted();
}

void EmulatedGroup::barrier(int32_t rank) {
  std::unique_lock lock(mutex_);
  arrive_and_wait(lock, rank);
}

std::vector<std::vector<uint8_t>> EmulatedGroup::all_gather(int32_t rank, const std::vector<uint8_t>& bytes) {
  std::unique_lock lock(mutex_);
  slots_[static_cast<size_t>(rank)] = bytes;
  arrive_and_wait(lock, rank);
  std::vector<std::vector<uint8_t>> gathered = slots_;
  // No rank may overwrite its slot for the next all-gather before every rank has copied this one.
  arrive_and_wait(lock, rank);
  return gathered;
}

void EmulatedGroup::abort() {
  std::lock_guard lock(mutex_);
  aborted_ = true;
  changed_.notify_all();
}

EmulatedCommunicator::EmulatedCommunicator(std::shared_ptr<EmulatedGroup> group, int32_t rank, int32_t device)
    : group_(std::move(group)), rank_(rank), device_(device) {
  int multiprocessors = 0;
  MEGAMOE_CHECK_CUDA(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device));
  sm_budget_ = std::max(1, multiprocessors / group_->size());
  MEGAMOE_CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

EmulatedCommunicator::~EmulatedCommunicator() {
  const cudaError_t status = cudaStreamDestroy(stream_);
  if (status != cudaSuccess) {
    std::fprintf(stderr, "megamoe: emulated rank %d: cudaStreamDestroy failed: %s\n", rank_, cudaGetErrorString(status));
  }
}

}  // namespace megamoe
