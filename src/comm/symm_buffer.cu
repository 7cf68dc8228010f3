// The symmetric buffer: agreement on the problem, the memory (an NCCL symmetric window, or one
// allocation per emulated rank), every peer's address of it, zeroing, and the device error record.
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <nccl_device.h>

#include <cstddef>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "comm/agreement.h"
#include "comm/check.h"
#include "megamoe/comm.h"
#include "megamoe/error.h"

namespace megamoe {

namespace {

__global__ void read_lsa_pointers(ncclWindow_t window, int32_t num_ranks, char** table) {
  const int32_t peer = static_cast<int32_t>(threadIdx.x);
  if (peer < num_ranks) table[peer] = static_cast<char*>(ncclGetLsaPointer(window, 0, peer));
}

template <typename T>
std::vector<uint8_t> to_bytes(const T& value) {
  std::vector<uint8_t> bytes(sizeof(T));
  std::memcpy(bytes.data(), &value, sizeof(T));
  return bytes;
}

template <typename T>
T from_bytes(const std::vector<uint8_t>& bytes) {
  require(bytes.size() == sizeof(T), "SymmBuffer", "a rank sent ", bytes.size(), " bytes where ", sizeof(T),
          " were expected (mismatched library builds?)");
  T value;
  std::memcpy(&value, bytes.data(), sizeof(T));
  return value;
}

// Every rank says whether its local step worked, and all throw together if any did not, so that no
// rank is left waiting in a collective call for one that gave up. The failing rank's own message
// says why; the others name it.
void agree(Communicator& comm, const char* step, const std::string& local_error) {
  const uint8_t ok = local_error.empty() ? 1 : 0;
  const std::vector<std::vector<uint8_t>> gathered = comm.all_gather({ok});
  std::string failed;
  for (size_t rank = 0; rank < gathered.size(); ++rank) {
    if (gathered[rank].at(0) == 1) continue;
    failed += (failed.empty() ? "" : ", ") + std::to_string(rank);
  }
  if (failed.empty()) return;
  throw Error(detail::concat("SymmBuffer: ", step, " failed on rank ", failed,
                             local_error.empty() ? "" : ": " + local_error));
}

void report_release_failure(int32_t rank, const char* what) {
  std::fprintf(stderr, "megamoe: rank %d: releasing the symmetric buffer: %s\n", rank, what);
}

}  // namespace

struct SymmBuffer::Impl {
  int32_t rank = 0;
  bool nccl = false;
  cudaStream_t stream = nullptr;
  void* allocation = nullptr;  // ncclMemAlloc's (NCCL) or cudaMallocAsync's on `stream` (emulated)
  ncclWindow_t window = nullptr;
  bool leak = false;

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  // Frees the memory unless a window still registers it: deregistering is collective and peers may
  // still have it mapped, so a buffer abandoned mid-way (by an exception) is left to process exit.
  ~Impl() {
    if (leak || window != nullptr || allocation == nullptr) return;
    if (nccl) {
      const ncclResult_t status = ncclMemFree(allocation);
      if (status != ncclSuccess) report_release_failure(rank, ncclGetErrorString(status));
    } else {
      const cudaError_t status = cudaFreeAsync(allocation, stream);
      if (status != cudaSuccess) report_release_failure(rank, cudaGetErrorString(status));
    }
  }

  void create_nccl(Communicator& comm, uint64_t bytes, SymmView& view) {
    ncclComm_t handle = comm.nccl();
    const ncclTeam_t lsa = ncclTeamLsa(handle);
    require(lsa.nRanks == comm.size() && lsa.rank == comm.rank(), "SymmBuffer",
            "every rank must reach every other rank's memory by loads and stores (one NVLink domain), but NCCL's "
            "load/store team holds ",
            lsa.nRanks, " of the ", comm.size(), " ranks");
    std::string error;
    try {
      MEGAMOE_CHECK_NCCL(ncclMemAlloc(&allocation, bytes), nullptr);
    } catch (const Error& e) {
      error = e.what();
    }
    agree(comm, "allocating the symmetric buffer", error);
    MEGAMOE_CHECK_NCCL(ncclCommWindowRegister(handle, allocation, bytes, &window, NCCL_WIN_COLL_SYMMETRIC), handle);
    require(window != nullptr, "SymmBuffer",
            "NCCL registered no symmetric window: this communicator lacks symmetric-memory support (it needs CUDA "
            "virtual memory management, NCCL_CUMEM_ENABLE=1, and peer access between all GPUs)");

    char** table = nullptr;
    MEGAMOE_CHECK_CUDA(cudaMalloc(&table, sizeof(char*) * kMaxRanks));
    read_lsa_pointers<<<1, kMaxRanks, 0, comm.stream()>>>(window, comm.size(), table);
    cudaError_t status = cudaGetLastError();
    if (status == cudaSuccess) {
      status = cudaMemcpyAsync(view.peers, table, sizeof(char*) * static_cast<size_t>(comm.size()),
                               cudaMemcpyDeviceToHost, comm.stream());
    }
    if (status == cudaSuccess) status = cudaStreamSynchronize(comm.stream());
    cudaFree(table);
    MEGAMOE_CHECK_CUDA(status);
  }

  // Stream-ordered allocation: cudaMalloc and cudaFree may wait for the whole device, and so for
  // another emulated rank's kernel that spins until this rank launches its next one.
  void create_emulated(Communicator& comm, uint64_t bytes, SymmView& view) {
    std::string error;
    try {
      MEGAMOE_CHECK_CUDA(cudaMallocAsync(&allocation, bytes, stream));
    } catch (const Error& e) {
      error = e.what();
    }
    agree(comm, "allocating the symmetric buffer", error);
    const std::vector<std::vector<uint8_t>> bases = comm.all_gather(to_bytes(allocation));
    for (size_t peer = 0; peer < bases.size(); ++peer) view.peers[peer] = from_bytes<char*>(bases[peer]);
  }
};

SymmBuffer::SymmBuffer(Communicator& comm, const Problem& problem)
    : comm_(comm), problem_(problem), impl_(std::make_unique<Impl>()) {
  impl_->rank = comm.rank();
  impl_->nccl = !comm.emulated();
  impl_->stream = comm.stream();

  // Each rank checks what it can alone; then all ranks compare problems, before any allocation, so
  // that disagreeing ranks fail here with the reason instead of hanging later.
  std::string local_error;
  try {
    validate(problem);
    view_.timeout_ns = default_timeout_ns();
  } catch (const Error& e) {
    local_error = e.what();
  }
  agree(comm, "checking the problem", local_error);
  const ProblemRecord mine = make_record(problem, comm.rank(), comm.size());
  std::vector<ProblemRecord> records;
  for (const std::vector<uint8_t>& bytes : comm.all_gather(to_bytes(mine))) {
    records.push_back(from_bytes<ProblemRecord>(bytes));
  }
  const std::string mismatch = disagreement(records);
  if (!mismatch.empty()) throw Error("SymmBuffer: " + mismatch);

  // The buffer keeps the wave it was sized for (a default wave chosen once, not per call).
  problem_.wave_tokens = tokens_per_wave(problem);
  layout_ = BufferLayout::make(problem_);
  view_.rank = comm.rank();
  view_.num_ranks = comm.size();
  view_.one_device = comm.emulated() || comm.size() == 1;
  if (impl_->nccl) {
    impl_->create_nccl(comm, layout_.total_bytes, view_);
  } else {
    impl_->create_emulated(comm, layout_.total_bytes, view_);
  }
  for (int32_t peer = 0; peer < view_.num_ranks; ++peer) {
    require(view_.peers[peer] != nullptr, "SymmBuffer", "no address for rank ", peer, "'s buffer");
  }

  // No rank may write into a peer's buffer before that peer has zeroed it.
  MEGAMOE_CHECK_CUDA(cudaMemsetAsync(view_.local(), 0, layout_.total_bytes, comm.stream()));
  MEGAMOE_CHECK_CUDA(cudaStreamSynchronize(comm.stream()));
  comm.barrier();
}

SymmBuffer::~SymmBuffer() {
  if (std::uncaught_exceptions() > 0) {
    // Leaving by an exception: peers may never reach a collective call, and may still address this
    // buffer, so neither synchronize nor free.
    impl_->leak = true;
    return;
  }
  try {
    // No peer may still be using this rank's buffer, nor this rank a peer's. Calls may run on any of
    // the caller's streams, and ncclMemFree unmaps the memory without waiting for them: a NCCL rank
    // waits for its whole device. An emulated rank waits for its own stream only (another rank's
    // kernels on the same device may still wait for this one's), and frees in stream order.
    if (impl_->nccl) {
      MEGAMOE_CHECK_CUDA(cudaDeviceSynchronize());
    } else {
      MEGAMOE_CHECK_CUDA(cudaStreamSynchronize(comm_.stream()));
    }
    comm_.barrier();
    if (impl_->window != nullptr) {
      MEGAMOE_CHECK_NCCL(ncclCommWindowDeregister(comm_.nccl(), impl_->window), comm_.nccl());
      impl_->window = nullptr;
    }
  } catch (const std::exception& e) {
    // Some rank may still address this buffer: keep it rather than free memory in use.
    impl_->leak = true;
    report_release_failure(comm_.rank(), e.what());
  }
}

void SymmBuffer::check_device_error(cudaStream_t stream) {
  MEGAMOE_CHECK_CUDA(cudaStreamSynchronize(stream));
  ControlBlock* control = layout_.control_block(view_.local());
  static_assert(offsetof(ControlBlock, input_error) == offsetof(ControlBlock, error) + sizeof(DeviceError),
                "the two records are read in one copy");
  DeviceError records[2]{};  // the call-breaking error, the input error
  MEGAMOE_CHECK_CUDA(cudaMemcpyAsync(records, &control->error, sizeof(records), cudaMemcpyDeviceToHost, stream));
  MEGAMOE_CHECK_CUDA(cudaStreamSynchronize(stream));
  const DeviceError& broke = records[0];
  const DeviceError& input = records[1];
  if (broke.code == kDeviceOk && input.code == kDeviceOk) return;
  // Clear the records, and the counts that blocks which gave up may have left: the grid barrier's
  // arrivals, finished blocks, the dispatch's per-expert send counts (after ControlBlock), and the
  // GEMM's split-K arrivals (the whole split workspace, which holds nothing else worth keeping).
  MEGAMOE_CHECK_CUDA(cudaMemsetAsync(&control->error, 0, sizeof(records), stream));
  MEGAMOE_CHECK_CUDA(cudaMemsetAsync(&control->grid_barrier_count, 0, sizeof(control->grid_barrier_count), stream));
  MEGAMOE_CHECK_CUDA(cudaMemsetAsync(&control->finished_blocks, 0, sizeof(control->finished_blocks), stream));
  MEGAMOE_CHECK_CUDA(
      cudaMemsetAsync(&control->capacity_exceeded_by, 0, sizeof(control->capacity_exceeded_by), stream));
  MEGAMOE_CHECK_CUDA(cudaMemsetAsync(layout_.send_count(view_.local()), 0,
                                     layout_.control.bytes - sizeof(ControlBlock), stream));
  MEGAMOE_CHECK_CUDA(cudaMemsetAsync(view_.local() + layout_.gemm_split.offset, 0, layout_.gemm_split.bytes, stream));
  // After an error that broke the call, a front ring's words no longer agree with its peers': back to
  // its initial state, which is all there is to it with one rank (with several, a new buffer:
  // docs/streaming.md, "Failures and reset"). After an input error alone every rank's call ran to its
  // end, so the ring is in step with its peers' and stays as it is.
  if (broke.code != kDeviceOk) {
    MEGAMOE_CHECK_CUDA(
        cudaMemsetAsync(view_.local() + layout_.front_ring.offset, 0, layout_.front_ring.bytes, stream));
    front_calls_ = {};
  }
  MEGAMOE_CHECK_CUDA(cudaStreamSynchronize(stream));
  if (broke.code == kDeviceOk) throw DeviceFailure(describe(input));
  if (input.code == kDeviceOk) throw DeviceFailure(describe(broke));
  throw DeviceFailure(describe(broke) + "; before it, an input error: " + describe(input));
}

}  // namespace megamoe
