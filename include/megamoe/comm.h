// Ranks and symmetric memory.
//
// A Communicator is one rank's handle on the group. Two kinds share everything kernels see:
//   - NCCL: one process per GPU; the symmetric buffer comes from ncclMemAlloc and is registered with
//     ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC); peers' addresses come from ncclGetLsaPointer.
//   - emulated: R ranks in one process on one GPU (one host thread per rank); each rank's buffer is a
//     separate allocation and each rank's kernels are confined to its share of the multiprocessors,
//     so one rank's spin-wait cannot starve another's work.
// Kernels only ever see a SymmView (a table of every rank's buffer base), so they run unchanged on both.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "megamoe/config.h"
#include "megamoe/layout.h"
#include "megamoe/problem.h"

typedef struct ncclComm* ncclComm_t;

namespace megamoe {

// Device-side view of the symmetric buffer, passed to kernels by value.
struct SymmView {
  char* peers[kMaxRanks];  // every rank's buffer base, addressable from this rank's GPU (peers[rank] is local)
  int32_t rank;
  int32_t num_ranks;
  uint64_t timeout_ns;  // spin-waits give up after this long and record a DeviceError
  // Every rank's buffer is on this GPU (one rank, or emulated ranks): the words ranks share are
  // ordered at device scope (device::fence_ranks and the *_ranks accesses), not system scope.
  bool one_device = false;

  MEGAMOE_HD char* local() const { return peers[rank]; }
  // The address on `peer` of the object at `local_ptr` in this rank's buffer.
  template <typename T>
  MEGAMOE_HD T* map(T* local_ptr, int32_t peer) const {
    return reinterpret_cast<T*>(peers[peer] + (reinterpret_cast<char*>(local_ptr) - peers[rank]));
  }
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int32_t rank() const = 0;
  virtual int32_t size() const = 0;
  virtual int32_t device() const = 0;
  virtual bool emulated() const = 0;
  // Multiprocessors this rank's kernels may fill: all of them for NCCL ranks, a 1/R share when emulated.
  virtual int32_t sm_budget() const = 0;
  // The stream this rank's work is issued on by default (emulated ranks each get their own).
  virtual cudaStream_t stream() const = 0;
  // Host-side collective: every rank gets every rank's bytes (same size on all ranks).
  virtual std::vector<std::vector<uint8_t>> all_gather(const std::vector<uint8_t>& bytes) = 0;
  // Host-side barrier across ranks.
  virtual void barrier() = 0;
  // NCCL communicator behind this rank, or nullptr when emulated.
  virtual ncclComm_t nccl() const = 0;

  // Wraps a caller's NCCL communicator (not owned); the CUDA device must already be current.
  static std::unique_ptr<Communicator> from_nccl(ncclComm_t comm);
};

// The spin-wait timeout kernels get: MEGAMOE_TIMEOUT_MS from the environment, else 5000 ms.
uint64_t default_timeout_ns();

// Runs fn(communicator) once per rank and returns the number of ranks that failed (threw, crashed or
// exited non-zero); failures are reported on stderr with the rank.
//   processes: one process per rank on GPU `rank` (fork), NCCL bootstrapped with a unique id;
//   emulated:  one host thread per rank, all on GPU `device`.
enum class LaunchMode { processes, emulated };
int run_ranks(int32_t num_ranks, LaunchMode mode, const std::function<void(Communicator&)>& fn, int32_t device = 0);

// The symmetric buffer of one Problem. Creating it is collective: every rank constructs one with the
// same problem; the ranks exchange fingerprints and all throw megamoe::Error naming the differing
// fields when they disagree. The buffer is zeroed and all ranks synchronized before the constructor
// returns; the destructor frees everything (also collective). It first waits for the calls in flight:
// on a NCCL rank, all work on its device (calls may run on any stream); on an emulated rank, the
// communicator's stream only, so an emulated rank's calls on other streams must be waited for first.
class SymmBuffer {
 public:
  SymmBuffer(Communicator& comm, const Problem& problem);
  ~SymmBuffer();
  SymmBuffer(const SymmBuffer&) = delete;
  SymmBuffer& operator=(const SymmBuffer&) = delete;

  const Problem& problem() const { return problem_; }
  const BufferLayout& layout() const { return layout_; }
  Communicator& comm() const { return comm_; }
  const SymmView& view() const { return view_; }
  char* local() const { return view_.local(); }

  // Waits for `stream`, then throws megamoe::Error with the device's first recorded error (rank,
  // block, what it waited on, expected and seen values) and clears it; returns when there is none.
  // After an error that broke the call (a timeout, a streamed chunk out of step) it also zeroes this
  // rank's front ring, which makes the buffer whole again with one rank; with several, make a new
  // buffer (docs/streaming.md, "Failures and reset").
  void check_device_error(cudaStream_t stream);

  // The front ring's calls this rank has launched (or captured) so far, counted on the host: each
  // producer half's (route_tokens, quantize_activations into this buffer) and the streamed layer's.
  // A streamed layer call reads the call the producers published after its previous one, so the
  // producers may be at most one call ahead of it (layer.h refuses a call past that, where it would
  // read an older call's chunks). Zeroed with the ring.
  struct FrontCalls {
    uint64_t route = 0, layout = 0, layer = 0;
  };
  FrontCalls& front_calls() { return front_calls_; }

 private:
  struct Impl;
  Communicator& comm_;
  Problem problem_;
  BufferLayout layout_;
  SymmView view_{};
  FrontCalls front_calls_;
  std::unique_ptr<Impl> impl_;
};

// Formats a DeviceError for a host exception message.
std::string describe(const DeviceError& error);

}  // namespace megamoe
