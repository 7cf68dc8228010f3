// megamoe: runs one MoE layer of a model preset on synthetic data and prints a summary (run), prints
// the buffer a problem needs (info), benchmarks the layer against an unfused baseline (bench, which
// runs bench/layer's binary), or calls it many times against the CPU reference (soak, bench/soak's).
// Exit codes: 0 success, 1 the run failed, 2 bad command line.

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "cli/backend.h"
#include "cli/dump.h"
#include "cli/estimate.h"
#include "cli/flags.h"
#include "megamoe/error.h"
#include "megamoe/formats.h"
#include "megamoe/layout.h"
#include "megamoe/presets.h"
#include "megamoe/synthetic.h"

namespace megamoe::cli {
namespace {

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

const char* run_usage() {
  return "  megamoe run --preset NAME [--tokens N] [--ranks R] [--recipe fp8|fp8_fp4|bf16]\n"
         "              [--routing uniform|zipf|one_expert] [--backend auto|cpu|gpu] [--seed S]\n"
         "              [--threads T] [--dump DIR] [--recv-capacity ROUTES]\n"
         "\n"
         "Runs one expert-parallel MoE layer on all ranks of one process with synthetic weights and\n"
         "tokens, and prints receive counts, output checksums and timings. A problem that does not fit\n"
         "in memory (host memory for cpu, GPU memory for gpu) is refused before any work.\n"
         "  --preset   model layer shape (below)\n"
         "  --tokens   tokens per rank (default: the preset's)\n"
         "  --ranks    expert-parallel ranks; must divide the number of experts (default: the preset's)\n"
         "  --recipe   precision recipe (default: the preset's)\n"
         "  --routing  how tokens pick experts (default uniform)\n"
         "  --backend  cpu: the FP32 reference; gpu: the fused kernels; auto: gpu when usable (default)\n"
         "  --seed     seed of the synthetic data (default 1)\n"
         "  --threads  CPU backend worker threads, 0 = all (default 0)\n"
         "  --dump     write inputs, outputs and used expert weights as .npy files and manifest.json\n"
         "             (tools/check_dump.py DIR recomputes y from them)\n"
         "  --recv-capacity  routes one rank's pools hold per wave (default 0: the worst case); a wave\n"
         "             that sends some rank more is refused, with an error naming the rank\n"
         "  --wave-tokens  tokens per rank of one wave (Problem::wave_tokens); a smaller wave shrinks\n"
         "             the buffer, and a call of more tokens runs in several. Default 0: the whole\n"
         "             call when its buffer fits 1.5 GiB, else the fewest waves that fit, but none\n"
         "             under 512 expected rows per expert; --tokens or more: always one wave\n";
}

const char* info_usage() {
  return "  megamoe info --preset NAME [--tokens N] [--ranks R] [--recipe fp8|fp8_fp4|bf16]\n"
         "               [--recv-capacity ROUTES] [--wave-tokens N]\n"
         "\n"
         "Prints the symmetric buffer one rank allocates for this problem, region by region, and its\n"
         "total, with the memory a run of it needs. Nothing is computed.\n"
         "  --tokens         the most tokens per rank of one call (default: the preset's)\n"
         "  --recv-capacity  routes one rank's pools hold per wave (Problem::recv_capacity; default 0:\n"
         "                   the worst case). A wave that sends some rank more is refused on every rank.\n"
         "  --wave-tokens    tokens per rank of one wave (Problem::wave_tokens). The buffer holds one\n"
         "                   wave; a call of more tokens runs in waves. Default 0: the whole call when\n"
         "                   its buffer fits 1.5 GiB, else the fewest waves that fit, but none under\n"
         "                   512 expected rows per expert; --tokens or more: always one wave.\n";
}

const char* bench_usage() {
  return "  megamoe bench --preset NAME [...] --out FILE\n"
         "\n"
         "Times the whole layer against an unfused baseline on Hopper GPUs and writes the results as\n"
         "JSON (bench/layer's megamoe_layer_bench, built by the test command; 'megamoe bench --help'\n"
         "lists its flags).\n";
}

const char* soak_usage() {
  return "  megamoe soak --out FILE [...]\n"
         "\n"
         "Calls the layer many times on Hopper GPUs (sizes, masked routes and skewed routing cycling, eager\n"
         "and CUDA graphs, both schedules), checks outputs and receive statistics against the CPU reference\n"
         "and writes the results as JSON (bench/soak's megamoe_soak; 'megamoe soak --help' lists its flags).\n";
}

void print_presets(std::ostream& out) {
  out << "presets:\n";
  for (const Preset& preset : all_presets()) {
    char line[160];
    std::snprintf(line, sizeof(line), "  %-16s %3d experts, top-%d, hidden %d, intermediate %d, %d shared, %s\n",
                  std::string(preset.name).c_str(), preset.num_experts, preset.top_k, preset.hidden,
                  preset.intermediate, preset.num_shared_experts, std::string(to_string(preset.recipe)).c_str());
    out << line;
  }
}

void print_usage(std::ostream& out) {
  out << "usage:\n" << run_usage() << "\n" << info_usage() << "\n" << bench_usage() << "\n" << soak_usage()
      << "\n  megamoe help\n\n";
  print_presets(out);
}

struct RunOptions {
  const Preset* preset = nullptr;
  Problem problem;
  int32_t tokens = 0;
  Routing routing = Routing::uniform;
  BackendKind backend = BackendKind::automatic;
  uint64_t seed = 1;
  int threads = 0;
  std::optional<std::string> dump_dir;
};

// Throws megamoe::Error naming the flag for anything the command line gets wrong.
RunOptions parse_run(const std::vector<std::string>& args) {
  const Flags flags(args, {"--preset", "--tokens", "--ranks", "--recipe", "--routing", "--backend", "--seed",
                           "--threads", "--dump", "--recv-capacity", "--wave-tokens"});

  RunOptions options;
  options.preset = &preset_flag(flags);
  const Preset& preset = *options.preset;
  options.tokens = preset.default_tokens;
  if (auto text = flags.value("--tokens")) options.tokens = parse_number<int32_t>("--tokens", *text, 0, 1 << 20);
  const int32_t ranks = ranks_flag(flags, preset);
  options.problem = preset_problem(preset, ranks, std::max<int32_t>(options.tokens, 1));
  if (auto text = flags.value("--recipe")) {
    require(parse_recipe(*text, options.problem.recipe), "--recipe", "must be fp8, fp8_fp4 or bf16, got '", *text,
            "'");
  }
  if (auto text = flags.value("--routing")) {
    require(parse_routing(*text, options.routing), "--routing", "must be uniform, zipf or one_expert, got '", *text,
            "'");
  }
  if (auto text = flags.value("--backend")) {
    require(parse_backend(*text, options.backend), "--backend", "must be auto, cpu or gpu, got '", *text, "'");
  }
  if (auto text = flags.value("--seed")) options.seed = parse_number<uint64_t>("--seed", *text, 0, UINT64_MAX);
  if (auto text = flags.value("--threads")) options.threads = parse_number<int>("--threads", *text, 0, 1024);
  if (auto text = flags.value("--dump")) {
    require(!text->empty(), "--dump", "needs a directory");
    options.dump_dir = *text;
  }
  if (auto text = flags.value("--recv-capacity"))
    options.problem.recv_capacity = parse_number<int64_t>("--recv-capacity", *text, 0, int64_t{1} << 31);
  if (auto text = flags.value("--wave-tokens"))
    options.problem.wave_tokens = parse_number<int32_t>("--wave-tokens", *text, 0, 1 << 20);
  validate(options.problem);
  return options;
}

// The CPU backend refuses a wave past the receive capacity as the GPU does (which checks on the device).
void check_recv_capacity(const Problem& problem, const std::vector<RankBatch>& batches) {
  if (problem.recv_capacity == 0) return;
  const size_t wave_routes = static_cast<size_t>(tokens_per_wave(problem)) * static_cast<size_t>(problem.top_k);
  for (int32_t wave = 0; wave < waves_per_call(problem); ++wave) {
    std::vector<int64_t> received(static_cast<size_t>(problem.num_ranks), 0);
    for (const RankBatch& batch : batches) {
      const size_t begin = std::min(batch.topk_idx.size(), static_cast<size_t>(wave) * wave_routes);
      const size_t end = std::min(batch.topk_idx.size(), begin + wave_routes);
      for (size_t route = begin; route < end; ++route)
        if (batch.topk_idx[route] >= 0) ++received[static_cast<size_t>(problem.owner_rank(batch.topk_idx[route]))];
    }
    for (int32_t rank = 0; rank < problem.num_ranks; ++rank)
      require(received[rank] <= problem.recv_capacity, "--recv-capacity", "rank ", rank, " receives ", received[rank],
              " routes in wave ", wave, ", more than its receive capacity ", problem.recv_capacity,
              ": the wave is refused on every rank (raise it, or leave it 0 for the worst case)");
  }
}

struct InfoOptions {
  const Preset* preset = nullptr;
  Problem problem;
};

InfoOptions parse_info(const std::vector<std::string>& args) {
  const Flags flags(args, {"--preset", "--tokens", "--ranks", "--recipe", "--recv-capacity", "--wave-tokens"});
  InfoOptions options;
  options.preset = &preset_flag(flags);
  int32_t tokens = options.preset->default_tokens;
  if (auto text = flags.value("--tokens")) tokens = parse_number<int32_t>("--tokens", *text, 1, 1 << 20);
  options.problem = preset_problem(*options.preset, ranks_flag(flags, *options.preset), tokens);
  if (auto text = flags.value("--recipe")) {
    require(parse_recipe(*text, options.problem.recipe), "--recipe", "must be fp8, fp8_fp4 or bf16, got '", *text,
            "'");
  }
  if (auto text = flags.value("--recv-capacity"))
    options.problem.recv_capacity = parse_number<int64_t>("--recv-capacity", *text, 0, int64_t{1} << 31);
  if (auto text = flags.value("--wave-tokens"))
    options.problem.wave_tokens = parse_number<int32_t>("--wave-tokens", *text, 0, 1 << 20);
  validate(options.problem);
  return options;
}

// `megamoe info`: the buffer's regions (BufferLayout::for_each_region) and what a run needs.
int info(const InfoOptions& options) {
  const Problem& p = options.problem;
  const BufferLayout layout = BufferLayout::make(p);
  std::printf("preset: %s\n", std::string(options.preset->name).c_str());
  std::printf("problem: %s\n", describe(p).c_str());
  std::printf("run needs: gpu backend about %s per GPU (one rank per GPU), %s on one GPU with %d emulated ranks;\n"
              "           cpu backend about %s of host memory\n",
              format_bytes(gpu_run_device_bytes(p, p.max_tokens_per_rank, false)).c_str(),
              format_bytes(gpu_run_device_bytes(p, p.max_tokens_per_rank, true)).c_str(), p.num_ranks,
              format_bytes(cpu_run_host_bytes(p, p.max_tokens_per_rank, 0)).c_str());
  std::printf("symmetric buffer of one rank (%u pool rows for %u received routes, %u tokens per wave, %d %s per "
              "call):\n",
              layout.pool_rows, layout.recv_capacity, layout.wave_tokens, waves_per_call(p),
              waves_per_call(p) == 1 ? "wave" : "waves");
  if (p.wave_tokens == 0) {
    // Why the default wave is what it is (tokens_per_wave in layout.h).
    const double gib = double(1ull << 30);
    const uint64_t whole = BufferLayout::make(p, p.max_tokens_per_rank).total_bytes;
    if (waves_per_call(p) > 1)
      std::printf("default wave: the whole call would take %.2f GiB, over the %.2f GiB default (--wave-tokens %d: one "
                  "wave)\n",
                  whole / gib, kDefaultBufferBytes / gib, p.max_tokens_per_rank);
    if (layout.total_bytes > kDefaultBufferBytes)
      std::printf("default wave: over the %.2f GiB default, since smaller waves would expect fewer than %llu rows per "
                  "routed expert\n",
                  kDefaultBufferBytes / gib, static_cast<unsigned long long>(kMinWaveRowsPerExpert));
  }
  layout.for_each_region([](const char* name, const Region& region) {
    std::printf("  %-18s %16llu bytes %12.2f MiB\n", name, static_cast<unsigned long long>(region.bytes),
                static_cast<double>(region.bytes) / (1 << 20));
  });
  std::printf("total: %.2f GiB\n", static_cast<double>(layout.total_bytes) / (1ull << 30));
  return 0;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// A carriage-return progress line on stderr, shown once the work has lasted a second.
class ProgressLine {
 public:
  explicit ProgressLine(std::string label) : label_(std::move(label)), start_(std::chrono::steady_clock::now()) {}

  void update(int64_t done, int64_t total, const std::string& units) {
    const double elapsed = seconds_since(start_);
    if (elapsed < 1.0 || (done < total && elapsed - last_print_ < 0.1)) return;
    last_print_ = elapsed;
    std::fprintf(stderr, "\r%s: %lld/%lld %s (%3.0f%%), %.1f s", label_.c_str(), static_cast<long long>(done),
                 static_cast<long long>(total), units.c_str(), total > 0 ? 100.0 * done / total : 100.0, elapsed);
    std::fflush(stderr);
    shown_ = true;
  }

  void finish() {
    if (shown_) std::fputc('\n', stderr);
    shown_ = false;
  }

 private:
  std::string label_;
  std::chrono::steady_clock::time_point start_;
  double last_print_ = -1.0;
  bool shown_ = false;
};

uint64_t fnv1a_bf16(const std::vector<uint16_t>& values) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (uint16_t value : values) {
    for (int byte = 0; byte < 2; ++byte) {
      hash ^= (value >> (8 * byte)) & 0xFFu;
      hash *= 0x100000001b3ull;
    }
  }
  return hash;
}

void print_recv_counts(const Problem& p, const std::vector<std::vector<uint32_t>>& counts) {
  const int32_t per_rank = p.experts_per_rank();
  std::printf("receive counts (routes each local expert received from all ranks):\n");
  for (int32_t r = 0; r < p.num_ranks; ++r) {
    const std::vector<uint32_t>& c = counts[static_cast<size_t>(r)];
    uint64_t total = 0;
    for (uint32_t n : c) total += n;
    if (per_rank <= 16) {
      std::printf("  rank %d (experts %d..%d):", r, r * per_rank, (r + 1) * per_rank - 1);
      for (uint32_t n : c) std::printf(" %u", n);
      std::printf("  (total %llu)\n", static_cast<unsigned long long>(total));
      continue;
    }
    const auto [min_it, max_it] = std::minmax_element(c.begin(), c.end());
    std::vector<int32_t> order(c.size());
    for (size_t l = 0; l < order.size(); ++l) order[l] = static_cast<int32_t>(l);
    std::stable_sort(order.begin(), order.end(), [&c](int32_t a, int32_t b) { return c[a] > c[b]; });
    std::printf("  rank %d: %d experts, total %llu, min %u, mean %.2f, max %u; busiest:", r, per_rank,
                static_cast<unsigned long long>(total), *min_it, static_cast<double>(total) / per_rank, *max_it);
    for (size_t i = 0; i < std::min<size_t>(4, order.size()); ++i) {
      std::printf(" e%d=%u", r * per_rank + order[i], c[static_cast<size_t>(order[i])]);
    }
    std::printf("\n");
  }
}

void print_checksums(const Problem& p, const std::vector<std::vector<uint16_t>>& y) {
  std::printf("output checksums (y in BF16; hash = FNV-1a 64 of the little-endian BF16 bits):\n");
  for (int32_t r = 0; r < p.num_ranks; ++r) {
    const std::vector<uint16_t>& values = y[static_cast<size_t>(r)];
    double sum = 0.0;
    for (uint16_t value : values) sum += bf16_to_float(value);
    std::printf("  rank %d: %zu tokens, sum %.6g, hash 0x%016llx\n", r, values.size() / static_cast<size_t>(p.hidden),
                static_cast<float>(sum), static_cast<unsigned long long>(fnv1a_bf16(values)));
  }
}

// Refuses, before any work, a run whose memory need exceeds what the machine has.
void check_fits(const RunOptions& options, const BackendChoice& choice) {
  const Problem& p = options.problem;
  const std::string subject = std::string(options.preset->name) + " with " + std::to_string(p.num_ranks) +
                              " ranks x " + std::to_string(options.tokens) + " tokens";
  if (choice.kind == BackendKind::cpu) {
    require_fits(subject + " on the cpu backend", "host memory", cpu_run_host_bytes(p, options.tokens, options.threads),
                 available_host_bytes());
    return;
  }
  require(choice.gpus.hopper_gpus >= 1, "--backend gpu", "needs a Hopper GPU; found none");
  const bool emulated = choice.gpus.hopper_gpus < p.num_ranks;
  require_fits(subject + " on the gpu backend" + (emulated ? " (ranks emulated on GPU 0)" : ""), "GPU memory",
               gpu_run_device_bytes(p, options.tokens, emulated), choice.gpus.min_memory_bytes);
  require_fits(subject + " on the gpu backend", "host memory", gpu_run_host_bytes(p, options.tokens),
               available_host_bytes());
}

// Everything that can refuse the run does so before any work: the dump directory, the backend, memory.
BackendChoice preflight(const RunOptions& options) {
  if (options.dump_dir) prepare_dump_dir(*options.dump_dir);
  const BackendChoice choice = choose_backend(options.backend);
  check_fits(options, choice);
  return choice;
}

int run(const RunOptions& options, const BackendChoice& choice) {
  const Problem& problem = options.problem;
  std::printf("preset: %s (%s)\n", std::string(options.preset->name).c_str(),
              std::string(options.preset->note).c_str());
  std::printf("problem: %s\n", describe(problem).c_str());
  const BufferLayout layout = BufferLayout::make(problem);
  std::printf("buffer: %.2f GiB per rank (pools for %u received routes)\n",
              static_cast<double>(layout.total_bytes) / (1ull << 30), layout.recv_capacity);
  std::printf("data: %d tokens on each of %d ranks, routing %s, seed %llu\n", options.tokens, problem.num_ranks,
              std::string(to_string(options.routing)).c_str(), static_cast<unsigned long long>(options.seed));
  std::printf("backend: %s (%s)\n", std::string(to_string(choice.kind)).c_str(), choice.reason.c_str());
  std::fflush(stdout);

  const auto data_start = std::chrono::steady_clock::now();
  const std::vector<int32_t> tokens(static_cast<size_t>(problem.num_ranks), options.tokens);
  const std::vector<RankBatch> batches = synthetic_batches(problem, tokens, options.routing, options.seed);
  const SyntheticWeights weights(problem, options.seed);
  const double data_seconds = seconds_since(data_start);
  if (choice.kind == BackendKind::cpu) check_recv_capacity(problem, batches);
  if (options.dump_dir) {
    std::error_code error;
    const std::filesystem::space_info space = std::filesystem::space(*options.dump_dir, error);
    require_fits("--dump " + *options.dump_dir, "disk", dump_bytes(problem, batches), error ? 0 : space.available);
  }

  const auto compute_start = std::chrono::steady_clock::now();
  ProgressLine progress("compute");
  BackendOptions backend_options;
  backend_options.threads = options.threads;
  backend_options.activation_clamp = options.preset->activation_clamp;
  const std::string units = choice.kind == BackendKind::cpu ? "experts" : "steps";
  backend_options.progress = [&progress, &units](int64_t done, int64_t total) { progress.update(done, total, units); };
  BackendResult outcome;
  try {
    outcome = run_backend(choice.kind, problem, batches, weights, backend_options);
  } catch (...) {
    progress.finish();
    throw;
  }
  progress.finish();
  const double compute_seconds = seconds_since(compute_start);

  print_recv_counts(problem, outcome.result.recv_counts);
  print_checksums(problem, outcome.result.y);

  double dump_seconds = 0.0;
  if (options.dump_dir) {
    const auto dump_start = std::chrono::steady_clock::now();
    const DumpInfo info{std::string(options.preset->name), outcome.name, options.routing, options.seed};
    ProgressLine dump_progress("dump");
    const int files = write_dump(*options.dump_dir, info, problem, batches, outcome.result, weights,
                                 [&dump_progress](int64_t done, int64_t total) {
                                   dump_progress.update(done, total, "experts");
                                 });
    dump_progress.finish();
    dump_seconds = seconds_since(dump_start);
    std::printf("dump: %d files in %s\n", files, options.dump_dir->c_str());
  }
  std::printf("time: data generation %.3f s (activations and routing; weights are generated during compute), "
              "compute %.3f s",
              data_seconds, compute_seconds);
  if (options.dump_dir) std::printf(", dump %.3f s", dump_seconds);
  std::printf("\n");
  return 0;
}

// The layer benchmark and the soak run are their own binaries (bench/layer, bench/soak), so that this
// tool builds without them: `binary` is looked for beside this one, then where the build puts it
// (bench/<folder>/), and runs in place of this process with `args`.
int companion_main(const char* command, const char* binary, const char* folder, const char* usage,
                   const std::vector<std::string>& args) {
  std::error_code error;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
  const std::filesystem::path dir = error ? std::filesystem::path(".") : self.parent_path();
  for (const std::filesystem::path& candidate : {dir / binary, dir / "bench" / folder / binary}) {
    if (!std::filesystem::exists(candidate)) continue;
    const std::string path = candidate.string();
    std::vector<char*> argv = {const_cast<char*>(path.c_str())};
    for (const std::string& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
    argv.push_back(nullptr);
    execv(path.c_str(), argv.data());
    std::cerr << "megamoe: " << command << ": could not run " << path << ": " << std::strerror(errno) << "\n";
    return kExitFailure;
  }
  const std::string missing = std::string(binary) + " is not built; build it: cmake --build " + dir.string() +
                              " --target " + binary;
  if (wants_help(args)) {
    std::cout << "usage:\n" << usage << "(" << missing << ")\n";
    return 0;
  }
  std::cerr << "megamoe: " << command << ": " << missing << "\n";
  return kExitFailure;
}

// Parses with `parse` (a megamoe::Error is a usage error, exit 2), then runs `body` (exit 1 on error).
template <typename Parse, typename Body>
int command_main(const std::vector<std::string>& args, const char* usage, bool presets, const Parse& parse,
                 const Body& body) {
  if (wants_help(args)) {
    std::cout << "usage:\n" << usage;
    if (presets) {
      std::cout << "\n";
      print_presets(std::cout);
    }
    return 0;
  }
  decltype(parse(args)) options;
  try {
    options = parse(args);
  } catch (const Error& error) {
    std::cerr << "megamoe: " << error.what() << "\n";
    return kExitUsage;
  }
  return body(options);
}

int cli_main(const std::vector<std::string>& args) {
  if (args.empty()) {
    print_usage(std::cerr);
    return kExitUsage;
  }
  const std::string& command = args[0];
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (command == "help" || command == "--help" || command == "-h") {
    print_usage(std::cout);
    return 0;
  }
  if (command == "bench") return companion_main("bench", "megamoe_layer_bench", "layer", bench_usage(), rest);
  if (command == "soak") return companion_main("soak", "megamoe_soak", "soak", soak_usage(), rest);
  if (command == "info") {
    return command_main(rest, info_usage(), true, parse_info, [](const InfoOptions& options) {
      try {
        return info(options);
      } catch (const std::exception& error) {
        std::cerr << "megamoe: error: " << error.what() << "\n";
        return kExitFailure;
      }
    });
  }
  if (command != "run") {
    std::cerr << "megamoe: unknown command '" << command << "' (commands: run, info, bench, soak, help)\n";
    return kExitUsage;
  }
  return command_main(rest, run_usage(), true, parse_run, [](const RunOptions& options) {
    BackendChoice choice;
    try {
      choice = preflight(options);
    } catch (const Error& error) {
      std::cerr << "megamoe: " << error.what() << "\n";
      return kExitUsage;
    }
    try {
      return run(options, choice);
    } catch (const std::exception& error) {
      std::cerr << "megamoe: error: " << error.what() << "\n";
      return kExitFailure;
    }
  });
}

}  // namespace
}  // namespace megamoe::cli

int main(int argc, char** argv) {
  return megamoe::cli::cli_main(std::vector<std::string>(argv + 1, argv + argc));
}
