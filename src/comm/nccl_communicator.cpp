// A rank backed by a caller's NCCL communicator (one process per GPU). Host collectives run as tiny
// NCCL collectives on this rank's stream and wait for it.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdio>

#include "comm/check.h"
#include "megamoe/comm.h"
#include "megamoe/error.h"

namespace megamoe {

namespace {

// A device allocation freed when it goes out of scope.
struct DeviceBytes {
  void* ptr = nullptr;
  explicit DeviceBytes(size_t bytes) { MEGAMOE_CHECK_CUDA(cudaMalloc(&ptr, bytes)); }
  ~DeviceBytes() { cudaFree(ptr); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
};

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(ncclComm_t comm) : comm_(comm) {
    require(comm != nullptr, "Communicator::from_nccl", "the NCCL communicator is null");
    comm_detail::check_nccl_runtime_version();
    MEGAMOE_CHECK_NCCL(ncclCommUserRank(comm, &rank_), comm);
    MEGAMOE_CHECK_NCCL(ncclCommCount(comm, &size_), comm);
    MEGAMOE_CHECK_NCCL(ncclCommCuDevice(comm, &device_), comm);
    require(size_ <= kMaxRanks, "Communicator::from_nccl", "at most ", kMaxRanks, " ranks are supported, got ", size_);
    int current = -1;
    MEGAMOE_CHECK_CUDA(cudaGetDevice(&current));
    require(current == device_, "Communicator::from_nccl", "the current CUDA device is ", current,
            " but the NCCL communicator's is ", device_, "; call cudaSetDevice first");
    MEGAMOE_CHECK_CUDA(cudaDeviceGetAttribute(&sm_budget_, cudaDevAttrMultiProcessorCount, device_));
    MEGAMOE_CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    const cudaError_t status = cudaMalloc(&barrier_word_, sizeof(int32_t));
    if (status != cudaSuccess) {
      cudaStreamDestroy(stream_);
      MEGAMOE_CHECK_CUDA(status);
    }
  }

  ~NcclCommunicator() override {
    const cudaError_t freed = cudaFree(barrier_word_);
    const cudaError_t destroyed = cudaStreamDestroy(stream_);
    if (freed != cudaSuccess || destroyed != cudaSuccess) {
      std::fprintf(stderr, "megamoe: rank %d: releasing the communicator's stream and scratch failed: %s\n", rank_,
                   cudaGetErrorString(freed != cudaSuccess ? freed : destroyed));
    }
  }

  int32_t rank() const override { return rank_; }
  int32_t size() const override { return size_; }
  int32_t device() const override { return device_; }
  bool emulated() const override { return false; }
  int32_t sm_budget() const override { return sm_budget_; }
  cudaStream_t stream() const override { return stream_; }
  ncclComm_t nccl() const override { return comm_; }

  std::vector<std::vector<uint8_t>> all_gather(const std::vector<uint8_t>& bytes) override {
    const size_t count = bytes.size();
    std::vector<std::vector<uint8_t>> gathered(static_cast<size_t>(size_));
    if (count == 0) return gathered;
    DeviceBytes send(count);
    DeviceBytes receive(count * static_cast<size_t>(size_));
    MEGAMOE_CHECK_CUDA(cudaMemcpyAsync(send.ptr, bytes.data(), count, cudaMemcpyHostToDevice, stream_));
    MEGAMOE_CHECK_NCCL(ncclAllGather(send.ptr, receive.ptr, count, ncclUint8, comm_, stream_), comm_);
    std::vector<uint8_t> flat(count * static_cast<size_t>(size_));
    MEGAMOE_CHECK_CUDA(cudaMemcpyAsync(flat.data(), receive.ptr, flat.size(), cudaMemcpyDeviceToHost, stream_));
    MEGAMOE_CHECK_CUDA(cudaStreamSynchronize(stream_));
    for (size_t r = 0; r < gathered.size(); ++r) {
      gathered[r].assign(flat.begin() + static_cast<ptrdiff_t>(r * count),
                         flat.begin() + static_cast<ptrdiff_t>((r + 1) * count));
    }
    return gathered;
  }

  // An all-reduce cannot finish before every rank has contributed, so waiting for it is a barrier.
  void barrier() override {
    MEGAMOE_CHECK_NCCL(ncclAllReduce(barrier_word_, barrier_word_, 1, ncclInt32, ncclSum, comm_, stream_), comm_);
    MEGAMOE_CHECK_CUDA(cudaStreamSynchronize(stream_));
  }

 private:
  ncclComm_t comm_;
  int32_t rank_ = 0;
  int32_t size_ = 0;
  int32_t device_ = 0;
  int32_t sm_budget_ = 0;
  cudaStream_t stream_ = nullptr;
  void* barrier_word_ = nullptr;
};

}  // namespace

std::unique_ptr<Communicator> Communicator::from_nccl(ncclComm_t comm) {
  return std::make_unique<NcclCommunicator>(comm);
}

}  // namespace megamoe
