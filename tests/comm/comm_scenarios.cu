#include "comm/comm_scenarios.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/check.h"
#include "comm/rank_barrier.h"
#include "kernels/comm/pull_kernels.cuh"
#include "kernels/comm/sync.cuh"
#include "megamoe/error.h"

namespace megamoe::comm_test {

namespace {

using detail::concat;

constexpr uint32_t kMailboxWords = 128;  // per writing rank: one word per thread of the checking block
constexpr uint32_t kDataWords = 4096;    // per message of peer_store_flag
constexpr uint32_t kMaxGridSlots = 1024;
constexpr uint32_t kGuardBytes = 4096;   // checked to stay zero after a pull's last row

// Scratch data laid over a rank's x region, at the same offsets on every rank.
struct Scratch {
  uint64_t* flags;       // [num_ranks]: flags[r] is written by rank r
  uint64_t* acks;        // [num_ranks]: acks[r] is written by rank r
  uint64_t* mailbox;     // [num_ranks][kMailboxWords]: row r is written by rank r
  uint32_t* pushed;      // [num_ranks][kDataWords]: row r is written by rank r
  uint32_t* own;         // [kDataWords]: written by this rank, read by the next one
  uint32_t* grid_slots;  // [kMaxGridSlots]: one per block of this rank

  MEGAMOE_HD static uint64_t bytes(int32_t num_ranks) {
    const uint64_t r = static_cast<uint64_t>(num_ranks);
    return 8 * r * (2 + kMailboxWords) + 4 * r * kDataWords + 4 * kDataWords + 4 * kMaxGridSlots;
  }
  MEGAMOE_HD static Scratch at(char* base, const BufferLayout& layout, int32_t num_ranks) {
    const uint64_t r = static_cast<uint64_t>(num_ranks);
    char* cursor = base + layout.x.offset;
    Scratch s;
    s.flags = reinterpret_cast<uint64_t*>(cursor);
    cursor += 8 * r;
    s.acks = reinterpret_cast<uint64_t*>(cursor);
    cursor += 8 * r;
    s.mailbox = reinterpret_cast<uint64_t*>(cursor);
    cursor += 8 * r * kMailboxWords;
    s.pushed = reinterpret_cast<uint32_t*>(cursor);
    cursor += 4 * r * kDataWords;
    s.own = reinterpret_cast<uint32_t*>(cursor);
    cursor += 4 * kDataWords;
    s.grid_slots = reinterpret_cast<uint32_t*>(cursor);
    return s;
  }
};

// The first mismatch a kernel saw, and how many there were.
struct Mismatch {
  unsigned int count;
  uint32_t iteration;
  uint32_t peer;
  uint32_t index;
  unsigned long long expected;
  unsigned long long seen;
};

__device__ void note_mismatch(Mismatch* m, uint32_t iteration, uint32_t peer, uint32_t index, uint64_t expected,
                              uint64_t seen) {
  if (atomicAdd(&m->count, 1u) != 0) return;
  m->iteration = iteration;
  m->peer = peer;
  m->index = index;
  m->expected = expected;
  m->seen = seen;
}

MEGAMOE_HD uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

MEGAMOE_HD uint32_t message_word(uint32_t round, int32_t rank, uint32_t index, uint32_t kind) {
  return mix((round * 0x9E3779B1U) ^ (static_cast<uint32_t>(rank) << 24) ^ (index * 0x85EBCA77U) ^ kind);
}

MEGAMOE_HD uint64_t mailbox_word(uint32_t iteration, int32_t rank, uint32_t index) {
  return (static_cast<uint64_t>(iteration) << 32) | (static_cast<uint64_t>(rank) << 16) | index;
}

MEGAMOE_HD uint32_t pull_word(int32_t rank, uint64_t index) {
  return mix(static_cast<uint32_t>(index) * 2654435761U + static_cast<uint32_t>(rank) * 97U + 12345U);
}

// ---- Kernels ----

__global__ void count_nonzero_kernel(const uint32_t* words, uint64_t count, unsigned long long* nonzero) {
  unsigned long long local = 0;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < count; i += uint64_t{gridDim.x} * blockDim.x) {
    local += words[i] != 0;
  }
  if (local != 0) atomicAdd(nonzero, local);
}

__global__ void peer_store_flag_kernel(SymmView view, BufferLayout layout, uint32_t rounds, Mismatch* mismatch) {
  const int32_t ranks = view.num_ranks;
  const int32_t me = view.rank;
  const int32_t next = (me + 1) % ranks;
  const int32_t prev = (me + ranks - 1) % ranks;
  ControlBlock* control = layout.control_block(view.local());
  const Scratch mine = Scratch::at(view.local(), layout, ranks);
  const Scratch at_next = Scratch::at(view.peers[next], layout, ranks);
  const Scratch at_prev = Scratch::at(view.peers[prev], layout, ranks);
  for (uint32_t round = 1; round <= rounds; ++round) {
    for (uint32_t i = threadIdx.x; i < kDataWords; i += blockDim.x) {
      at_next.pushed[me * kDataWords + i] = message_word(round, me, i, 0);  // peer store
      mine.own[i] = message_word(round, me, i, 1);                          // for the next rank to pull
    }
    __syncthreads();
    bool ok = true;
    if (threadIdx.x == 0) {
      device::st_release_sys(&at_next.flags[me], uint64_t{round});
      ok = device::wait_at_least_sys(view, control, &mine.flags[prev], uint64_t{round}, kWaitTest,
                                     static_cast<uint32_t>(prev));
    }
    if (!__syncthreads_and(ok)) return;
    for (uint32_t i = threadIdx.x; i < kDataWords; i += blockDim.x) {
      const uint32_t pushed = mine.pushed[prev * kDataWords + i];
      const uint32_t pulled = at_prev.own[i];  // peer load
      const uint32_t want_pushed = message_word(round, prev, i, 0);
      const uint32_t want_pulled = message_word(round, prev, i, 1);
      if (pushed != want_pushed) note_mismatch(mismatch, round, prev, i, want_pushed, pushed);
      if (pulled != want_pulled) note_mismatch(mismatch, round, prev, kDataWords + i, want_pulled, pulled);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      // The previous rank may now overwrite what it sent; wait until the next rank has read ours.
      device::st_release_sys(&at_prev.acks[me], uint64_t{round});
      ok = device::wait_at_least_sys(view, control, &mine.acks[next], uint64_t{round}, kWaitTest,
                                     static_cast<uint32_t>(next));
    }
    if (!__syncthreads_and(ok)) return;
  }
}

// Thread t writes word t of this rank's mailbox row on every rank.
__device__ void write_mailboxes(const SymmView& view, const BufferLayout& layout, uint32_t iteration) {
  for (int32_t peer = 0; peer < view.num_ranks; ++peer) {
    const Scratch there = Scratch::at(view.peers[peer], layout, view.num_ranks);
    there.mailbox[view.rank * kMailboxWords + threadIdx.x] = mailbox_word(iteration, view.rank, threadIdx.x);
  }
}

__device__ void check_mailboxes(const SymmView& view, const BufferLayout& layout, uint32_t iteration,
                                Mismatch* mismatch) {
  const Scratch mine = Scratch::at(view.local(), layout, view.num_ranks);
  for (int32_t writer = 0; writer < view.num_ranks; ++writer) {
    const uint64_t seen = mine.mailbox[writer * kMailboxWords + threadIdx.x];
    const uint64_t want = mailbox_word(iteration, writer, threadIdx.x);
    if (seen != want) note_mismatch(mismatch, iteration, static_cast<uint32_t>(writer), threadIdx.x, want, seen);
  }
}

__global__ void __launch_bounds__(kMailboxWords)
    rank_barrier_many_kernel(SymmView view, BufferLayout layout, uint32_t iterations, Mismatch* mismatch) {
  for (uint32_t iteration = 1; iteration <= iterations; ++iteration) {
    write_mailboxes(view, layout, iteration);
    if (!device::rank_barrier(view, layout)) return;
    check_mailboxes(view, layout, iteration, mismatch);
    // Nobody may overwrite a mailbox before every rank has checked it.
    if (!device::rank_barrier(view, layout)) return;
  }
}

__global__ void __launch_bounds__(kMailboxWords) write_mailboxes_kernel(SymmView view, BufferLayout layout,
                                                                        uint32_t iteration) {
  write_mailboxes(view, layout, iteration);
}

__global__ void __launch_bounds__(kMailboxWords)
    check_mailboxes_kernel(SymmView view, BufferLayout layout, uint32_t iteration, Mismatch* mismatch) {
  check_mailboxes(view, layout, iteration, mismatch);
}

__global__ void grid_barrier_many_kernel(SymmView view, BufferLayout layout, uint32_t iterations, Mismatch* mismatch) {
  const Scratch mine = Scratch::at(view.local(), layout, view.num_ranks);
  for (uint32_t iteration = 1; iteration <= iterations; ++iteration) {
    if (threadIdx.x == 0) mine.grid_slots[blockIdx.x] = iteration;
    if (!device::grid_barrier(view, layout)) return;
    for (uint32_t block = threadIdx.x; block < gridDim.x; block += blockDim.x) {
      const uint32_t seen = mine.grid_slots[block];
      if (seen != iteration) note_mismatch(mismatch, iteration, static_cast<uint32_t>(view.rank), block, iteration, seen);
    }
    if (!device::grid_barrier(view, layout)) return;
  }
}

// The last block never arrives.
__global__ void grid_barrier_missing_block_kernel(SymmView view, BufferLayout layout) {
  if (blockIdx.x == gridDim.x - 1) return;
  device::grid_barrier(view, layout);
}

__global__ void fill_pull_source_kernel(uint32_t* words, uint64_t count, int32_t rank) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < count; i += uint64_t{gridDim.x} * blockDim.x) {
    words[i] = pull_word(rank, i);
  }
}

// Words below `pulled` must match the source rank's pattern, the guard words after them must be zero.
__global__ void check_pulled_kernel(const uint32_t* words, uint64_t pulled, uint64_t guard, int32_t source,
                                    Mismatch* mismatch) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < pulled + guard;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint32_t want = i < pulled ? pull_word(source, i) : 0;
    if (words[i] != want) note_mismatch(mismatch, 0, static_cast<uint32_t>(source), static_cast<uint32_t>(i), want, words[i]);
  }
}

// ---- Host helpers ----

// Device memory on one stream, allocated and freed in stream order (never waiting for the whole
// device, where another emulated rank's kernel may be spinning).
template <typename T>
class StreamBuffer {
 public:
  StreamBuffer(size_t count, cudaStream_t stream) : stream_(stream) {
    MEGAMOE_CHECK_CUDA(cudaMallocAsync(&data_, sizeof(T) * count, stream));
    MEGAMOE_CHECK_CUDA(cudaMemsetAsync(data_, 0, sizeof(T) * count, stream));
  }
  ~StreamBuffer() { cudaFreeAsync(data_, stream_); }
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;
  T* get() const { return data_; }
  T read() const {
    T value{};
    MEGAMOE_CHECK_CUDA(cudaMemcpyAsync(&value, data_, sizeof(T), cudaMemcpyDeviceToHost, stream_));
    MEGAMOE_CHECK_CUDA(cudaStreamSynchronize(stream_));
    return value;
  }

 private:
  T* data_ = nullptr;
  cudaStream_t stream_;
};

// Throws when the kernels behind `record` saw a mismatch.
void require_no_mismatch(const StreamBuffer<Mismatch>& record, int32_t rank, const std::string& what) {
  const Mismatch m = record.read();
  if (m.count == 0) return;
  throw Error(concat("rank ", rank, ": ", what, ": ", m.count, " mismatches; first at iteration ", m.iteration,
                     ", rank ", m.peer, ", index ", m.index, ": expected ", m.expected, ", saw ", m.seen));
}

void require_scratch(const SymmBuffer& buffer) {
  const uint64_t needed = Scratch::bytes(buffer.view().num_ranks);
  if (needed > buffer.layout().x.bytes) {
    throw Error(concat("rank ", buffer.view().rank, ": the test scratch needs ", needed, " bytes, x holds ",
                       buffer.layout().x.bytes));
  }
}

// Runs the check; it must throw megamoe::Error whose message contains every one of `parts`.
template <typename Check>
void expect_error(int32_t rank, const char* what, Check&& check, const std::vector<std::string>& parts) {
  try {
    check();
  } catch (const Error& e) {
    const std::string message = e.what();
    for (const std::string& part : parts) {
      if (message.find(part) == std::string::npos) {
        throw Error(concat("rank ", rank, ": ", what, ": the error '", message, "' does not say '", part, "'"));
      }
    }
    return;
  }
  throw Error(concat("rank ", rank, ": ", what, ": no error was raised"));
}

Problem pull_problem(const Communicator& comm) {
  Problem p = test_problem(comm);
  p.recipe = Recipe::bf16;
  p.hidden = 7168;
  p.max_tokens_per_rank = 320;  // x holds 320 rows of 14336 bytes
  return p;
}

}  // namespace

Problem test_problem(const Communicator& comm) {
  Problem p;
  p.num_ranks = comm.size();
  p.rank = comm.rank();
  p.num_experts = 2 * comm.size();
  p.top_k = 2;
  p.hidden = 2048;
  p.intermediate = 256;
  p.num_shared_experts = 0;
  p.max_tokens_per_rank = 128;
  p.recipe = Recipe::fp8;
  return p;
}

void buffer_zeroed(Communicator& comm) {
  const Problem problem = test_problem(comm);
  cudaStream_t stream = comm.stream();
  {
    SymmBuffer dirty(comm, problem);
    MEGAMOE_CHECK_CUDA(cudaMemsetAsync(dirty.local(), 0xFF, dirty.layout().total_bytes, stream));
    MEGAMOE_CHECK_CUDA(cudaStreamSynchronize(stream));
  }
  SymmBuffer buffer(comm, problem);
  const SymmView& view = buffer.view();
  // Shared words at device scope only where every rank's buffer is on this GPU.
  const bool one_device = comm.emulated() || comm.size() == 1;
  if (view.one_device != one_device) {
    throw Error(concat("rank ", comm.rank(), ": view.one_device is ", view.one_device, " for ", comm.size(),
                       comm.emulated() ? " emulated" : " NCCL", " ranks"));
  }
  for (int32_t a = 0; a < view.num_ranks; ++a) {
    for (int32_t b = a + 1; b < view.num_ranks; ++b) {
      if (view.peers[a] == view.peers[b]) {
        throw Error(concat("rank ", comm.rank(), ": ranks ", a, " and ", b, " have the same buffer address"));
      }
    }
  }
  const uint64_t words = buffer.layout().total_bytes / 4;
  for (int32_t peer = 0; peer < view.num_ranks; ++peer) {
    StreamBuffer<unsigned long long> nonzero(1, stream);
    count_nonzero_kernel<<<comm.sm_budget(), 256, 0, stream>>>(reinterpret_cast<const uint32_t*>(view.peers[peer]),
                                                               words, nonzero.get());
    comm_detail::check_cuda(cudaGetLastError(), "count_nonzero_kernel");
    const unsigned long long found = nonzero.read();
    if (found != 0) {
      throw Error(concat("rank ", comm.rank(), ": rank ", peer, "'s new buffer has ", found, " nonzero words of ",
                         words));
    }
  }
}

void peer_store_flag(Communicator& comm) {
  SymmBuffer buffer(comm, test_problem(comm));
  require_scratch(buffer);
  cudaStream_t stream = comm.stream();
  StreamBuffer<Mismatch> mismatch(1, stream);
  constexpr uint32_t kRounds = 200;
  peer_store_flag_kernel<<<1, 256, 0, stream>>>(buffer.view(), buffer.layout(), kRounds, mismatch.get());
  comm_detail::check_cuda(cudaGetLastError(), "peer_store_flag_kernel");
  buffer.check_device_error(stream);
  require_no_mismatch(mismatch, comm.rank(),
                      "data read after acquiring the previous rank's flag (index < 4096: its stores into this buffer; "
                      "index >= 4096: loads from its buffer)");
}

void rank_barrier_many(Communicator& comm) {
  SymmBuffer buffer(comm, test_problem(comm));
  require_scratch(buffer);
  cudaStream_t stream = comm.stream();
  StreamBuffer<Mismatch> mismatch(1, stream);
  constexpr uint32_t kIterations = 10000;
  rank_barrier_many_kernel<<<1, kMailboxWords, 0, stream>>>(buffer.view(), buffer.layout(), kIterations,
                                                            mismatch.get());
  comm_detail::check_cuda(cudaGetLastError(), "rank_barrier_many_kernel");
  buffer.check_device_error(stream);
  require_no_mismatch(mismatch, comm.rank(), "mailboxes read after an in-kernel rank barrier");
}

void standalone_barrier(Communicator& comm) {
  SymmBuffer buffer(comm, test_problem(comm));
  require_scratch(buffer);
  cudaStream_t stream = comm.stream();
  StreamBuffer<Mismatch> mismatch(1, stream);
  for (uint32_t iteration = 1; iteration <= 100; ++iteration) {
    write_mailboxes_kernel<<<1, kMailboxWords, 0, stream>>>(buffer.view(), buffer.layout(), iteration);
    comm_detail::check_cuda(cudaGetLastError(), "write_mailboxes_kernel");
    launch_rank_barrier(buffer, stream);
    check_mailboxes_kernel<<<1, kMailboxWords, 0, stream>>>(buffer.view(), buffer.layout(), iteration,
                                                            mismatch.get());
    comm_detail::check_cuda(cudaGetLastError(), "check_mailboxes_kernel");
    launch_rank_barrier(buffer, stream);
  }
  buffer.check_device_error(stream);
  require_no_mismatch(mismatch, comm.rank(), "mailboxes read after the standalone rank barrier kernel");
}

void grid_barrier_many(Communicator& comm) {
  SymmBuffer buffer(comm, test_problem(comm));
  require_scratch(buffer);
  cudaStream_t stream = comm.stream();
  StreamBuffer<Mismatch> mismatch(1, stream);
  const int blocks = std::min<int>(comm.sm_budget(), kMaxGridSlots);
  grid_barrier_many_kernel<<<blocks, 256, 0, stream>>>(buffer.view(), buffer.layout(), 1000, mismatch.get());
  comm_detail::check_cuda(cudaGetLastError(), "grid_barrier_many_kernel");
  buffer.check_device_error(stream);
  require_no_mismatch(mismatch, comm.rank(), concat("block slots read after a grid barrier of ", blocks, " blocks"));
}

void fingerprint_mismatch(Communicator& comm) {
  Problem problem = test_problem(comm);
  problem.hidden = comm.rank() == 0 ? 2048 : 1024;
  expect_error(comm.rank(), "creating a buffer while rank 0's hidden differs",
               [&] { SymmBuffer buffer(comm, problem); }, {"ranks disagree on hidden: rank 0 has 2048, rank 1 has 1024"});
  // The failed attempt must leave the ranks able to agree on the next one.
  SymmBuffer buffer(comm, test_problem(comm));
}

void invalid_problem(Communicator& comm) {
  const int32_t last = comm.size() - 1;
  Problem problem = test_problem(comm);
  if (comm.rank() == last) problem.top_k = 0;
  std::vector<std::string> parts = {concat("checking the problem failed on rank ", last)};
  if (comm.rank() == last) parts.push_back("top_k: must be in");
  expect_error(comm.rank(), "creating a buffer while the last rank's top_k is 0",
               [&] { SymmBuffer buffer(comm, problem); }, parts);
  SymmBuffer buffer(comm, test_problem(comm));
}

void rank_barrier_timeout(Communicator& comm) {
  SymmBuffer buffer(comm, test_problem(comm));
  cudaStream_t stream = comm.stream();
  const int32_t last = comm.size() - 1;
  if (comm.rank() != last) {
    launch_rank_barrier(buffer, stream);
    const uint64_t ms = buffer.view().timeout_ns / 1000000;
    expect_error(comm.rank(), "a rank barrier that the last rank never enters",
                 [&] { buffer.check_device_error(stream); },
                 {concat("rank ", comm.rank(), ", block 0, thread 0: timed out after ", ms,
                         " ms waiting at the cross-rank barrier for rank ", last, " (expected epoch 1, saw 0)")});
  }
  comm.barrier();
}

void grid_barrier_timeout(Communicator& comm) {
  SymmBuffer buffer(comm, test_problem(comm));
  require_scratch(buffer);
  cudaStream_t stream = comm.stream();
  const int blocks = std::min(4, comm.sm_budget());
  if (blocks < 2) throw Error(concat("rank ", comm.rank(), ": needs two blocks, the budget is ", blocks));
  // Arrival counts a GEMM's split-K units may have left when they gave up (any byte pattern will do):
  // check_device_error must clear them with the record.
  const Region& split = buffer.layout().gemm_split;
  MEGAMOE_CHECK_CUDA(cudaMemsetAsync(buffer.local() + split.offset, 0x5A, split.bytes, stream));
  grid_barrier_missing_block_kernel<<<blocks, 64, 0, stream>>>(buffer.view(), buffer.layout());
  comm_detail::check_cuda(cudaGetLastError(), "grid_barrier_missing_block_kernel");
  const uint64_t ms = buffer.view().timeout_ns / 1000000;
  expect_error(comm.rank(), "a grid barrier that one block never enters", [&] { buffer.check_device_error(stream); },
               {concat("rank ", comm.rank(), ", block "),
                concat("thread 0: timed out after ", ms, " ms waiting at the grid barrier (expected generation 1, saw 0)")});
  std::vector<uint8_t> split_bytes(split.bytes);
  MEGAMOE_CHECK_CUDA(
      cudaMemcpyAsync(split_bytes.data(), buffer.local() + split.offset, split.bytes, cudaMemcpyDeviceToHost, stream));
  MEGAMOE_CHECK_CUDA(cudaStreamSynchronize(stream));
  const auto dirty = std::find_if(split_bytes.begin(), split_bytes.end(), [](uint8_t byte) { return byte != 0; });
  if (dirty != split_bytes.end()) {
    throw Error(concat("rank ", comm.rank(), ": check_device_error left the split-K workspace dirty at byte ",
                       dirty - split_bytes.begin(), " of ", split.bytes));
  }
  // check_device_error cleared the record and the stale arrivals: the barrier must work again.
  StreamBuffer<Mismatch> mismatch(1, stream);
  grid_barrier_many_kernel<<<blocks, 64, 0, stream>>>(buffer.view(), buffer.layout(), 10, mismatch.get());
  comm_detail::check_cuda(cudaGetLastError(), "grid_barrier_many_kernel");
  buffer.check_device_error(stream);
  require_no_mismatch(mismatch, comm.rank(), "block slots read after a grid barrier that had timed out before");
}

void create_destroy_many(Communicator& comm) {
  const Problem problem = test_problem(comm);
  cudaStream_t stream = comm.stream();
  auto free_bytes = [&] {
    MEGAMOE_CHECK_CUDA(cudaStreamSynchronize(stream));
    comm.barrier();  // every rank has finished creating and freeing
    size_t free = 0, total = 0;
    MEGAMOE_CHECK_CUDA(cudaMemGetInfo(&free, &total));
    comm.barrier();  // nobody allocates while another rank measures
    return free;
  };
  { SymmBuffer warm_up(comm, problem); }
  // Free memory is device-wide, so another process's allocation (a CUDA context is ~500 MiB) can
  // look like a loss once; a leak loses again on the second try. The ranks agree on retrying.
  constexpr int kTries = 2;
  for (int attempt = 1;; ++attempt) {
    const size_t before = free_bytes();
    uint64_t buffer_bytes = 0;
    for (int i = 0; i < 100; ++i) {
      SymmBuffer buffer(comm, problem);
      buffer_bytes = buffer.layout().total_bytes;
    }
    const size_t after = free_bytes();
    // Leaking even one buffer per cycle would lose at least 100 allocation granules (2 MiB each).
    constexpr size_t kSlack = size_t{64} << 20;
    bool lost = false;
    for (const std::vector<uint8_t>& flag : comm.all_gather({static_cast<uint8_t>(after + kSlack < before)}))
      lost = lost || flag.at(0) != 0;
    if (!lost) return;
    if (attempt == kTries) {
      throw Error(concat("rank ", comm.rank(), ": 100 buffers of ", buffer_bytes, " bytes created and destroyed lost ",
                         before > after ? (before - after) >> 20 : 0, " MiB of device memory, in each of ", kTries,
                         " tries"));
    }
  }
}

void pull_rows(Communicator& comm) {
  SymmBuffer buffer(comm, pull_problem(comm));
  cudaStream_t stream = comm.stream();
  const SymmView& view = buffer.view();
  const BufferLayout& layout = buffer.layout();
  const uint64_t source_words = layout.x.bytes / 4;
  fill_pull_source_kernel<<<comm.sm_budget(), 256, 0, stream>>>(
      reinterpret_cast<uint32_t*>(view.local() + layout.x.offset), source_words, comm.rank());
  comm_detail::check_cuda(cudaGetLastError(), "fill_pull_source_kernel");
  MEGAMOE_CHECK_CUDA(cudaStreamSynchronize(stream));
  comm.barrier();

  const int32_t source = (comm.rank() + 1) % comm.size();
  char* destination = view.local() + layout.l1_pool.offset;
  for (device::PullMethod method : {device::PullMethod::bulk, device::PullMethod::vector}) {
    // E4M3 rows with their scales in a second region, as the layer keeps them; BF16 rows alone.
    for (const auto [row_bytes, scale_bytes] : {std::pair{7168u, 224u}, std::pair{14336u, 0u}}) {
      for (uint32_t rows : {1u, 37u, 300u}) {
        const uint64_t bytes = uint64_t{rows} * (row_bytes + scale_bytes);
        if (bytes + kGuardBytes > layout.l1_pool.bytes || bytes > layout.x.bytes) {
          throw Error(concat("rank ", comm.rank(), ": the test buffer is too small for ", rows, " rows"));
        }
        MEGAMOE_CHECK_CUDA(cudaMemsetAsync(destination, 0, bytes + kGuardBytes, stream));
        // The scales right after the rows in both buffers: the pulled bytes are then a contiguous copy.
        const char* source_rows = view.peers[source] + layout.x.offset;
        const uint64_t scales_at = uint64_t{rows} * row_bytes;
        const device::PulledRows map{{source_rows, destination, row_bytes},
                                     {source_rows + scales_at, destination + scales_at, scale_bytes}};
        comm_detail::check_cuda(device::launch_pull_rows(method, map, rows, comm.sm_budget(), stream), "launch_pull_rows");
        StreamBuffer<Mismatch> mismatch(1, stream);
        check_pulled_kernel<<<comm.sm_budget(), 256, 0, stream>>>(reinterpret_cast<const uint32_t*>(destination),
                                                                  bytes / 4, kGuardBytes / 4, source, mismatch.get());
        comm_detail::check_cuda(cudaGetLastError(), "check_pulled_kernel");
        require_no_mismatch(mismatch, comm.rank(),
                            concat(method == device::PullMethod::bulk ? "bulk" : "vector", " pull of ", rows,
                                   " rows of ", row_bytes, " + ", scale_bytes, " bytes from rank ", source,
                                   " (index = word offset; past the rows must stay zero)"));
      }
    }
  }
  MEGAMOE_CHECK_CUDA(cudaStreamSynchronize(stream));
}

void concurrent_pull_launches() {
  constexpr int kLaunches = 500;
  constexpr uint32_t kRows = 16;
  const uint32_t row_bytes[2] = {1024, 14336};
  std::string failure[2];
  auto launcher = [&](int which) {
    cudaStream_t stream = nullptr;
    char* src = nullptr;
    char* dst = nullptr;
    const uint64_t bytes = uint64_t{kRows} * row_bytes[which];
    try {
      MEGAMOE_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      MEGAMOE_CHECK_CUDA(cudaMalloc(&src, bytes));
      MEGAMOE_CHECK_CUDA(cudaMalloc(&dst, bytes));
      // Defined bytes that the pull must overwrite: a row it skipped fails the comparison. Written only
      // by bulk copies, the rows read back as uninitialized under compute-sanitizer's initcheck.
      MEGAMOE_CHECK_CUDA(cudaMemset(dst, 0xA5, bytes));
      std::vector<char> pattern(bytes);
      for (uint64_t i = 0; i < bytes; ++i) pattern[i] = static_cast<char>(i * 7 + which);
      MEGAMOE_CHECK_CUDA(cudaMemcpy(src, pattern.data(), bytes, cudaMemcpyHostToDevice));
      const device::PulledRows map{{src, dst, row_bytes[which]}, {nullptr, nullptr, 0}};
      for (int launch = 0; launch < kLaunches && failure[which].empty(); ++launch) {
        const cudaError_t status = device::launch_pull_rows(device::PullMethod::bulk, map, kRows, 4, stream);
        if (status != cudaSuccess) {
          failure[which] = concat("launch ", launch, " of ", row_bytes[which], "-byte rows: ", cudaGetErrorName(status),
                                  " (", cudaGetErrorString(status), ")");
        }
      }
      MEGAMOE_CHECK_CUDA(cudaStreamSynchronize(stream));
      std::vector<char> pulled(bytes);
      MEGAMOE_CHECK_CUDA(cudaMemcpy(pulled.data(), dst, bytes, cudaMemcpyDeviceToHost));
      if (failure[which].empty() && pulled != pattern) {
        failure[which] = concat(row_bytes[which], "-byte rows: the pulled rows differ from the source");
      }
    } catch (const std::exception& e) {
      failure[which] = e.what();
    }
    cudaFree(src);
    cudaFree(dst);
    if (stream != nullptr) cudaStreamDestroy(stream);
  };
  std::thread first(launcher, 0), second(launcher, 1);
  first.join();
  second.join();
  for (const std::string& why : failure) {
    if (!why.empty()) throw Error(concat("concurrent bulk pull launches: ", why));
  }
}

}  // namespace megamoe::comm_test
