// Communication benchmark: pulling token rows from a peer's symmetric buffer (TMA bulk copies, and
// 16-byte vector loads) at MoE dispatch sizes, against a peer-copy ceiling and an HBM-copy ceiling
// measured in the same run (and against a peer copy of the same size), and the cross-rank barrier's
// round trip. FP8 rows are pulled as the layer keeps them: the 7168-byte E4M3 row from one region and
// its 224 bytes of 1x128 scales from another.
//
// With two or more Hopper GPUs it runs one NCCL process on each of GPUs 0 and 1; with one, two
// emulated ranks share it (rows then say "emulated": true, and "peer" memory is the same GPU's).
// Rank 0 pulls from rank 1 while rank 1 waits; both take part in the barrier measurement.
//
//   megamoe_comm_bench [--out FILE.json] [--commit SHA] [--repeats N] [--emulated]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "comm/check.h"
#include "comm/launcher.h"
#include "comm/rank_barrier.h"
#include "kernels/comm/pull_kernels.cuh"
#include "kernels/comm/sync.cuh"
#include "megamoe/comm.h"
#include "megamoe/error.h"

namespace megamoe {
namespace {

using detail::concat;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kLargestPull = 256 * kMiB;
constexpr uint32_t kFp8RowBytes = 7168;       // an E4M3 row of hidden 7168
constexpr uint32_t kFp8ScaleBytes = 56 * 4;    // its 1x128 f32 scales, in their own region
constexpr uint32_t kBf16RowBytes = 7168 * 2;
constexpr uint32_t kBarrierIterations = 2000;
constexpr int kStandaloneBarriers = 100;

struct Options {
  std::string out;
  std::string commit;
  std::string command;
  int repeats = 15;
  bool emulated = false;
};

struct Row {
  std::string kind;
  uint64_t bytes = 0;
  uint32_t row_bytes = 0;
  uint32_t scale_bytes = 0;     // per row, pulled from the scales' own region
  double us = 0;
  double gbps = 0;
  double ratio = 0;             // to the peer-copy ceiling
  double same_size_ratio = 0;   // to a peer copy of the same nominal size, timed in the same run
  double standalone_us = 0;     // barrier only
};

// ---- Kernels ----

__device__ uint32_t source_word(int32_t rank, uint64_t index) {
  uint32_t x = static_cast<uint32_t>(index) * 2654435761U + static_cast<uint32_t>(rank) * 40503U + 1U;
  x ^= x >> 15;
  x *= 0x2c1b3c6dU;
  return x ^ (x >> 12);
}

__global__ void fill_source_kernel(uint32_t* words, uint64_t count, int32_t rank) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < count; i += uint64_t{gridDim.x} * blockDim.x) {
    words[i] = source_word(rank, i);
  }
}

__global__ void count_wrong_kernel(const uint32_t* words, uint64_t count, int32_t source, unsigned long long* wrong) {
  unsigned long long local = 0;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < count; i += uint64_t{gridDim.x} * blockDim.x) {
    local += words[i] != source_word(source, i);
  }
  if (local != 0) atomicAdd(wrong, local);
}

__global__ void __launch_bounds__(32) barrier_loop_kernel(SymmView view, BufferLayout layout, uint32_t iterations) {
  for (uint32_t i = 0; i < iterations; ++i) {
    if (!device::rank_barrier(view, layout)) return;
  }
}

// ---- Host helpers ----

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t middle = values.size() / 2;
  return values.size() % 2 == 1 ? values[middle] : (values[middle - 1] + values[middle]) / 2;
}

// Median over `repeats` of the microseconds per call of `launch`, each repeat timing `inner`
// back-to-back calls between two events (after two warm-up calls).
double time_us(cudaStream_t stream, int repeats, int inner, const std::function<void()>& launch) {
  cudaEvent_t start = nullptr, stop = nullptr;
  MEGAMOE_CHECK_CUDA(cudaEventCreate(&start));
  MEGAMOE_CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<double> samples;
  try {
    launch();
    launch();
    for (int r = 0; r < repeats; ++r) {
      MEGAMOE_CHECK_CUDA(cudaEventRecord(start, stream));
      for (int i = 0; i < inner; ++i) launch();
      MEGAMOE_CHECK_CUDA(cudaEventRecord(stop, stream));
      MEGAMOE_CHECK_CUDA(cudaEventSynchronize(stop));
      float ms = 0;
      MEGAMOE_CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      samples.push_back(1000.0 * ms / inner);
    }
  } catch (...) {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    throw;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return median(samples);
}

double gbps(uint64_t bytes, double us) { return static_cast<double>(bytes) / (us * 1e3); }

// Enough back-to-back calls that launch gaps do not dominate small transfers.
int inner_calls(uint64_t bytes) { return static_cast<int>(std::clamp<uint64_t>(64 * kMiB / bytes, 1, 32)); }

// Problem whose x and l1_pool regions each hold kLargestPull bytes: rank 0 pulls from rank 1's x into
// its own l1_pool.
Problem bench_problem(const Communicator& comm) {
  Problem p;
  p.num_ranks = comm.size();
  p.rank = comm.rank();
  p.num_experts = comm.size();
  p.top_k = 1;
  p.hidden = 7168;
  p.intermediate = 128;
  p.recipe = Recipe::bf16;
  p.max_tokens_per_rank = static_cast<int32_t>((kLargestPull + kBf16RowBytes - 1) / kBf16RowBytes);
  return p;
}

std::string iso_date_utc() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

std::string json_number(double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.3f", value);
  return text;
}

// ---- The measurements ----

struct Results {
  double hbm_copy_gbps = 0;
  double peer_copy_gbps = 0;
  std::vector<Row> rows;
};

// Rank 0 only: ceilings and pulls from rank 1.
void measure_pulls(Communicator& comm, SymmBuffer& buffer, const Options& options, Results& results) {
  cudaStream_t stream = comm.stream();
  const SymmView& view = buffer.view();
  const BufferLayout& layout = buffer.layout();
  const int32_t source = 1 % comm.size();
  const char* peer_x = view.peers[source] + layout.x.offset;
  char* local_x = view.local() + layout.x.offset;
  char* pool = view.local() + layout.l1_pool.offset;

  auto copy = [&](void* dst, const void* src, uint64_t bytes) {
    return [=] { MEGAMOE_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream)); };
  };
  results.hbm_copy_gbps = 2 * gbps(kLargestPull, time_us(stream, options.repeats, 1, copy(pool, local_x, kLargestPull)));
  const double peer_copy_us = time_us(stream, options.repeats, 1, copy(pool, peer_x, kLargestPull));
  results.peer_copy_gbps = gbps(kLargestPull, peer_copy_us);

  std::vector<double> peer_copy_gbps_by_size;
  for (uint64_t total = kMiB; total <= kLargestPull; total *= 4) {
    Row row{"peer_copy", total};
    row.us = total == kLargestPull ? peer_copy_us
                                   : time_us(stream, options.repeats, inner_calls(total), copy(pool, peer_x, total));
    row.gbps = gbps(total, row.us);
    row.ratio = row.gbps / results.peer_copy_gbps;
    row.same_size_ratio = 1;
    peer_copy_gbps_by_size.push_back(row.gbps);
    results.rows.push_back(row);
  }

  const int blocks = comm.sm_budget();
  for (device::PullMethod method : {device::PullMethod::bulk, device::PullMethod::vector}) {
    const char* kind = method == device::PullMethod::bulk ? "pull_tma" : "pull_ld";
    for (const auto [row_bytes, scale_bytes] : {std::pair{kFp8RowBytes, kFp8ScaleBytes}, std::pair{kBf16RowBytes, 0u}}) {
      const uint32_t item_bytes = row_bytes + scale_bytes;
      // `rows` rows back to back in both buffers, their scales (if any) right after them: the pulled
      // bytes are then a contiguous copy of the source's first rows * item_bytes.
      auto items = [&](uint32_t rows) {
        const uint64_t scales_at = uint64_t{rows} * row_bytes;
        return device::PulledRows{{peer_x, pool, row_bytes}, {peer_x + scales_at, pool + scales_at, scale_bytes}};
      };
      auto pull = [&](uint32_t rows) {
        return [&, rows, map = items(rows)] {
          MEGAMOE_CHECK_CUDA(device::launch_pull_rows(method, map, rows, blocks, stream));
        };
      };
      // The largest pull must deliver exactly rank 1's bytes before any of it is timed.
      const uint32_t most_rows = static_cast<uint32_t>(kLargestPull / item_bytes);
      const uint64_t most_bytes = uint64_t{most_rows} * item_bytes;
      MEGAMOE_CHECK_CUDA(cudaMemsetAsync(pool, 0, most_bytes, stream));
      pull(most_rows)();
      unsigned long long* wrong = nullptr;
      MEGAMOE_CHECK_CUDA(cudaMallocAsync(&wrong, sizeof(*wrong), stream));
      MEGAMOE_CHECK_CUDA(cudaMemsetAsync(wrong, 0, sizeof(*wrong), stream));
      count_wrong_kernel<<<blocks, 256, 0, stream>>>(reinterpret_cast<const uint32_t*>(pool), most_bytes / 4, source,
                                                     wrong);
      MEGAMOE_CHECK_CUDA(cudaGetLastError());
      unsigned long long wrong_words = 0;
      MEGAMOE_CHECK_CUDA(cudaMemcpyAsync(&wrong_words, wrong, sizeof(wrong_words), cudaMemcpyDeviceToHost, stream));
      MEGAMOE_CHECK_CUDA(cudaFreeAsync(wrong, stream));
      MEGAMOE_CHECK_CUDA(cudaStreamSynchronize(stream));
      if (wrong_words != 0) {
        throw Error(concat(kind, " of ", most_rows, " rows of ", item_bytes, " bytes delivered ", wrong_words,
                           " wrong words"));
      }
      size_t size_index = 0;
      for (uint64_t total = kMiB; total <= kLargestPull; total *= 4, ++size_index) {
        const uint32_t rows = static_cast<uint32_t>(total / item_bytes);
        Row row{kind, uint64_t{rows} * item_bytes, row_bytes, scale_bytes};
        row.us = time_us(stream, options.repeats, inner_calls(row.bytes), pull(rows));
        row.gbps = gbps(row.bytes, row.us);
        row.ratio = row.gbps / results.peer_copy_gbps;
        row.same_size_ratio = row.gbps / peer_copy_gbps_by_size[size_index];
        results.rows.push_back(row);
      }
    }
  }
}

// Every rank: in-kernel barrier round trips, and the standalone barrier kernel back to back.
Row measure_barrier(Communicator& comm, SymmBuffer& buffer, const Options& options) {
  cudaStream_t stream = comm.stream();
  comm.barrier();
  Row row{"barrier"};
  row.us = time_us(stream, options.repeats, 1, [&] {
    barrier_loop_kernel<<<1, 32, 0, stream>>>(buffer.view(), buffer.layout(), kBarrierIterations);
    MEGAMOE_CHECK_CUDA(cudaGetLastError());
  }) / kBarrierIterations;
  row.standalone_us = time_us(stream, options.repeats, kStandaloneBarriers, [&] { launch_rank_barrier(buffer, stream); });
  buffer.check_device_error(stream);
  return row;
}

void print_table(const Results& results, const std::string& mode) {
  std::printf("megamoe comm benchmark (%s)\n", mode.c_str());
  std::printf("ceilings: HBM copy %.1f GB/s (read + write), peer copy %.1f GB/s\n", results.hbm_copy_gbps,
              results.peer_copy_gbps);
  std::printf("%-10s %12s %9s %12s %10s %9s %10s\n", "kind", "bytes", "row", "us", "GB/s", "of peer",
              "same size");
  for (const Row& row : results.rows) {
    if (row.kind == "barrier") {
      std::printf("%-10s %12s %9s %12.3f  (standalone barrier kernel: %.3f us)\n", row.kind.c_str(), "", "", row.us,
                  row.standalone_us);
      continue;
    }
    const std::string row_text =
        row.row_bytes == 0 ? "" : concat(row.row_bytes, row.scale_bytes ? concat("+", row.scale_bytes) : "");
    std::printf("%-10s %12llu %9s %12.2f %10.1f %8.1f%% %9.1f%%\n", row.kind.c_str(),
                static_cast<unsigned long long>(row.bytes), row_text.c_str(), row.us, row.gbps, 100 * row.ratio,
                100 * row.same_size_ratio);
  }
}

void write_json(const Results& results, const Options& options, const std::string& device, const std::string& mode,
                bool emulated) {
  std::ostringstream out;
  out << "{\n  \"benchmark\": \"comm\",\n  \"commit\": " << json_string(options.commit) << ",\n  \"device\": "
      << json_string(device) << ",\n  \"command\": " << json_string(options.command)
      << ",\n  \"date\": " << json_string(iso_date_utc()) << ",\n  \"mode\": " << json_string(mode)
      << ",\n  \"ceilings\": {\"hbm_copy_gbps\": " << json_number(results.hbm_copy_gbps)
      << ", \"peer_copy_gbps\": " << json_number(results.peer_copy_gbps)
      << ", \"fp8_dense_tflops\": null, \"bf16_dense_tflops\": null},\n  \"rows\": [\n";
  for (size_t i = 0; i < results.rows.size(); ++i) {
    const Row& row = results.rows[i];
    out << "    {\"kind\": " << json_string(row.kind);
    if (row.kind == "barrier") {
      out << ", \"us\": " << json_number(row.us) << ", \"iterations\": " << kBarrierIterations
          << ", \"standalone_kernel_us\": " << json_number(row.standalone_us);
    } else {
      out << ", \"bytes\": " << row.bytes;
      if (row.row_bytes != 0) out << ", \"row_bytes\": " << row.row_bytes;
      if (row.scale_bytes != 0) out << ", \"scale_bytes\": " << row.scale_bytes;
      out << ", \"gbps\": " << json_number(row.gbps) << ", \"us\": " << json_number(row.us)
          << ", \"ratio_to_peer_copy\": " << json_number(row.ratio)
          << ", \"ratio_to_same_size_peer_copy\": " << json_number(row.same_size_ratio);
    }
    out << ", \"emulated\": " << (emulated ? "true" : "false") << "}" << (i + 1 < results.rows.size() ? "," : "")
        << "\n";
  }
  out << "  ]\n}\n";
  std::FILE* file = std::fopen(options.out.c_str(), "w");
  if (file == nullptr) throw Error(concat("cannot write ", options.out));
  const std::string text = out.str();
  const bool written = std::fwrite(text.data(), 1, text.size(), file) == text.size();
  if (std::fclose(file) != 0 || !written) throw Error(concat("cannot write ", options.out));
  std::printf("wrote %s\n", options.out.c_str());
}

void run_benchmark(Communicator& comm, const Options& options) {
  SymmBuffer buffer(comm, bench_problem(comm));
  const BufferLayout& layout = buffer.layout();
  require(layout.x.bytes >= kLargestPull && layout.l1_pool.bytes >= kLargestPull, "bench_problem",
          "x and l1_pool must each hold ", kLargestPull, " bytes");
  cudaStream_t stream = comm.stream();
  fill_source_kernel<<<comm.sm_budget(), 256, 0, stream>>>(reinterpret_cast<uint32_t*>(buffer.local() + layout.x.offset),
                                                          layout.x.bytes / 4, comm.rank());
  MEGAMOE_CHECK_CUDA(cudaGetLastError());
  MEGAMOE_CHECK_CUDA(cudaStreamSynchronize(stream));
  comm.barrier();

  Results results;
  if (comm.rank() == 0) measure_pulls(comm, buffer, options, results);
  results.rows.push_back(measure_barrier(comm, buffer, options));
  if (comm.rank() != 0) return;

  cudaDeviceProp prop{};
  MEGAMOE_CHECK_CUDA(cudaGetDeviceProperties(&prop, comm.device()));
  const int gpus = comm.emulated() ? 1 : comm.size();
  const std::string device = concat(prop.name, " x ", gpus);
  const std::string mode = comm.emulated() ? concat("emulated: ", comm.size(), " ranks on one GPU, ", comm.sm_budget(),
                                                    " multiprocessors each")
                                           : concat("processes: NCCL, one rank per GPU");
  print_table(results, mode);
  if (!options.out.empty()) write_json(results, options, device, mode, comm.emulated());
}

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 0; i < argc; ++i) options.command += (i ? " " : "") + std::string(argv[i]);
  if (const char* commit = std::getenv("MEGAMOE_COMMIT")) options.commit = commit;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw Error(concat(arg, ": needs a value"));
      return argv[++i];
    };
    if (arg == "--out") {
      options.out = value();
    } else if (arg == "--commit") {
      options.commit = value();
    } else if (arg == "--repeats") {
      options.repeats = std::stoi(value());
      require(options.repeats >= 10, "--repeats", "must be at least 10, got ", options.repeats);
    } else if (arg == "--emulated") {
      options.emulated = true;
    } else {
      throw Error(concat("unknown argument '", arg,
                         "'; usage: megamoe_comm_bench [--out FILE.json] [--commit SHA] [--repeats N] [--emulated]"));
    }
  }
  if (options.commit.empty()) options.commit = "unknown";
  return options;
}

}  // namespace
}  // namespace megamoe

int main(int argc, char** argv) {
  using namespace megamoe;
  try {
    const Options options = parse(argc, argv);
    // Counted in a child: this process must stay free of CUDA to fork NCCL ranks.
    const int gpus = count_hopper_gpus_in_child();
    if (gpus == 0) {
      std::fprintf(stderr, "megamoe_comm_bench: no Hopper GPU\n");
      return 2;
    }
    const LaunchMode mode = gpus >= 2 && !options.emulated ? LaunchMode::processes : LaunchMode::emulated;
    const int failed = run_ranks(2, mode, [&](Communicator& comm) { run_benchmark(comm, options); });
    return failed == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "megamoe_comm_bench: %s\n", e.what());
    return 1;
  }
}
