// The streaming front-ring protocol on host threads: the protocol steps of megamoe/streaming.h run
// over std::atomic_ref with acquire/release, by route producers, layout producers and consumers of
// several emulated ranks, with random delays, many ring wraps, uneven ranks and ranks with no tokens.
// Every route must reach its owner exactly once, with its payload and its token position, in the
// owner's chunk-local pool segments (the streamed dispatch's layout, stream_segment_place). Also built
// under ThreadSanitizer (streaming_ring_emulation_tsan), which checks that the acquire/release
// hand-offs order every payload access.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "megamoe/layout.h"
#include "megamoe/streaming.h"

namespace megamoe {
namespace {

struct HostAtomics {
  static uint64_t load_acquire(uint64_t* word) { return std::atomic_ref<uint64_t>(*word).load(std::memory_order_acquire); }
  static void store_release(uint64_t* word, uint64_t value) {
    std::atomic_ref<uint64_t>(*word).store(value, std::memory_order_release);
  }
  static uint64_t now_ns() {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count());
  }
  static void backoff() { std::this_thread::yield(); }
};

constexpr uint64_t kTimeoutNs = 30ull * 1000 * 1000 * 1000;

std::string describe(const FrontWaitResult& r) {
  static const char* const names[] = {"nothing", "route_ready", "layout_ready", "consumed"};
  std::ostringstream out;
  out << "timed out waiting for " << names[static_cast<uint32_t>(r.what)] << " (peer " << r.peer << ", slot "
      << r.slot << ", expected " << r.expected << ", saw " << r.seen << ")";
  return out.str();
}

// ---- Payload: every value is a function of (source rank, call, token), so a reader can check it ----

uint64_t mix(uint64_t value) {
  value += 0x9e3779b97f4a7c15ull;
  value = (value ^ (value >> 30)) * 0xbf58476d1ce4e5b9ull;
  value = (value ^ (value >> 27)) * 0x94d049bb133111ebull;
  return value ^ (value >> 31);
}
uint64_t token_key(uint32_t src, uint32_t call, uint32_t token) {
  return mix((uint64_t{src} << 48) ^ (uint64_t{call} << 24) ^ token);
}
uint8_t x_byte(uint64_t key, uint32_t column) { return static_cast<uint8_t>(mix(key + column)); }
float x_scale(uint64_t key, uint32_t block) { return static_cast<float>((key >> 8) % 1000 + block) * 0.25f; }
// Distinct experts per token (step 3 is coprime with the expert count); the last choice of some
// tokens is masked (-1), as a router may drop a route.
int32_t expert_of(uint64_t key, uint32_t k, uint32_t top_k, uint32_t num_experts) {
  if (k + 1 == top_k && (key >> 40) % 5 == 0) return -1;
  return static_cast<int32_t>((key % num_experts + 3ull * k) % num_experts);
}
float route_weight(uint64_t key, uint32_t k) { return static_cast<float>(k + 1) + static_cast<float>(key % 97) / 128.f; }

// ---- The emulated system ----

struct Config {
  int32_t num_ranks = 4;
  int32_t num_experts = 8;
  int32_t top_k = 3;
  int32_t slots = 3;
  int32_t tokens_per_slot = 4;
  uint32_t calls = 1000;
  uint64_t seed = 1;
};

class Emulation {
 public:
  explicit Emulation(const Config& config) : config_(config) {
    Problem p;
    p.num_ranks = config.num_ranks;
    p.num_experts = config.num_experts;
    p.top_k = config.top_k;
    p.hidden = 128;
    p.intermediate = 128;
    p.recipe = Recipe::fp8;
    p.front_num_slots = config.slots;
    p.front_tokens_per_slot = config.tokens_per_slot;
    p.max_tokens_per_rank = config.slots * config.tokens_per_slot;
    problem_ = p;
    ring_ = FrontRingLayout::make(p);
    const auto ranks = static_cast<size_t>(config.num_ranks);
    buffers_.assign(ranks, std::vector<uint64_t>(ring_.total_bytes / sizeof(uint64_t), 0));
    // Uneven ranks: rank 0 is often full, rank 1 uniform, rank 2 mostly empty, the last one never
    // has tokens (it still consumes the routes to its experts).
    std::mt19937_64 rng(config.seed);
    const uint32_t capacity = static_cast<uint32_t>(ring_.call_capacity());
    tokens_.assign(ranks * config.calls, 0);
    for (uint32_t call = 0; call < config.calls; ++call) {
      for (int32_t rank = 0; rank + 1 < config.num_ranks; ++rank) {
        uint32_t tokens = static_cast<uint32_t>(rng() % (capacity + 1));
        if (rank == 0 && rng() % 2 == 0) tokens = capacity;
        if (rank == 2 && rng() % 4 != 0) tokens = 0;
        tokens_[index(rank, call)] = tokens;
      }
    }
    routes_.assign(ranks, std::vector<uint8_t>(ranks * config.calls * capacity * config.top_k, 0));
    chunks_seen_.assign(ranks, std::vector<uint32_t>(ranks * config.calls, 0));
    pool_fingerprints_.assign(ranks, std::vector<uint64_t>(config.calls, 0));
    pool_capacity_ = static_cast<uint32_t>(BufferLayout::worst_case_pool_rows(p));
  }

  // Producer `half` of rank `rank`, call `call`: writes and publishes every chunk of the call.
  void produce(int32_t rank, FrontHalf half, uint32_t call, std::mt19937_64& rng) {
    void* ring = ring_of(rank);
    const uint32_t tokens = tokens_[index(rank, call)];
    const uint32_t per_slot = ring_.tokens_per_slot;
    const uint64_t first = *ring_.producer_cursor(ring, half);
    const uint32_t chunks = front_chunk_count(tokens, per_slot);
    if (!ring_.holds_call(tokens)) return fail("a call exceeds the ring's capacity");
    for (uint32_t chunk = 0; chunk < chunks && !aborted(); ++chunk) {
      const uint64_t seq = first + chunk;
      const uint32_t slot = front_slot(seq, ring_.num_slots);
      const FrontWaitResult free = front_wait_slot_free<HostAtomics>(ring_, ring, seq, kTimeoutNs);
      if (!free.ok()) return fail("rank " + std::to_string(rank) + " producer " + describe(free));
      delay(rng);
      const FrontSlotMeta meta = front_chunk_meta(tokens, per_slot, chunk);
      for (uint32_t t = 0; t < meta.valid; ++t) {
        const uint64_t key = token_key(static_cast<uint32_t>(rank), call, meta.token_base + t);
        if (half == FrontHalf::route) {
          for (uint32_t k = 0; k < ring_.top_k; ++k) {
            ring_.slot_topk_idx(ring, slot)[t * ring_.top_k + k] = expert_of(key, k, ring_.top_k, experts());
            ring_.slot_topk_weights(ring, slot)[t * ring_.top_k + k] = route_weight(key, k);
          }
        } else {
          uint8_t* row = ring_.slot_x(ring, slot) + static_cast<uint64_t>(t) * ring_.row_bytes;
          for (uint32_t column = 0; column < ring_.row_bytes; ++column) row[column] = x_byte(key, column);
          for (uint32_t block = 0; block < ring_.scale_blocks; ++block) {
            ring_.slot_x_scales(ring, slot)[t * ring_.scale_blocks + block] = x_scale(key, block);
          }
        }
      }
      if (half == FrontHalf::route) *ring_.slot_meta(ring, slot) = meta;
      delay(rng);
      front_publish<HostAtomics>(ring_, ring, half, seq);
    }
    *ring_.producer_cursor(ring, half) = first + chunks;
  }

  // Consumer of rank `dst`, call `call`, in steps: step s waits for chunk s of every source that still
  // has chunks (in random order), checks them and counts the routes to its experts, places the step's
  // segment of the pool, gives each route its row (sources again in random order), and acknowledges
  // each chunk once its routes have rows. Then checks the call's pool (check_pool).
  void consume(int32_t dst, uint32_t call, std::mt19937_64& rng) {
    const auto ranks = static_cast<uint32_t>(config_.num_ranks);
    const auto experts_per_rank = static_cast<uint32_t>(problem_.experts_per_rank());
    void* own = ring_of(dst);
    std::vector<uint64_t> next(ranks);
    std::vector<bool> finished(ranks, false);
    for (uint32_t src = 0; src < ranks; ++src) next[src] = *ring_.consumer_cursor(own, src);
    std::vector<PoolRow> pool;
    std::vector<uint32_t> pair_rows(size_t{experts_per_rank} * ranks);
    uint32_t row_cursor = 0;
    for (uint32_t step = 0, remaining = ranks; remaining > 0 && !aborted(); ++step) {
      std::vector<uint32_t> sources;
      for (uint32_t src = 0; src < ranks; ++src)
        if (!finished[src]) sources.push_back(src);
      std::fill(pair_rows.begin(), pair_rows.end(), 0u);
      std::vector<FrontSlotMeta> metas(ranks);
      std::shuffle(sources.begin(), sources.end(), rng);
      for (uint32_t src : sources) {
        void* src_ring = ring_of(static_cast<int32_t>(src));
        const FrontWaitResult ready = front_wait_ready<HostAtomics>(ring_, src_ring, src, next[src], kTimeoutNs);
        if (!ready.ok()) return fail("rank " + std::to_string(dst) + " consumer " + describe(ready));
        metas[src] = *ring_.slot_meta(src_ring, front_slot(next[src], ring_.num_slots));
        if (!check_chunk(dst, src, call, metas[src], src_ring, front_slot(next[src], ring_.num_slots), pair_rows))
          return;
      }
      const StreamSegment segment = stream_segment_place(pair_rows.data(), experts_per_rank, ranks, row_cursor);
      if (segment.row_end > pool_capacity_) {
        return fail("rank " + std::to_string(dst) + " call " + std::to_string(call) + ": step " +
                    std::to_string(step) + " ends at pool row " + std::to_string(segment.row_end) + ", past " +
                    std::to_string(pool_capacity_));
      }
      pool.resize(segment.row_end);
      std::shuffle(sources.begin(), sources.end(), rng);
      for (uint32_t src : sources) {
        void* src_ring = ring_of(static_cast<int32_t>(src));
        const uint32_t slot = front_slot(next[src], ring_.num_slots);
        take_rows(dst, src, call, step, metas[src], src_ring, slot, pair_rows, pool);
        delay(rng);
        front_acknowledge<HostAtomics>(ring_, src_ring, static_cast<uint32_t>(dst), next[src]);
        ++next[src];
        if (metas[src].last != 0) {
          finished[src] = true;
          --remaining;
        }
      }
      row_cursor = segment.row_end;
    }
    for (uint32_t src = 0; src < ranks; ++src) *ring_.consumer_cursor(own, src) = next[src];
    if (!aborted()) check_pool(dst, call, pool);
  }

  // After every thread has joined: each route reached its owner exactly once and nothing else
  // arrived; each destination saw each source's chunks of each call exactly once.
  void check_delivery() const {
    const auto ranks = static_cast<uint32_t>(config_.num_ranks);
    const uint32_t capacity = static_cast<uint32_t>(ring_.call_capacity());
    size_t delivered = 0;
    for (uint32_t src = 0; src < ranks; ++src) {
      for (uint32_t call = 0; call < config_.calls; ++call) {
        const uint32_t tokens = tokens_[index(static_cast<int32_t>(src), call)];
        for (uint32_t dst = 0; dst < ranks; ++dst) {
          ASSERT_EQ(chunks_seen_[dst][index(static_cast<int32_t>(src), call)],
                    front_chunk_count(tokens, ring_.tokens_per_slot))
              << "destination " << dst << " source " << src << " call " << call;
        }
        for (uint32_t token = 0; token < capacity; ++token) {
          const uint64_t key = token_key(src, call, token);
          for (uint32_t k = 0; k < ring_.top_k; ++k) {
            const int32_t expert = expert_of(key, k, ring_.top_k, experts());
            const bool routed = token < tokens && expert >= 0;
            for (uint32_t dst = 0; dst < ranks; ++dst) {
              const bool owner = routed && static_cast<int32_t>(dst) == problem_.owner_rank(expert);
              ASSERT_EQ(routes_[dst][route_index(src, call, token, k)], owner ? 1 : 0)
                  << "route source " << src << " call " << call << " token " << token << " k " << k
                  << " at destination " << dst;
              delivered += owner ? 1 : 0;
            }
          }
        }
      }
    }
    EXPECT_GT(delivered, size_t{config_.calls});
  }

  void expect_no_failure() const {
    std::lock_guard<std::mutex> lock(failures_mutex_);
    for (const std::string& failure : failures_) ADD_FAILURE() << failure;
  }
  bool failed() const { return aborted(); }

  int32_t num_ranks() const { return config_.num_ranks; }
  uint32_t calls() const { return config_.calls; }
  uint64_t seed() const { return config_.seed; }
  // Chunks published per source over the run, for the wrap count.
  uint64_t chunks_published(int32_t rank) const {
    uint64_t chunks = 0;
    for (uint32_t call = 0; call < config_.calls; ++call) {
      chunks += front_chunk_count(tokens_[index(rank, call)], ring_.tokens_per_slot);
    }
    return chunks;
  }
  uint32_t slots() const { return ring_.num_slots; }
  uint64_t pool_fingerprint(int32_t dst, uint32_t call) const {
    return pool_fingerprints_[static_cast<size_t>(dst)][call];
  }

 private:
  // One pool row: the route it holds (its combine slot, PoolSource) and the step that placed it.
  struct PoolRow {
    PoolSource source{~0u, ~0u};
    float weight = 0;
    uint32_t step = 0;
    uint32_t local_expert = 0;
  };

  // Checks a chunk's metadata, routes and rows, and counts its routes to dst's experts per (local
  // expert, source) pair. False after a failure.
  bool check_chunk(int32_t dst, uint32_t src, uint32_t call, const FrontSlotMeta& meta, void* src_ring,
                   uint32_t slot, std::vector<uint32_t>& pair_rows) {
    uint32_t& seen = chunks_seen_[static_cast<size_t>(dst)][index(static_cast<int32_t>(src), call)];
    const FrontSlotMeta expected =
        front_chunk_meta(tokens_[index(static_cast<int32_t>(src), call)], ring_.tokens_per_slot, seen);
    ++seen;
    if (meta.token_base != expected.token_base || meta.valid != expected.valid || meta.last != expected.last ||
        meta.call_tokens != expected.call_tokens) {
      fail("rank " + std::to_string(dst) + " read wrong metadata from source " + std::to_string(src) + " call " +
           std::to_string(call));
      return false;
    }
    for (uint32_t t = 0; t < meta.valid; ++t) {
      const uint32_t token = meta.token_base + t;
      const uint64_t key = token_key(src, call, token);
      for (uint32_t k = 0; k < ring_.top_k; ++k) {
        const int32_t expert = ring_.slot_topk_idx(src_ring, slot)[t * ring_.top_k + k];
        const float weight = ring_.slot_topk_weights(src_ring, slot)[t * ring_.top_k + k];
        if (expert != expert_of(key, k, ring_.top_k, experts()) || weight != route_weight(key, k)) {
          fail("rank " + std::to_string(dst) + " read a wrong route of source " + std::to_string(src) + " call " +
               std::to_string(call) + " token " + std::to_string(token));
          return false;
        }
        if (expert < 0 || problem_.owner_rank(expert) != dst) continue;
        // A route to this rank: "pull" its row as the owner would.
        const uint8_t* row = ring_.slot_x(src_ring, slot) + static_cast<uint64_t>(t) * ring_.row_bytes;
        bool row_ok = true;
        for (uint32_t column = 0; column < ring_.row_bytes; ++column) row_ok &= row[column] == x_byte(key, column);
        for (uint32_t block = 0; block < ring_.scale_blocks; ++block) {
          row_ok &= ring_.slot_x_scales(src_ring, slot)[t * ring_.scale_blocks + block] == x_scale(key, block);
        }
        if (!row_ok) {
          fail("rank " + std::to_string(dst) + " pulled a wrong row of source " + std::to_string(src) + " call " +
               std::to_string(call) + " token " + std::to_string(token));
          return false;
        }
        ++pair_rows[pair_index(expert, src)];
      }
    }
    return true;
  }

  // Gives each of the chunk's routes to dst the next row of its (local expert, source) pair, in token
  // and choice order, and records where it goes back.
  void take_rows(int32_t dst, uint32_t src, uint32_t call, uint32_t step, const FrontSlotMeta& meta,
                 void* src_ring, uint32_t slot, std::vector<uint32_t>& pair_rows, std::vector<PoolRow>& pool) {
    for (uint32_t t = 0; t < meta.valid; ++t) {
      const uint32_t token = meta.token_base + t;
      for (uint32_t k = 0; k < ring_.top_k; ++k) {
        const int32_t expert = ring_.slot_topk_idx(src_ring, slot)[t * ring_.top_k + k];
        if (expert < 0 || problem_.owner_rank(expert) != dst) continue;
        const uint32_t row = pair_rows[pair_index(expert, src)]++;
        if (row >= pool.size() || pool[row].source.rank != ~0u) {
          return fail("rank " + std::to_string(dst) + " call " + std::to_string(call) + ": route of source " +
                      std::to_string(src) + " token " + std::to_string(token) + " got row " + std::to_string(row) +
                      (row >= pool.size() ? ", past its segment" : ", already taken"));
        }
        const float weight = ring_.slot_topk_weights(src_ring, slot)[t * ring_.top_k + k];
        pool[row] = {PoolSource{src, token * ring_.top_k + k}, weight, step,
                     static_cast<uint32_t>(problem_.local_expert(expert))};
        ++routes_[static_cast<size_t>(dst)][route_index(src, call, token, k)];
      }
    }
  }

  // The call's pool on dst: every row holds a route, with its own weight; rows run by step, then
  // local expert, then source rank, then token and choice (the layout rule); its fingerprint is kept
  // so that runs of the same routing in another order can be compared.
  void check_pool(int32_t dst, uint32_t call, const std::vector<PoolRow>& pool) {
    uint64_t fingerprint = mix(pool.size());
    for (size_t row = 0; row < pool.size(); ++row) {
      const PoolRow& r = pool[row];
      const std::string where = "rank " + std::to_string(dst) + " call " + std::to_string(call) + " pool row " +
                                std::to_string(row);
      if (r.source.rank == ~0u) return fail(where + " holds no route");
      const uint32_t token = r.source.token_topk / ring_.top_k, k = r.source.token_topk % ring_.top_k;
      if (r.weight != route_weight(token_key(r.source.rank, call, token), k)) return fail(where + ": wrong weight");
      if (row > 0) {
        const PoolRow& p = pool[row - 1];
        const auto order = [](const PoolRow& x) {
          return std::make_tuple(x.step, x.local_expert, x.source.rank, x.source.token_topk);
        };
        if (!(order(p) < order(r))) return fail(where + " breaks the (step, expert, source, token) order");
      }
      fingerprint = mix(fingerprint ^ (uint64_t{r.source.rank} << 32 | r.source.token_topk) ^
                        (uint64_t{r.step} << 48));
    }
    pool_fingerprints_[static_cast<size_t>(dst)][call] = fingerprint;
  }

  size_t pair_index(int32_t expert, uint32_t src) const {
    return static_cast<size_t>(problem_.local_expert(expert)) * static_cast<uint32_t>(config_.num_ranks) + src;
  }

  static void delay(std::mt19937_64& rng) {
    const uint64_t roll = rng() % 64;
    if (roll == 0) {
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 200));
    } else if (roll < 8) {
      std::this_thread::yield();
    }
  }

  void fail(const std::string& message) {
    std::lock_guard<std::mutex> lock(failures_mutex_);
    failures_.push_back(message);
    aborted_.store(true, std::memory_order_relaxed);
  }
  bool aborted() const { return aborted_.load(std::memory_order_relaxed); }

  void* ring_of(int32_t rank) { return buffers_[static_cast<size_t>(rank)].data(); }
  uint32_t experts() const { return static_cast<uint32_t>(config_.num_experts); }
  size_t index(int32_t rank, uint32_t call) const { return static_cast<size_t>(rank) * config_.calls + call; }
  size_t route_index(uint32_t src, uint32_t call, uint32_t token, uint32_t k) const {
    return ((index(static_cast<int32_t>(src), call) * ring_.call_capacity()) + token) * ring_.top_k + k;
  }

  Config config_;
  Problem problem_;
  FrontRingLayout ring_;
  std::vector<std::vector<uint64_t>> buffers_;  // every rank's front ring
  std::vector<uint32_t> tokens_;                // [rank][call]
  // Written by one consumer thread each ([destination][...]), read after join.
  std::vector<std::vector<uint8_t>> routes_;      // [src][call][token][k]: times the route arrived
  std::vector<std::vector<uint32_t>> chunks_seen_;  // [src][call]
  std::vector<std::vector<uint64_t>> pool_fingerprints_;  // [call]
  uint32_t pool_capacity_ = 0;                            // rows of a destination's pool
  mutable std::mutex failures_mutex_;
  std::vector<std::string> failures_;
  std::atomic<bool> aborted_{false};
};

// Producers and consumers of every rank all run at once: route producer, layout producer and
// consumer are separate threads, each going through all calls at its own pace.
void run_concurrent(Emulation& emulation) {
  std::vector<std::thread> threads;
  for (int32_t rank = 0; rank < emulation.num_ranks(); ++rank) {
    for (FrontHalf half : {FrontHalf::route, FrontHalf::layout}) {
      threads.emplace_back([&emulation, rank, half] {
        std::mt19937_64 rng(emulation.seed() * 1000 + static_cast<uint64_t>(rank) * 10 + static_cast<uint32_t>(half));
        for (uint32_t call = 0; call < emulation.calls() && !emulation.failed(); ++call) {
          emulation.produce(rank, half, call, rng);
        }
      });
    }
    threads.emplace_back([&emulation, rank] {
      std::mt19937_64 rng(emulation.seed() * 1000 + static_cast<uint64_t>(rank) * 10 + 7);
      for (uint32_t call = 0; call < emulation.calls() && !emulation.failed(); ++call) {
        emulation.consume(rank, call, rng);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
}

// Each rank in stream order without overlap: the call's producers finish before its consumer
// starts, and the next call's producers start after it (the MoE kernel never launched early).
void run_serialized(Emulation& emulation) {
  std::vector<std::thread> threads;
  for (int32_t rank = 0; rank < emulation.num_ranks(); ++rank) {
    threads.emplace_back([&emulation, rank] {
      std::mt19937_64 rng(emulation.seed() * 1000 + static_cast<uint64_t>(rank));
      for (uint32_t call = 0; call < emulation.calls() && !emulation.failed(); ++call) {
        emulation.produce(rank, FrontHalf::route, call, rng);
        emulation.produce(rank, FrontHalf::layout, call, rng);
        emulation.consume(rank, call, rng);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
}

// Runs `schedule` over the emulation; nothing may fail, and every route must arrive once.
void run_checked(Emulation& emulation, void (*schedule)(Emulation&)) {
  schedule(emulation);
  emulation.expect_no_failure();
  ASSERT_FALSE(emulation.failed()) << "seed " << emulation.seed();
  emulation.check_delivery();
}

TEST(FrontRingEmulation, ConcurrentRanksDeliverEveryRouteOnce) {
  for (uint64_t seed : {1u, 2u}) {
    Config config;
    config.seed = seed;
    Emulation emulation(config);
    ASSERT_NO_FATAL_FAILURE(run_checked(emulation, run_concurrent));
    // Many wraps of every non-empty source's ring.
    EXPECT_GT(emulation.chunks_published(0), 100ull * emulation.slots());
  }
}

TEST(FrontRingEmulation, SerializedRanksDeliverEveryRouteOnce) {
  Config config;
  config.seed = 3;
  Emulation emulation(config);
  ASSERT_NO_FATAL_FAILURE(run_checked(emulation, run_serialized));
}

// The pools' layout depends on the routes only: the same routing, run with every agent at its own
// pace and run serialized, gives every destination the same pool in every call.
TEST(FrontRingEmulation, PoolsDoNotDependOnArrivalOrder) {
  Config config;
  config.seed = 5;
  config.calls = 300;
  Emulation concurrent(config);
  ASSERT_NO_FATAL_FAILURE(run_checked(concurrent, run_concurrent));
  Emulation serialized(config);
  ASSERT_NO_FATAL_FAILURE(run_checked(serialized, run_serialized));
  for (int32_t dst = 0; dst < config.num_ranks; ++dst)
    for (uint32_t call = 0; call < config.calls; ++call)
      ASSERT_EQ(concurrent.pool_fingerprint(dst, call), serialized.pool_fingerprint(dst, call))
          << "destination " << dst << " call " << call;
}

TEST(FrontRingEmulation, OneSlotTwoRanks) {
  Config config;
  config.num_ranks = 2;
  config.num_experts = 4;
  config.top_k = 2;
  config.slots = 1;
  config.tokens_per_slot = 3;
  config.seed = 4;
  Emulation emulation(config);
  ASSERT_NO_FATAL_FAILURE(run_checked(emulation, run_concurrent));
}

// ---- The waits name what they gave up on ----

class FrontRingWaits : public ::testing::Test {
 protected:
  void SetUp() override {
    Problem p;
    p.num_ranks = 3;
    p.num_experts = 3;
    p.top_k = 1;
    p.hidden = 128;
    p.intermediate = 128;
    p.max_tokens_per_rank = 4;
    p.front_num_slots = 2;
    p.front_tokens_per_slot = 2;
    ring = FrontRingLayout::make(p);
    storage.assign(ring.total_bytes / sizeof(uint64_t), 0);
  }
  void* base() { return storage.data(); }

  static constexpr uint64_t kShortNs = 2 * 1000 * 1000;
  FrontRingLayout ring;
  std::vector<uint64_t> storage;
};

TEST_F(FrontRingWaits, ReadyWaitNamesTheMissingHalf) {
  FrontWaitResult result = front_wait_ready<HostAtomics>(ring, base(), 2, 1, kShortNs);
  EXPECT_EQ(result.what, FrontWaitFor::route_ready);
  EXPECT_EQ(result.peer, 2u);
  EXPECT_EQ(result.slot, 1u);
  EXPECT_EQ(result.expected, 1u);
  EXPECT_EQ(result.seen, 0u);

  front_publish<HostAtomics>(ring, base(), FrontHalf::route, 1);
  result = front_wait_ready<HostAtomics>(ring, base(), 2, 1, kShortNs);
  EXPECT_EQ(result.what, FrontWaitFor::layout_ready);
  EXPECT_EQ(result.seen, 0u);

  front_publish<HostAtomics>(ring, base(), FrontHalf::layout, 1);
  EXPECT_TRUE(front_wait_ready<HostAtomics>(ring, base(), 2, 1, kShortNs).ok());
  // The same slot's next generation (sequence 3) is not ready: the old one does not pass for it.
  result = front_wait_ready<HostAtomics>(ring, base(), 2, 3, kShortNs);
  EXPECT_EQ(result.what, FrontWaitFor::route_ready);
  EXPECT_EQ(result.expected, 2u);
  EXPECT_EQ(result.seen, 1u);
}

TEST_F(FrontRingWaits, ReuseNeedsEveryDestination) {
  // First use of each slot: nothing to wait for.
  EXPECT_TRUE(front_wait_slot_free<HostAtomics>(ring, base(), 0, kShortNs).ok());
  EXPECT_TRUE(front_wait_slot_free<HostAtomics>(ring, base(), 1, kShortNs).ok());
  // Sequence 2 reuses slot 0: destinations 0 and 2 acknowledged sequence 0, destination 1 did not.
  front_acknowledge<HostAtomics>(ring, base(), 0, 0);
  front_acknowledge<HostAtomics>(ring, base(), 2, 0);
  FrontWaitResult result = front_wait_slot_free<HostAtomics>(ring, base(), 2, kShortNs);
  EXPECT_EQ(result.what, FrontWaitFor::consumed);
  EXPECT_EQ(result.peer, 1u);
  EXPECT_EQ(result.slot, 0u);
  EXPECT_EQ(result.expected, 1u);
  EXPECT_EQ(result.seen, 0u);
  // An acknowledgement of the other slot does not free this one.
  front_acknowledge<HostAtomics>(ring, base(), 1, 1);
  EXPECT_EQ(front_wait_slot_free<HostAtomics>(ring, base(), 2, kShortNs).what, FrontWaitFor::consumed);
  front_acknowledge<HostAtomics>(ring, base(), 1, 0);
  EXPECT_TRUE(front_wait_slot_free<HostAtomics>(ring, base(), 2, kShortNs).ok());
  // Sequence 4 (generation 3) needs generation 2 acknowledged, which nobody has done.
  result = front_wait_slot_free<HostAtomics>(ring, base(), 4, kShortNs);
  EXPECT_EQ(result.what, FrontWaitFor::consumed);
  EXPECT_EQ(result.peer, 0u);
  EXPECT_EQ(result.expected, 2u);
  EXPECT_EQ(result.seen, 1u);
}

TEST_F(FrontRingWaits, AWaitEndsWhenThePeerPublishes) {
  std::thread producer([this] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    front_publish<HostAtomics>(ring, base(), FrontHalf::layout, 0);
    front_publish<HostAtomics>(ring, base(), FrontHalf::route, 0);
  });
  EXPECT_TRUE(front_wait_ready<HostAtomics>(ring, base(), 0, 0, kTimeoutNs).ok());
  producer.join();
}

}  // namespace
}  // namespace megamoe
