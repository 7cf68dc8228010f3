#include "bench/soak/soak.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <sstream>

#include "bench/common/report.h"
#include "bench/common/shared_array.h"
#include "cli/flags.h"
#include "comm/launcher.h"
#include "megamoe/comm.h"
#include "megamoe/device_batch.h"
#include "megamoe/device_weights.h"
#include "megamoe/error.h"
#include "megamoe/layer.h"
#include "megamoe/presets.h"
#include "megamoe/reference.h"
#include "megamoe/synthetic.h"
#include "megamoe/token_check.h"

namespace megamoe::soak {
namespace {

using cli::Flags;
using cli::parse_list;
using cli::parse_number;

constexpr int32_t kMaxTokens = 256;  // per rank: the largest input set

// The input sets every variant cycles through: token counts per rank (a pattern repeated over the
// ranks), routing and masked fraction. Empty ranks, one token, the most tokens, every route to one
// expert, half the routes masked.
struct InputSet {
  std::vector<int32_t> tokens_pattern;
  Routing routing;
  float masked_fraction;
};
const InputSet kInputSets[] = {
    {{1, 7}, Routing::uniform, 0.0f},
    {{64, 0}, Routing::zipf, 0.1f},
    {{kMaxTokens, 17}, Routing::one_expert, 0.0f},
    {{0, 2}, Routing::uniform, 0.5f},
    {{200, 200}, Routing::zipf, 0.3f},
    {{33, 1}, Routing::uniform, 0.0f},
};
constexpr size_t kSets = sizeof(kInputSets) / sizeof(kInputSets[0]);

Problem soak_problem(const std::string& name, Recipe recipe, int32_t ranks) {
  Problem p;
  if (name == "tiny") {
    p = preset_problem(find_preset("tiny"), ranks, kMaxTokens);
  } else {  // "mid": more experts, wider rows, still cheap for the CPU reference
    p.num_ranks = ranks;
    p.num_experts = 32;
    p.top_k = 4;
    p.hidden = 1024;
    p.intermediate = 512;
    p.num_shared_experts = 1;
    p.max_tokens_per_rank = kMaxTokens;
  }
  p.recipe = recipe;
  return p;
}

// What one rank saw in one variant; in shared memory, so that rank processes can report it.
struct RankOutcome {
  int64_t calls = 0;
  int64_t checks = 0;       // input sets compared with the reference
  int64_t failures = 0;     // comparisons with a token over its bound, or statistics that differ
  int64_t faults = 0;       // CUDA errors (an illegal address, a launch failure)
  int64_t hangs = 0;        // spin-wait timeouts reported by check_device_error
  double max_error = 0.0;   // the largest per-token normalized error seen
  char first_failure[512] = {};
};

struct Variant {
  std::string problem_name;
  Problem problem;
  Schedule schedule;
  bool graph;
  int64_t calls;
};

// Host data of one (problem, recipe): the inputs of every set, their reference outputs and counts.
struct SetData {
  std::vector<std::vector<RankBatch>> batches;  // [set][rank]
  std::vector<ReferenceResult> references;      // [set]
};

SetData prepare_sets(const Problem& p, const SyntheticWeights& weights, uint64_t seed) {
  SetData data;
  for (size_t s = 0; s < kSets; ++s) {
    const InputSet& set = kInputSets[s];
    std::vector<int32_t> tokens(static_cast<size_t>(p.num_ranks));
    for (size_t r = 0; r < tokens.size(); ++r) tokens[r] = set.tokens_pattern[r % set.tokens_pattern.size()];
    data.batches.push_back(synthetic_batches(p, tokens, set.routing, seed + 1 + s, set.masked_fraction));
    ReferenceOptions with_slots;  // the per-route check needs each route's contribution
    with_slots.keep_slots = true;
    data.references.push_back(reference_moe(p, data.batches.back(), weights, with_slots));
  }
  return data;
}

void cuda_ok(cudaError_t status, const char* what) {
  require(status == cudaSuccess, what, "failed: ", cudaGetErrorString(status));
}

void note_failure(RankOutcome& outcome, const std::string& what) {
  if (outcome.first_failure[0] == '\0')
    std::snprintf(outcome.first_failure, sizeof(outcome.first_failure), "%s", what.c_str());
}

// One rank's calls of one variant. Failures are recorded, not thrown, so that every rank reaches the
// final barrier; a fault or a hang ends the rank's calls (its buffer is unusable afterwards).
void run_rank(Communicator& comm, const Variant& v, const SetData& sets, uint64_t seed, int32_t check_every,
              RankOutcome& outcome) {
  Problem p = v.problem;
  p.rank = comm.rank();
  SymmBuffer buffer(comm, p);
  const auto weights = DeviceWeights::synthetic(p, seed);
  std::vector<std::unique_ptr<DeviceBatch>> inputs;
  std::vector<void*> ys(kSets, nullptr);
  void* stats = nullptr;
  cuda_ok(cudaMalloc(&stats, p.experts_per_rank() * sizeof(int64_t)), "cudaMalloc(stats)");
  cudaStream_t stream = comm.stream();
  for (size_t s = 0; s < kSets; ++s) {
    const RankBatch& batch = sets.batches[s][p.rank];
    inputs.push_back(std::make_unique<DeviceBatch>(p, batch.num_tokens));
    inputs.back()->fill(batch, stream);
    cuda_ok(cudaMalloc(&ys[s], std::max<size_t>(16, size_t(batch.num_tokens) * p.hidden * 2)), "cudaMalloc(y)");
  }
  cuda_ok(cudaMemsetAsync(stats, 0, p.experts_per_rank() * sizeof(int64_t), stream), "cudaMemsetAsync");
  const TensorView stats_view = TensorView::contiguous(stats, DType::i64, {p.experts_per_rank()}, Device::cuda);
  // A call on set s: y poisoned first (NaN bits), so a token the call did not write fails the check.
  const auto call = [&](size_t s) {
    const int32_t tokens = sets.batches[s][p.rank].num_tokens;
    cuda_ok(cudaMemsetAsync(ys[s], 0xFF, size_t(tokens) * p.hidden * 2, stream), "poison y");
    mega_moe(buffer, inputs[s]->inputs(), weights->view(),
             TensorView::contiguous(ys[s], DType::bf16, {tokens, p.hidden}, Device::cuda), stream, stats_view,
             CallOptions{v.schedule});
  };
  std::vector<cudaGraphExec_t> graphs;
  std::vector<int64_t> want_stats(p.experts_per_rank(), 0);
  comm.barrier();  // every rank has allocated before any rank launches
  try {
    if (v.graph) {
      cuda_ok(cudaStreamSynchronize(stream), "inputs");
      for (size_t s = 0; s < kSets; ++s) {
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
        call(s);
        cuda_ok(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
        cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
        cudaGraphDestroy(graph);
        graphs.push_back(exec);
      }
    }
    for (int64_t i = 0; i < v.calls; ++i) {
      const size_t s = static_cast<size_t>(i) % kSets;
      if (v.graph) cuda_ok(cudaGraphLaunch(graphs[s], stream), "cudaGraphLaunch");
      else call(s);
      ++outcome.calls;
      for (size_t e = 0; e < want_stats.size(); ++e) want_stats[e] += sets.references[s].recv_counts[p.rank][e];
      if ((i + 1) % check_every != 0 && i + 1 != v.calls) continue;
      buffer.check_device_error(stream);  // synchronizes; throws for a timeout or a bad expert id
      for (size_t c = 0; c < std::min<size_t>(kSets, static_cast<size_t>(i) + 1); ++c) {
        const ReferenceResult& reference = sets.references[c];
        std::vector<uint16_t> got(reference.y[p.rank].size());
        if (!got.empty())
          cuda_ok(cudaMemcpy(got.data(), ys[c], got.size() * 2, cudaMemcpyDeviceToHost), "download y");
        const TokenCheck check = check_tokens(got, reference.y[p.rank], p.hidden, p.recipe, {},
                                              reference.slots[p.rank], p.combine_slots());
        ++outcome.checks;
        outcome.max_error = std::max(outcome.max_error, check.worst_error);
        if (!check.ok()) {
          ++outcome.failures;
          note_failure(outcome, detail::concat("rank ", p.rank, ", call ", i, ", input set ", c, ": ",
                                               check.failed, " tokens off; ", check.first_failure));
        }
      }
      std::vector<int64_t> got_stats(want_stats.size());
      cuda_ok(cudaMemcpy(got_stats.data(), stats, got_stats.size() * 8, cudaMemcpyDeviceToHost), "download stats");
      if (got_stats != want_stats) {
        ++outcome.failures;
        const size_t e = std::mismatch(got_stats.begin(), got_stats.end(), want_stats.begin()).first - got_stats.begin();
        note_failure(outcome, detail::concat("rank ", p.rank, ", after call ", i, ": local expert ", e, " counted ",
                                             got_stats[e], " routes, the reference ", want_stats[e]));
      }
    }
  } catch (const Error& error) {
    const std::string what = error.what();
    if (what.find("timed out") != std::string::npos) ++outcome.hangs;
    else ++outcome.faults;
    note_failure(outcome, detail::concat("rank ", p.rank, ", call ", outcome.calls, ": ", what));
  }
  for (cudaGraphExec_t exec : graphs) cudaGraphExecDestroy(exec);
  cudaStreamSynchronize(stream);
  try {
    comm.barrier();  // no rank frees while another's kernels may still read its buffer
  } catch (const Error&) {  // the group gave up after a failure, which is recorded
  }
  for (void* y : ys) cudaFree(y);
  cudaFree(stats);
}

}  // namespace

const char* soak_usage() {
  return "  megamoe soak --out FILE [--problems tiny,mid] [--recipes fp8,fp8_fp4,bf16] [--schedules staged,fused]\n"
         "              [--ranks R] [--calls N] [--check-every K] [--seed S]\n"
         "\n"
         "Calls the layer N times on the GPUs (one process per GPU, or ranks emulated on GPU 0 when there\n"
         "are fewer GPUs than ranks), cycling six input sets (0 to 256 tokens per rank, masked routes,\n"
         "uniform, zipf and one-expert routing), eager and replayed from CUDA graphs, in each schedule.\n"
         "Every K calls each set's latest output is compared with the CPU reference token by token, and\n"
         "the receive statistics of all calls so far with the reference's counts. Writes one JSON row per\n"
         "variant (calls, checks, failures, faults, hangs, max_error); exits 1 if any variant failed.\n"
         "  --problems     tiny (the preset) and mid (32 experts, top-4, hidden 1024, intermediate 512)\n"
         "  --recipes      recipes of every problem (default all three)\n"
         "  --schedules    (default both)\n"
         "  --ranks        expert-parallel ranks (default 2)\n"
         "  --calls        layer calls over all variants, split evenly (default 10000)\n"
         "  --check-every  calls between checks against the reference (default 50)\n"
         "  --seed         seed of the synthetic weights and inputs (default 1)\n"
         "  --out          the JSON results file (bench/results/soak-<gpus>x<gpu>-<date>.json)\n";
}

SoakOptions parse_soak(const std::vector<std::string>& args) {
  const Flags flags(args, {"--problems", "--recipes", "--schedules", "--ranks", "--calls", "--check-every", "--seed",
                           "--out"});
  SoakOptions options;
  options.command = "megamoe soak";
  for (const std::string& arg : args) options.command += " " + arg;
  options.problems = parse_list<std::string>(flags, "--problems", {"tiny", "mid"}, "tiny and mid",
                                             [](const std::string& item, std::string& value) {
                                               value = item;
                                               return item == "tiny" || item == "mid";
                                             });
  options.recipes = parse_list<Recipe>(flags, "--recipes", {Recipe::fp8, Recipe::fp8_fp4, Recipe::bf16},
                                       "fp8, fp8_fp4 and bf16",
                                       [](const std::string& item, Recipe& value) { return parse_recipe(item, value); });
  options.schedules = parse_list<Schedule>(
      flags, "--schedules", {Schedule::staged, Schedule::fused}, "staged and fused",
      [](const std::string& item, Schedule& value) { return parse_schedule(item, value); });
  // Both problems have 8 or more experts per power-of-two split up to 8 ranks.
  if (auto text = flags.value("--ranks")) options.ranks = parse_number<int32_t>("--ranks", *text, 1, 8);
  require((options.ranks & (options.ranks - 1)) == 0, "--ranks", "must be 1, 2, 4 or 8 (it divides the experts), got ",
          options.ranks);
  if (auto text = flags.value("--calls")) options.calls = parse_number<int64_t>("--calls", *text, 1, int64_t{1} << 40);
  if (auto text = flags.value("--check-every"))
    options.check_every = parse_number<int32_t>("--check-every", *text, 1, 1 << 30);
  if (auto text = flags.value("--seed")) options.seed = parse_number<uint64_t>("--seed", *text, 0, UINT64_MAX);
  const std::optional<std::string> out = flags.value("--out");
  require(out.has_value() && !out->empty(), "--out", "is required: the JSON results file to write");
  const std::filesystem::path directory = std::filesystem::path(*out).parent_path();
  require(directory.empty() || std::filesystem::is_directory(directory), "--out", "directory '", directory.string(),
          "' does not exist");
  options.out = *out;
  return options;
}

int run_soak(const SoakOptions& options) {
  // Counted in a child: this process must stay free of CUDA to fork rank processes.
  const int32_t gpus = count_hopper_gpus_in_child();
  require(gpus >= 1, "soak", "needs a Hopper GPU; found none");
  const LaunchMode mode = gpus >= options.ranks ? LaunchMode::processes : LaunchMode::emulated;
  std::vector<Variant> variants;
  for (const std::string& name : options.problems)
    for (Recipe recipe : options.recipes)
      for (Schedule schedule : options.schedules)
        for (bool graph : {false, true})
          variants.push_back({name, soak_problem(name, recipe, options.ranks), schedule, graph, 0});
  const int64_t count = static_cast<int64_t>(variants.size());
  for (int64_t i = 0; i < count; ++i)  // the calls split evenly, the remainder to the first variants
    variants[size_t(i)].calls = options.calls / count + (i < options.calls % count ? 1 : 0);
  std::printf("soak: %zu variants, %lld calls, %d ranks %s, check every %d calls\n", variants.size(),
              static_cast<long long>(options.calls), options.ranks,
              mode == LaunchMode::processes ? "as processes (one per GPU)" : "emulated on GPU 0", options.check_every);
  std::fflush(stdout);

  bench::Report report;
  report.benchmark = "soak";
  report.command = options.command;
  int failed_variants = 0;
  std::string data_key;
  SetData sets;
  for (const Variant& v : variants) {
    if (v.calls == 0) continue;
    // Inputs and references depend on the problem and recipe only: shared by its schedules and modes.
    const std::string key = v.problem_name + "/" + std::string(to_string(v.problem.recipe));
    if (key != data_key) {
      sets = prepare_sets(v.problem, SyntheticWeights(v.problem, options.seed), options.seed);
      data_key = key;
    }
    bench::SharedArray<RankOutcome> outcomes(static_cast<size_t>(options.ranks), RankOutcome{}, "soak");
    const auto start = std::chrono::steady_clock::now();
    const int rank_errors = run_ranks(options.ranks, mode, [&](Communicator& comm) {
      run_rank(comm, v, sets, options.seed, options.check_every, outcomes[comm.rank()]);
    });
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    RankOutcome total;
    for (int32_t r = 0; r < options.ranks; ++r) {
      const RankOutcome& o = outcomes[r];
      total.calls = r == 0 ? o.calls : std::min(total.calls, o.calls);
      total.checks += o.checks;
      total.failures += o.failures;
      total.faults += o.faults;
      total.hangs += o.hangs;
      total.max_error = std::max(total.max_error, o.max_error);
      if (total.first_failure[0] == '\0') std::memcpy(total.first_failure, o.first_failure, sizeof(o.first_failure));
    }
    // A rank that threw outside its calls (buffer creation, allocation) counts as a fault.
    total.faults += rank_errors;
    const bool failed = total.failures + total.faults + total.hangs > 0 || total.calls < v.calls;
    failed_variants += failed ? 1 : 0;
    report.rows.push_back({{"problem", v.problem_name},
                           {"recipe", std::string(to_string(v.problem.recipe))},
                           {"ranks", static_cast<long long>(options.ranks)},
                           {"schedule", std::string(to_string(v.schedule))},
                           {"mode", std::string(v.graph ? "graph" : "eager")},
                           {"calls", static_cast<long long>(total.calls)},
                           {"checks", static_cast<long long>(total.checks)},
                           {"failures", static_cast<long long>(total.failures)},
                           {"faults", static_cast<long long>(total.faults)},
                           {"hangs", static_cast<long long>(total.hangs)},
                           {"max_error", total.max_error},
                           {"bound", token_bound(v.problem.recipe)},
                           {"seconds", seconds},
                           {"first_failure", std::string(total.first_failure)}});
    std::printf("soak: %s %s %s %s: %lld calls, %lld checks, %lld failures, %lld faults, %lld hangs, max error %.3g%s%s\n",
                v.problem_name.c_str(), std::string(to_string(v.problem.recipe)).c_str(),
                std::string(to_string(v.schedule)).c_str(), v.graph ? "graph" : "eager",
                static_cast<long long>(total.calls), static_cast<long long>(total.checks),
                static_cast<long long>(total.failures), static_cast<long long>(total.faults),
                static_cast<long long>(total.hangs), total.max_error, failed ? "; first: " : "", total.first_failure);
    std::fflush(stdout);
  }
  bench::write_report(report, options.out);
  return failed_variants;
}

}  // namespace megamoe::soak
