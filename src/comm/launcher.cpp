// run_ranks: one process per GPU bootstrapped through NCCL, or emulated ranks as threads on one GPU.
#include "comm/launcher.h"

#include <cuda.h>  // CUmoduleLoadingMode only; the driver is reached through the runtime, not linked
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "comm/check.h"
#include "comm/emulated.h"
#include "megamoe/comm.h"
#include "megamoe/error.h"

namespace megamoe {

namespace {

// Emulated ranks need two settings that CUDA reads only when it initializes, so they are made here,
// as the program starts, unless the environment already chose:
// - CUDA_MODULE_LOADING=EAGER: a lazily loaded kernel's first launch may wait for the device to go
//   idle, which never happens while another emulated rank's kernel spins waiting for that launch.
// - CUDA_DEVICE_MAX_CONNECTIONS=32: streams beyond the default 8 hardware queues share one, and a
//   rank's kernel queued behind another rank's spinning kernel would never start.
// Rank processes drop the first again before touching CUDA: they hold one rank each, and NCCL's large
// kernel library should keep loading lazily.
bool g_set_module_loading = false;

struct PrepareEmulationEnvironment {
  PrepareEmulationEnvironment() {
    if (std::getenv("CUDA_MODULE_LOADING") == nullptr) {
      setenv("CUDA_MODULE_LOADING", "EAGER", 1);
      g_set_module_loading = true;
    }
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  }
} const g_prepare_emulation_environment;

void report(int32_t rank, const char* what) { std::fprintf(stderr, "rank %d: %s\n", rank, what); }

// Runs fn on a rank's communicator and reports what it throws while the communicator still exists:
// a fault in fn leaves a sticky CUDA error that the communicator's release meets and reports again,
// and the cause must print first. False when fn threw.
bool run_reporting(int32_t rank, Communicator& comm, const std::function<void(Communicator&)>& fn) {
  try {
    fn(comm);
    return true;
  } catch (const std::exception& e) {
    report(rank, e.what());
  } catch (...) {
    report(rank, "unknown exception");
  }
  return false;
}

// Throws when kernels load lazily in this process (see PrepareEmulationEnvironment).
void require_eager_module_loading() {
  void* entry = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  MEGAMOE_CHECK_CUDA(
      cudaGetDriverEntryPointByVersion("cuModuleGetLoadingMode", &entry, 11070, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || entry == nullptr) return;  // an old driver loads eagerly
  CUmoduleLoadingMode mode = CU_MODULE_EAGER_LOADING;
  const CUresult status = reinterpret_cast<CUresult (*)(CUmoduleLoadingMode*)>(entry)(&mode);
  require(status == CUDA_SUCCESS, "run_ranks", "cuModuleGetLoadingMode failed with CUresult ", static_cast<int>(status));
  const char* setting = std::getenv("CUDA_MODULE_LOADING");
  require(mode == CU_MODULE_EAGER_LOADING, "run_ranks",
          "emulated ranks need CUDA_MODULE_LOADING=EAGER before the process first uses CUDA (it is '",
          setting != nullptr ? setting : "", "'): a lazily loaded kernel can wait behind another rank's spin-wait");
}

int run_emulated(int32_t num_ranks, const std::function<void(Communicator&)>& fn, int32_t device) {
  MEGAMOE_CHECK_CUDA(cudaSetDevice(device));
  if (num_ranks > 1) require_eager_module_loading();
  auto group = std::make_shared<EmulatedGroup>(num_ranks);
  std::atomic<int> failed{0};
  auto run_rank = [&](int32_t rank) {
    try {
      MEGAMOE_CHECK_CUDA(cudaSetDevice(device));
      EmulatedCommunicator comm(group, rank, device);
      if (run_reporting(rank, comm, fn)) return;
    } catch (const std::exception& e) {
      report(rank, e.what());
    } catch (...) {
      report(rank, "unknown exception");
    }
    group->abort();
    ++failed;
  };
  std::vector<std::thread> threads;
  try {
    for (int32_t rank = 0; rank < num_ranks; ++rank) threads.emplace_back(run_rank, rank);
  } catch (...) {
    group->abort();
    for (std::thread& thread : threads) thread.join();
    throw;
  }
  for (std::thread& thread : threads) thread.join();
  return failed.load();
}

bool read_exactly(int fd, void* data, size_t bytes) {
  auto* cursor = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t got = read(fd, cursor, bytes);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    cursor += got;
    bytes -= static_cast<size_t>(got);
  }
  return true;
}

bool write_exactly(int fd, const void* data, size_t bytes) {
  const auto* cursor = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t put = write(fd, cursor, bytes);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return false;
    cursor += put;
    bytes -= static_cast<size_t>(put);
  }
  return true;
}

// A rank process: GPU `rank`, NCCL bootstrapped from the unique id read from `id_fd`. Never returns.
[[noreturn]] void run_child(int32_t rank, int32_t num_ranks, int id_fd, const std::function<void(Communicator&)>& fn) {
  int status = 1;
  ncclComm_t comm = nullptr;
  try {
    if (g_set_module_loading) unsetenv("CUDA_MODULE_LOADING");
    ncclUniqueId id{};
    require(read_exactly(id_fd, &id, sizeof(id)), "run_ranks",
            "did not receive the NCCL unique id (the launching process failed to create or send it)");
    close(id_fd);
    MEGAMOE_CHECK_CUDA(cudaSetDevice(rank));
    MEGAMOE_CHECK_NCCL(ncclCommInitRank(&comm, num_ranks, id, rank), nullptr);
    bool ran = false;
    {
      const std::unique_ptr<Communicator> communicator = Communicator::from_nccl(comm);
      ran = run_reporting(rank, *communicator, fn);
    }
    if (ran) {
      ncclComm_t finished = comm;
      comm = nullptr;
      MEGAMOE_CHECK_NCCL(ncclCommDestroy(finished), nullptr);
      status = 0;
    }
  } catch (const std::exception& e) {
    report(rank, e.what());
  } catch (...) {
    report(rank, "unknown exception");
  }
  // Abort, not destroy: destroying waits for peers that may be gone.
  if (comm != nullptr) ncclCommAbort(comm);
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(status);
}

// Waits for every rank process. Once one has failed, the others get `grace` to finish (long enough
// for their own spin-wait timeouts to fire and report) and are then killed, so nothing hangs.
int wait_for_children(const std::vector<pid_t>& pids, std::chrono::milliseconds grace) {
  using Clock = std::chrono::steady_clock;
  const int32_t num_ranks = static_cast<int32_t>(pids.size());
  std::vector<bool> finished(pids.size(), false);
  int32_t remaining = num_ranks;
  int failed = 0;
  std::optional<Clock::time_point> deadline;
  auto fail = [&](int32_t rank, const std::string& why) {
    report(rank, why.c_str());
    ++failed;
    if (!deadline) deadline = Clock::now() + grace;
  };
  while (remaining > 0) {
    bool reaped = false;
    for (int32_t rank = 0; rank < num_ranks; ++rank) {
      if (finished[rank]) continue;
      int status = 0;
      const pid_t got = waitpid(pids[rank], &status, WNOHANG);
      if (got == 0 || (got < 0 && errno == EINTR)) continue;
      finished[rank] = true;
      --remaining;
      reaped = true;
      if (got < 0) {
        fail(rank, detail::concat("lost its process: waitpid failed: ", std::strerror(errno)));
      } else if (WIFSIGNALED(status)) {
        fail(rank, detail::concat("killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ")"));
      } else if (WIFEXITED(status) && WEXITSTATUS(status) != 0) {
        fail(rank, detail::concat("exited with status ", WEXITSTATUS(status)));
      }
    }
    if (deadline && Clock::now() > *deadline) {
      for (int32_t rank = 0; rank < num_ranks; ++rank) {
        if (finished[rank]) continue;
        kill(pids[rank], SIGKILL);
        int status = 0;
        while (waitpid(pids[rank], &status, 0) < 0 && errno == EINTR) {
        }
        finished[rank] = true;
        --remaining;
        report(rank, detail::concat("still running ", grace.count(), " ms after another rank failed; killed").c_str());
        ++failed;
      }
    }
    if (!reaped) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return failed;
}

int run_processes(int32_t num_ranks, const std::function<void(Communicator&)>& fn) {
  // No multicast objects: the symmetric buffer needs only load/store access between peers.
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  const auto grace = std::chrono::milliseconds(default_timeout_ns() / 1000000 + 5000);
  // Buffered output would otherwise be written once by the parent and again by every child.
  std::fflush(stdout);
  std::fflush(stderr);

  std::vector<pid_t> pids;
  std::vector<int> id_writers;  // the parent's ends of the pipes that carry the unique id
  auto close_writers = [&id_writers] {
    for (int fd : id_writers) close(fd);
    id_writers.clear();
  };
  for (int32_t rank = 0; rank < num_ranks; ++rank) {
    int fds[2];
    const bool piped = pipe(fds) == 0;
    const pid_t pid = piped ? fork() : -1;
    if (pid == 0) {
      close(fds[1]);
      for (int fd : id_writers) close(fd);  // so a rank sees end-of-file if the parent dies
      run_child(rank, num_ranks, fds[0], fn);
    }
    if (pid < 0) {
      const int error = errno;
      if (piped) {
        close(fds[0]);
        close(fds[1]);
      }
      // Ranks already started see end-of-file instead of an id and exit.
      close_writers();
      wait_for_children(pids, std::chrono::milliseconds(0));
      throw Error(detail::concat("run_ranks: could not start rank ", rank, ": ", std::strerror(error)));
    }
    close(fds[0]);
    pids.push_back(pid);
    id_writers.push_back(fds[1]);
  }

  // The id is made after forking: ncclGetUniqueId starts NCCL's bootstrap root thread here, and a
  // process should not fork while it has threads. (It does not initialize CUDA.)
  ncclUniqueId id{};
  const ncclResult_t made = ncclGetUniqueId(&id);
  if (made != ncclSuccess) {
    std::fprintf(stderr, "megamoe: run_ranks: ncclGetUniqueId failed: %s\n", ncclGetErrorString(made));
  } else {
    // A rank that already died closed its end; writing must fail quietly rather than raise SIGPIPE.
    struct sigaction ignore {}, previous {};
    ignore.sa_handler = SIG_IGN;
    sigaction(SIGPIPE, &ignore, &previous);
    for (int fd : id_writers) write_exactly(fd, &id, sizeof(id));
    sigaction(SIGPIPE, &previous, nullptr);
  }
  close_writers();
  return wait_for_children(pids, grace);
}

}  // namespace

int run_ranks(int32_t num_ranks, LaunchMode mode, const std::function<void(Communicator&)>& fn, int32_t device) {
  require(num_ranks >= 1 && num_ranks <= kMaxRanks, "num_ranks", "must be in [1, ", kMaxRanks, "], got ", num_ranks);
  return mode == LaunchMode::processes ? run_processes(num_ranks, fn) : run_emulated(num_ranks, fn, device);
}

int32_t count_hopper_gpus_in_child() {
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  if (pid == 0) {
    int count = 0;
    int hopper = 0;
    if (cudaGetDeviceCount(&count) == cudaSuccess) {
      for (int device = 0; device < count; ++device) {
        cudaDeviceProp prop{};
        if (cudaGetDeviceProperties(&prop, device) == cudaSuccess && prop.major == 9) ++hopper;
      }
    }
    _exit(hopper);
  }
  if (pid < 0) return 0;
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return 0;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 0;
}

}  // namespace megamoe
