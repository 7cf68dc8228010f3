#include "megamoe/reference.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>
#include <thread>

#include "megamoe/activation.h"
#include "megamoe/error.h"
#include "megamoe/formats.h"
#include "reference/stored_rows.h"

namespace megamoe {

namespace {

std::string batch_field(int32_t rank, const char* field) {
  return "batches[" + std::to_string(rank) + "]." + field;
}

// One use of an expert: which token it reads and which combine slot it writes.
struct Route {
  int32_t rank;
  int32_t token;  // in the rank's batch
  int32_t row;    // the token's row in the rank's SlotStore
  int32_t slot;   // top-k choice, or top_k for the shared experts
  float weight;
};

constexpr int32_t kSharedItem = -1;

// An expert with all the routes it computes. Each item is run by one worker, and each combine
// slot belongs to exactly one item, so the result does not depend on the thread count.
struct WorkItem {
  int32_t expert;  // global routed expert, or kSharedItem for the concatenated shared experts
  std::vector<Route> routes;
};

// One rank's L2 outputs before the final sum: BF16 per computed token and combine slot.
struct SlotStore {
  std::vector<int32_t> tokens;  // the computed tokens, ascending; row i holds tokens[i]
  std::vector<uint16_t> values;  // [rows][slots][hidden]
  std::vector<uint8_t> written;  // [rows][slots]
};

float load_bf16(const uint8_t* bytes) {
  return bf16_to_float(static_cast<uint16_t>(bytes[0] | (bytes[1] << 8)));
}

void dequantize_x_row(const Problem& p, const RankBatch& batch, int32_t token, float* out) {
  const size_t hidden = static_cast<size_t>(p.hidden);
  const size_t first = static_cast<size_t>(token) * hidden;
  if (p.recipe == Recipe::bf16) {
    for (size_t h = 0; h < hidden; ++h) out[h] = load_bf16(batch.x.data() + 2 * (first + h));
    return;
  }
  const float* scales = batch.x_scales.data() + static_cast<size_t>(token) * (hidden / kScaleBlock);
  for (size_t h = 0; h < hidden; ++h) out[h] = e4m3_to_float(batch.x[first + h]) * scales[h / kScaleBlock];
}

// FP32 dot product in a fixed order: 16 independent partial sums (so the compiler vectorizes
// without reassociating), then a fixed tree. `n` is a multiple of 128.
float dot(const float* a, const float* b, size_t n) {
  constexpr int kLanes = 16;
  float partial[kLanes] = {};
  for (size_t i = 0; i < n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) partial[j] += a[i + j] * b[i + j];
  }
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int j = 0; j < width; ++j) partial[j] += partial[j + width];
  }
  return partial[0];
}

float silu(float g) { return g / (1.0f + std::exp(-g)); }

// The L1 output's quantization step before L2: E4M3 with one scale per 1x128 (then back to FP32),
// or BF16.
void requantize(Recipe recipe, float* values, size_t count) {
  if (recipe == Recipe::bf16) {
    for (size_t c = 0; c < count; ++c) values[c] = bf16_to_float(float_to_bf16(values[c]));
    return;
  }
  for (size_t block = 0; block < count; block += kScaleBlock) {
    float* v = values + block;
    float amax = 0.0f;
    for (int c = 0; c < kScaleBlock; ++c) amax = std::fmax(amax, std::fabs(v[c]));
    const Fp8BlockQuantizer quantizer = Fp8BlockQuantizer::from_amax(amax);
    for (int c = 0; c < kScaleBlock; ++c) v[c] = e4m3_to_float(quantizer.quantize(v[c])) * quantizer.scale;
  }
}

// Runs `routes` through one expert, a tile of routes at a time: each weight row is dequantized once
// per tile and used for all of the tile's routes while it is in cache.
void compute_routes(const Problem& p, const std::vector<RankBatch>& batches, const StoredExpert& expert,
                    const std::vector<Route>& routes, float clamp, std::vector<SlotStore>& stores) {
  constexpr size_t kTile = 16;
  const StoredRows w1(expert, p.recipe, 1);
  const StoredRows w2(expert, p.recipe, 2);
  const size_t hidden = w1.cols();
  const size_t inter = w2.cols();
  const size_t slots = static_cast<size_t>(p.combine_slots());
  std::vector<float> x(kTile * hidden), h(kTile * 2 * inter), a(kTile * inter), row(std::max(hidden, inter));
  for (size_t first = 0; first < routes.size(); first += kTile) {
    const size_t n = std::min(kTile, routes.size() - first);
    const Route* tile = routes.data() + first;
    for (size_t t = 0; t < n; ++t) {
      dequantize_x_row(p, batches[static_cast<size_t>(tile[t].rank)], tile[t].token, x.data() + t * hidden);
    }
    // L1: h = W1 . x for gate (rows 0..I-1) and up (rows I..2I-1).
    for (size_t r = 0; r < 2 * inter; ++r) {
      w1.row(r, row.data());
      for (size_t t = 0; t < n; ++t) h[t * 2 * inter + r] = dot(row.data(), x.data() + t * hidden, hidden);
    }
    for (size_t t = 0; t < n; ++t) {
      const float* gate = h.data() + t * 2 * inter;
      const float* up = gate + inter;
      float* act = a.data() + t * inter;
      for (size_t c = 0; c < inter; ++c)
        act[c] = silu(clamp_gate(gate[c], clamp)) * clamp_up(up[c], clamp) * tile[t].weight;
      requantize(p.recipe, act, inter);
    }
    // L2: o = W2 . a', rounded to BF16 into the route's combine slot.
    for (size_t j = 0; j < hidden; ++j) {
      w2.row(j, row.data());
      for (size_t t = 0; t < n; ++t) {
        SlotStore& store = stores[static_cast<size_t>(tile[t].rank)];
        const size_t slot_row = static_cast<size_t>(tile[t].row) * slots + static_cast<size_t>(tile[t].slot);
        store.values[slot_row * hidden + j] = float_to_bf16(dot(row.data(), a.data() + t * inter, inter));
      }
    }
    for (size_t t = 0; t < n; ++t) {
      SlotStore& store = stores[static_cast<size_t>(tile[t].rank)];
      store.written[static_cast<size_t>(tile[t].row) * slots + static_cast<size_t>(tile[t].slot)] = 1;
    }
  }
}

// Fetches the item's expert (one per worker at a time, kept in its stored format), then runs its
// routes.
void run_item(const Problem& p, const std::vector<RankBatch>& batches, const WeightSource& weights,
              const WorkItem& item, float clamp, std::vector<SlotStore>& stores) {
  StoredExpert stored;
  std::string name;
  int32_t expected_intermediate = p.intermediate;
  if (item.expert == kSharedItem) {
    std::vector<StoredExpert> shared;
    for (int32_t s = 0; s < p.num_shared_experts; ++s) shared.push_back(weights.shared_expert(s));
    stored = concat_shared_experts(shared, p.recipe);
    name = "weights.shared_expert(*)";
    expected_intermediate = p.num_shared_experts * p.intermediate;
  } else {
    stored = weights.routed_expert(item.expert);
    name = "weights.routed_expert(" + std::to_string(item.expert) + ")";
  }
  check_canonical(stored, p.recipe, name.c_str());
  require(stored.hidden == p.hidden, (name + ".hidden").c_str(), "must equal problem.hidden (", p.hidden, "), got ",
          stored.hidden);
  require(stored.intermediate == expected_intermediate, (name + ".intermediate").c_str(), "must be ",
          expected_intermediate, ", got ", stored.intermediate);
  compute_routes(p, batches, stored, item.routes, clamp, stores);
}

// Runs the items on `threads` workers; the calling thread reports progress.
void run_items(const Problem& p, const std::vector<RankBatch>& batches, const WeightSource& weights,
               const std::vector<WorkItem>& items, std::vector<SlotStore>& stores, const ReferenceOptions& options) {
  const int64_t total = static_cast<int64_t>(items.size());
  if (total == 0) return;
  const float clamp = kernel_activation_clamp(options.activation_clamp, "options.activation_clamp");
  int threads = options.threads > 0 ? options.threads : static_cast<int>(std::thread::hardware_concurrency());
  threads = std::clamp<int64_t>(threads, 1, total);

  std::atomic<size_t> next_item{0};
  std::atomic<bool> failed{false};
  std::mutex mutex;
  std::condition_variable changed;
  int64_t done = 0;
  int active = threads;
  std::exception_ptr error;

  auto worker = [&] {
    while (!failed.load()) {
      const size_t index = next_item.fetch_add(1);
      if (index >= items.size()) break;
      try {
        run_item(p, batches, weights, items[index], clamp, stores);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!error) error = std::current_exception();
        failed.store(true);
      }
      {
        std::lock_guard<std::mutex> lock(mutex);
        ++done;
      }
      changed.notify_one();
    }
    {
      std::lock_guard<std::mutex> lock(mutex);
      --active;
    }
    changed.notify_one();
  };

  std::vector<std::jthread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(worker);
  try {
    std::unique_lock<std::mutex> lock(mutex);
    int64_t reported = -1;
    for (;;) {
      changed.wait(lock, [&] { return done != reported || active == 0; });
      const int64_t now = done;
      const bool finished = active == 0;
      if (now != reported && options.progress) {
        lock.unlock();
        options.progress(now, total);
        lock.lock();
      }
      reported = now;
      if (finished) break;
    }
  } catch (...) {
    failed.store(true);  // the pool's destructors join after the workers finish their current item
    throw;
  }
  pool.clear();
  if (error) std::rethrow_exception(error);
}

}  // namespace

void validate_batch(const Problem& p, const RankBatch& batch, int32_t rank) {
  require(rank >= 0 && rank < p.num_ranks, "rank", "must be in [0, num_ranks = ", p.num_ranks, "), got ", rank);
  const std::string tokens_name = batch_field(rank, "num_tokens");
  require(batch.num_tokens >= 0, tokens_name.c_str(), "must not be negative, got ", batch.num_tokens);
  require(batch.num_tokens <= p.max_tokens_per_rank, tokens_name.c_str(), "must be at most max_tokens_per_rank (",
          p.max_tokens_per_rank, "), got ", batch.num_tokens);

  const uint64_t tokens = static_cast<uint64_t>(batch.num_tokens);
  const uint64_t hidden = static_cast<uint64_t>(p.hidden);
  const uint64_t top_k = static_cast<uint64_t>(p.top_k);
  const uint64_t act_bytes = static_cast<uint64_t>(activation_bytes(p.recipe));
  require(batch.x.size() == tokens * hidden * act_bytes, batch_field(rank, "x").c_str(),
          "must hold num_tokens * hidden * ", act_bytes, " = ", tokens * hidden * act_bytes, " bytes, got ",
          batch.x.size());
  const std::string scales_name = batch_field(rank, "x_scales");
  if (has_activation_scales(p.recipe)) {
    require(batch.x_scales.size() == tokens * (hidden / kScaleBlock), scales_name.c_str(),
            "must hold num_tokens * hidden / ", kScaleBlock, " = ", tokens * (hidden / kScaleBlock),
            " scales, got ", batch.x_scales.size());
  } else {
    require(batch.x_scales.empty(), scales_name.c_str(), "must be empty for recipe ", to_string(p.recipe), ", got ",
            batch.x_scales.size(), " scales");
  }
  const std::string idx_name = batch_field(rank, "topk_idx");
  const std::string weights_name = batch_field(rank, "topk_weights");
  require(batch.topk_idx.size() == tokens * top_k, idx_name.c_str(), "must hold num_tokens * top_k = ",
          tokens * top_k, " ids, got ", batch.topk_idx.size());
  require(batch.topk_weights.size() == tokens * top_k, weights_name.c_str(), "must hold num_tokens * top_k = ",
          tokens * top_k, " weights, got ", batch.topk_weights.size());

  // A token may name one expert in several slots (each is its own route); what bounds repeats is
  // the room the buffer has for one rank's routes to one expert.
  std::vector<int32_t> routes_to(static_cast<size_t>(p.num_experts), 0);
  for (uint64_t t = 0; t < tokens; ++t) {
    const int32_t* ids = batch.topk_idx.data() + t * top_k;
    const float* weights = batch.topk_weights.data() + t * top_k;
    for (uint64_t k = 0; k < top_k; ++k) {
      require(ids[k] >= -1 && ids[k] < p.num_experts, idx_name.c_str(), "expert id ", ids[k], " at token ", t,
              ", slot ", k, " is outside [-1, num_experts = ", p.num_experts, ")");
      if (ids[k] >= 0) {
        require(++routes_to[static_cast<size_t>(ids[k])] <= p.max_tokens_per_rank, idx_name.c_str(), "expert ",
                ids[k], " gets more than max_tokens_per_rank = ", p.max_tokens_per_rank,
                " routes from this rank (at token ", t, ", slot ", k,
                "); only an expert repeated within tokens can exceed it");
      }
      require(std::isfinite(weights[k]), weights_name.c_str(), "weight at token ", t, ", slot ", k,
              " must be finite (not NaN or infinite), got ", weights[k]);
    }
  }
  for (uint64_t index = 0; index < batch.x_scales.size(); ++index) {
    const float scale = batch.x_scales[index];
    require(std::isfinite(scale) && scale > 0.0f, scales_name.c_str(), "scale at token ",
            index / (hidden / kScaleBlock), ", block ", index % (hidden / kScaleBlock),
            " must be positive and finite, got ", scale);
  }
}

ReferenceResult reference_moe(const Problem& problem, const std::vector<RankBatch>& batches,
                              const WeightSource& weights, const ReferenceOptions& options) {
  Problem any_rank = problem;  // every rank is computed, so `rank` itself is not checked
  any_rank.rank = 0;
  validate(any_rank);
  const int32_t num_ranks = problem.num_ranks;
  require(batches.size() == static_cast<size_t>(num_ranks), "batches", "must hold one batch per rank (", num_ranks,
          "), got ", batches.size());
  for (int32_t r = 0; r < num_ranks; ++r) validate_batch(problem, batches[static_cast<size_t>(r)], r);
  require(options.threads >= 0, "options.threads", "must not be negative, got ", options.threads);
  kernel_activation_clamp(options.activation_clamp, "options.activation_clamp");
  if (options.token_subset != nullptr) {
    require(options.token_subset->size() == static_cast<size_t>(num_ranks), "options.token_subset",
            "must hold one list per rank (", num_ranks, "), got ", options.token_subset->size());
  }

  const size_t hidden = static_cast<size_t>(problem.hidden);
  const size_t slots = static_cast<size_t>(problem.combine_slots());
  const int32_t top_k = problem.top_k;
  ReferenceResult result;
  result.y.resize(static_cast<size_t>(num_ranks));
  result.recv_counts.resize(static_cast<size_t>(num_ranks));
  std::vector<SlotStore> stores(static_cast<size_t>(num_ranks));
  std::vector<WorkItem> routed(static_cast<size_t>(problem.num_experts));
  for (int32_t e = 0; e < problem.num_experts; ++e) routed[static_cast<size_t>(e)].expert = e;
  WorkItem shared{kSharedItem, {}};

  for (int32_t r = 0; r < num_ranks; ++r) {
    const RankBatch& batch = batches[static_cast<size_t>(r)];
    result.y[static_cast<size_t>(r)].assign(static_cast<size_t>(batch.num_tokens) * hidden, 0);
    result.recv_counts[static_cast<size_t>(r)].assign(static_cast<size_t>(problem.experts_per_rank()), 0);
  }
  // Receive counts cover every token, whatever the subset.
  for (const RankBatch& batch : batches) {
    for (int32_t id : batch.topk_idx) {
      if (id < 0) continue;
      std::vector<uint32_t>& counts = result.recv_counts[static_cast<size_t>(problem.owner_rank(id))];
      ++counts[static_cast<size_t>(problem.local_expert(id))];
    }
  }

  for (int32_t r = 0; r < num_ranks; ++r) {
    const RankBatch& batch = batches[static_cast<size_t>(r)];
    SlotStore& store = stores[static_cast<size_t>(r)];
    if (options.token_subset != nullptr) {
      const std::string name = "options.token_subset[" + std::to_string(r) + "]";
      store.tokens = (*options.token_subset)[static_cast<size_t>(r)];
      for (int32_t token : store.tokens) {
        require(token >= 0 && token < batch.num_tokens, name.c_str(), "token ", token, " is outside [0, num_tokens = ",
                batch.num_tokens, ")");
      }
      std::sort(store.tokens.begin(), store.tokens.end());
      store.tokens.erase(std::unique(store.tokens.begin(), store.tokens.end()), store.tokens.end());
    } else {
      store.tokens.resize(static_cast<size_t>(batch.num_tokens));
      for (int32_t t = 0; t < batch.num_tokens; ++t) store.tokens[static_cast<size_t>(t)] = t;
    }
    store.values.assign(store.tokens.size() * slots * hidden, 0);
    store.written.assign(store.tokens.size() * slots, 0);
    for (size_t row = 0; row < store.tokens.size(); ++row) {
      const int32_t token = store.tokens[row];
      for (int32_t k = 0; k < top_k; ++k) {
        const size_t route = static_cast<size_t>(token) * static_cast<size_t>(top_k) + static_cast<size_t>(k);
        const int32_t id = batch.topk_idx[route];
        if (id < 0) continue;
        routed[static_cast<size_t>(id)].routes.push_back(
            {r, token, static_cast<int32_t>(row), k, batch.topk_weights[route]});
      }
      if (problem.num_shared_experts > 0) shared.routes.push_back({r, token, static_cast<int32_t>(row), top_k, 1.0f});
    }
  }

  // The shared item is the largest, so it goes first; experts without routes are never fetched.
  std::vector<WorkItem> items;
  if (!shared.routes.empty()) items.push_back(std::move(shared));
  for (WorkItem& item : routed) {
    if (!item.routes.empty()) items.push_back(std::move(item));
  }
  routed.clear();
  run_items(problem, batches, weights, items, stores, options);

  // y = BF16 of the FP32 sum of the written slots, in slot order.
  std::vector<float> sum(hidden);
  if (options.keep_slots) result.slots.resize(static_cast<size_t>(num_ranks));
  for (int32_t r = 0; r < num_ranks; ++r) {
    const SlotStore& store = stores[static_cast<size_t>(r)];
    std::vector<uint16_t>& y = result.y[static_cast<size_t>(r)];
    if (options.keep_slots) {  // unwritten slots hold 0: store.values starts zeroed
      std::vector<uint16_t>& kept = result.slots[static_cast<size_t>(r)];
      kept.assign(y.size() * slots, 0);
      for (size_t row = 0; row < store.tokens.size(); ++row)
        std::copy_n(store.values.begin() + static_cast<std::ptrdiff_t>(row * slots * hidden), slots * hidden,
                    kept.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(store.tokens[row]) * slots * hidden));
    }
    for (size_t row = 0; row < store.tokens.size(); ++row) {
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (size_t slot = 0; slot < slots; ++slot) {
        if (!store.written[row * slots + slot]) continue;
        const uint16_t* values = store.values.data() + (row * slots + slot) * hidden;
        for (size_t j = 0; j < hidden; ++j) sum[j] += bf16_to_float(values[j]);
      }
      uint16_t* out = y.data() + static_cast<size_t>(store.tokens[row]) * hidden;
      for (size_t j = 0; j < hidden; ++j) out[j] = float_to_bf16(sum[j]);
    }
  }
  return result;
}

}  // namespace megamoe
