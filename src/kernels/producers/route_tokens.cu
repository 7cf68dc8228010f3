// The router's top-k on the device (megamoe/producers.h), the same steps as the CPU reference
// (src/reference/router.cpp): one warp per token, lane l holding experts l, l + 32, ...; groups
// scored from shared memory, one lane per group; each choice a warp-wide arg-max, ties to the lower
// index as in the reference.
#include <cuda_runtime_api.h>

#include <cmath>

#include "kernels/overlapped_launch.cuh"
#include "kernels/producers/producer_checks.h"
#include "kernels/producers/streamed_producers.h"
#include "kernels/streaming/ring_producer.cuh"
#include "megamoe/config.h"
#include "megamoe/error.h"
#include "megamoe/producers.h"

namespace megamoe {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr uint32_t kFull = 0xFFFFFFFFu;

struct RouteArgs {
  const float* logits;
  const float* bias;  // null: zero
  int32_t* topk_idx;
  float* topk_weights;
  int32_t tokens;
  int32_t num_experts;
  int32_t top_k;
  int32_t num_groups;  // 1: no group limit
  int32_t topk_groups;
  bool sigmoid;
  bool normalize;
  float routed_scaling;
};

// (value, index) ordered as the reference's `largest`: larger value first, then lower index.
__device__ bool before(float value, int32_t index, float other_value, int32_t other_index) {
  return value > other_value || (value == other_value && index < other_index);
}

__device__ void warp_arg_max(float& value, int32_t& index) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other_value = __shfl_xor_sync(kFull, value, offset);
    const int32_t other_index = __shfl_xor_sync(kFull, index, offset);
    if (before(other_value, other_index, value, index)) {
      value = other_value;
      index = other_index;
    }
  }
}

// One token's choices by one warp into topk_idx / topk_weights (the token's rows); `choices` is the
// warp's scratch of kMaxRouterExperts values in shared memory.
template <int kPerLane>
__device__ void route_token(const RouteArgs& a, int32_t token, float* choices, int32_t* topk_idx,
                            float* topk_weights) {
  const uint32_t lane = threadIdx.x % 32;
  const int32_t group_size = a.num_experts / a.num_groups;
  {
    const float* row = a.logits + static_cast<int64_t>(token) * a.num_experts;
    float score[kPerLane], choice[kPerLane];
    float top = -INFINITY;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int32_t expert = static_cast<int32_t>(lane) + 32 * j;
      score[j] = expert < a.num_experts ? row[expert] : -INFINITY;
      top = fmaxf(top, score[j]);
    }
    if (a.sigmoid) {
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int32_t expert = static_cast<int32_t>(lane) + 32 * j;
        const bool valid = expert < a.num_experts;
        score[j] = valid ? 1.0f / (1.0f + expf(-score[j])) : 0.0f;
        choice[j] = valid ? score[j] + (a.bias != nullptr ? a.bias[expert] : 0.0f) : -INFINITY;
      }
    } else {
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) top = fmaxf(top, __shfl_xor_sync(kFull, top, offset));
      float total = 0.0f;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        score[j] = static_cast<int32_t>(lane) + 32 * j < a.num_experts ? expf(score[j] - top) : 0.0f;
        total += score[j];
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) total += __shfl_xor_sync(kFull, total, offset);
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        score[j] /= total;
        choice[j] = static_cast<int32_t>(lane) + 32 * j < a.num_experts ? score[j] : -INFINITY;
      }
    }

    if (a.num_groups > 1) {
      // Lane g scores group g: the sum of its two best choices.
#pragma unroll
      for (int j = 0; j < kPerLane; ++j)
        if (static_cast<int32_t>(lane) + 32 * j < a.num_experts) choices[lane + 32 * j] = choice[j];
      __syncwarp();
      float group_score = -INFINITY;
      if (static_cast<int32_t>(lane) < a.num_groups) {
        float first = -INFINITY, second = -INFINITY;
        int32_t first_index = -1;
        for (int32_t m = 0; m < group_size; ++m) {
          const float value = choices[static_cast<int32_t>(lane) * group_size + m];
          if (first_index < 0 || value > first) {
            second = first;
            first = value;
            first_index = m;
          } else if (m == 1 || value > second) {
            second = value;
          }
        }
        group_score = first + second;
      }
      __syncwarp();  // the slots may be written for the next token
      uint32_t kept = 0;
      for (int32_t g = 0; g < a.topk_groups; ++g) {
        float value = (kept >> lane) & 1u ? -INFINITY : group_score;
        int32_t index = static_cast<int32_t>(lane) < a.num_groups && !((kept >> lane) & 1u) ? static_cast<int32_t>(lane)
                                                                                            : 1 << 30;
        warp_arg_max(value, index);
        kept |= 1u << index;
      }
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int32_t expert = static_cast<int32_t>(lane) + 32 * j;
        if (expert < a.num_experts && !((kept >> (expert / group_size)) & 1u)) choice[j] = -INFINITY;
      }
    }

    // The top_k choices in order; lane k keeps choice k.
    float sum = 0.0f, my_score = 0.0f;
    int32_t my_expert = 0;
    for (int32_t k = 0; k < a.top_k; ++k) {
      float value = -INFINITY;
      int32_t index = 1 << 30;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const int32_t expert = static_cast<int32_t>(lane) + 32 * j;
        if (expert < a.num_experts && before(choice[j], expert, value, index)) {
          value = choice[j];
          index = expert;
        }
      }
      warp_arg_max(value, index);
      float owned = 0.0f;
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        if (static_cast<int32_t>(lane) + 32 * j == index) {
          owned = score[j];
          choice[j] = -INFINITY;  // taken
        }
      }
      const float chosen_score = __shfl_sync(kFull, owned, index % 32);
      sum += chosen_score;
      if (static_cast<int32_t>(lane) == k) {
        my_score = chosen_score;
        my_expert = index;
      }
    }
    if (static_cast<int32_t>(lane) < a.top_k) {
      const float weight = a.normalize && sum > 0.0f ? my_score / sum : my_score;
      topk_idx[lane] = my_expert;
      topk_weights[lane] = weight * a.routed_scaling;
    }
  }
}

template <int kPerLane>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) route_tokens_kernel(const RouteArgs a) {
  __shared__ float block_choices[kWarpsPerBlock][kMaxRouterExperts];
  const int32_t warps = static_cast<int32_t>(gridDim.x) * kWarpsPerBlock;
  for (int32_t token = static_cast<int32_t>((blockIdx.x * blockDim.x + threadIdx.x) / 32); token < a.tokens;
       token += warps) {
    const int64_t route = static_cast<int64_t>(token) * a.top_k;
    route_token<kPerLane>(a, token, block_choices[threadIdx.x / 32], a.topk_idx + route, a.topk_weights + route);
  }
}

// The same routes published chunk by chunk into the front ring: a part is up to kRingTokensPerWarp
// tokens per warp of one chunk (front_tokens_per_part: one per warp while the call's tokens fit the
// launch's warps), written into the chunk's slot.
constexpr uint32_t kRingTokensPerWarp = 4;

template <int kPerLane>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) route_tokens_ring_kernel(const RouteArgs a,
                                                                              const device::FrontProducer p) {
  __shared__ float block_choices[kWarpsPerBlock][kMaxRouterExperts];
  device::front_produce(p, [&](uint32_t slot, const FrontSlotMeta& meta, uint32_t begin, uint32_t end) {
    // Launched overlapped (detail::route_tokens), the logits kernel may still run: its logits are
    // read only after it has completed. (Once it has, the call returns at once.)
    wait_for_prior_kernels();
    for (uint32_t t = begin + threadIdx.x / 32; t < end; t += kWarpsPerBlock) {
      route_token<kPerLane>(a, static_cast<int32_t>(meta.token_base + t), block_choices[threadIdx.x / 32],
                            p.ring.slot_topk_idx(p.own_ring, slot) + t * p.ring.top_k,
                            p.ring.slot_topk_weights(p.own_ring, slot) + t * p.ring.top_k);
    }
  });
}

// ring: null for the batch outputs in `a`. overlapped: the ring form as a programmatic dependent.
template <int kPerLane>
cudaError_t launch(const RouteArgs& a, const device::FrontProducer* ring, uint32_t ring_grid, cudaStream_t stream,
                   bool overlapped) {
  if (ring != nullptr)
    return launch_kernel(route_tokens_ring_kernel<kPerLane>, dim3(ring_grid), dim3(32 * kWarpsPerBlock), 0, stream,
                         overlapped, a, *ring);
  const int32_t blocks = (a.tokens + kWarpsPerBlock - 1) / kWarpsPerBlock;
  route_tokens_kernel<kPerLane><<<blocks < 65536 ? blocks : 65536, 32 * kWarpsPerBlock, 0, stream>>>(a);
  return cudaGetLastError();
}

void launch(const RouteArgs& a, const RouterConfig& config, const device::FrontProducer* ring, uint32_t ring_grid,
            cudaStream_t stream, bool overlapped = false) {
  const int32_t per_lane = (config.num_experts + 31) / 32;
  cudaError_t status;
  if (per_lane <= 1) status = launch<1>(a, ring, ring_grid, stream, overlapped);
  else if (per_lane <= 2) status = launch<2>(a, ring, ring_grid, stream, overlapped);
  else if (per_lane <= 4) status = launch<4>(a, ring, ring_grid, stream, overlapped);
  else if (per_lane <= 8) status = launch<8>(a, ring, ring_grid, stream, overlapped);
  else if (per_lane <= 16) status = launch<16>(a, ring, ring_grid, stream, overlapped);
  else status = launch<32>(a, ring, ring_grid, stream, overlapped);
  require(status == cudaSuccess, "route_tokens", "launch failed: ", cudaGetErrorString(status));
}

RouteArgs route_args(const RouterConfig& config, const TensorView& logits, const TensorView& bias, int64_t tokens,
                     int32_t* topk_idx, float* topk_weights) {
  return RouteArgs{logits.as<float>(), bias.empty() ? nullptr : bias.as<float>(), topk_idx, topk_weights,
                   static_cast<int32_t>(tokens), config.num_experts, config.top_k,
                   config.num_groups, config.topk_groups, config.scoring == RouterScoring::sigmoid,
                   config.normalize, config.routed_scaling};
}

}  // namespace

int64_t detail::check_route_arguments(const RouterConfig& config, const TensorView& logits, const TensorView& bias) {
  validate(config);
  require(config.num_experts <= kMaxRouterExperts, "num_experts", "must be at most ", kMaxRouterExperts,
          " on the device (one warp per token), got ", config.num_experts);
  require(config.num_groups <= kMaxRouterGroups, "num_groups", "must be at most ", kMaxRouterGroups,
          " on the device (one lane per group), got ", config.num_groups);
  require(logits.ndim == 2, "logits", "must have 2 dimensions [tokens, num_experts], got ", logits.ndim);
  const int64_t tokens = logits.shape[0];
  require(tokens <= INT32_MAX / kMaxTopK, "logits", "holds too many tokens: ", tokens);
  check_tensor(logits, "logits", DType::f32, {tokens, config.num_experts}, Device::cuda);
  require(bias.empty() || config.scoring == RouterScoring::sigmoid, "bias",
          "corrects the sigmoid router's choice only; softmax scoring takes none");
  if (!bias.empty()) check_tensor(bias, "bias", DType::f32, {config.num_experts}, Device::cuda);
  return tokens;
}

void route_tokens(const RouterConfig& config, const TensorView& logits, const TensorView& bias,
                  const TensorView& topk_idx, const TensorView& topk_weights, cudaStream_t stream) {
  const int64_t tokens = detail::check_route_arguments(config, logits, bias);
  check_tensor(topk_idx, "topk_idx", DType::i32, {tokens, config.top_k}, Device::cuda);
  check_tensor(topk_weights, "topk_weights", DType::f32, {tokens, config.top_k}, Device::cuda);
  if (tokens == 0) return;
  launch(route_args(config, logits, bias, tokens, topk_idx.as<int32_t>(), topk_weights.as<float>()), config, nullptr,
         0, stream);
}

void route_tokens(const RouterConfig& config, const TensorView& logits, const TensorView& bias, SymmBuffer& buffer,
                  cudaStream_t stream) {
  detail::route_tokens(config, logits, bias, buffer, stream, false);
}

void detail::route_tokens(const RouterConfig& config, const TensorView& logits, const TensorView& bias,
                          SymmBuffer& buffer, cudaStream_t stream, bool overlapped) {
  const int64_t tokens = detail::check_route_arguments(config, logits, bias);
  const Problem& p = buffer.problem();
  require(config.num_experts == p.num_experts && config.top_k == p.top_k, "config",
          "routes to ", config.num_experts, " experts, top-", config.top_k, "; the buffer's problem has ",
          p.num_experts, ", top-", p.top_k);
  const device::FrontProducer ring = device::make_front_producer(buffer, FrontHalf::route, tokens, kWarpsPerBlock,
                                                                 kWarpsPerBlock * kRingTokensPerWarp, "logits");
  // Even a call with no tokens publishes its one empty chunk.
  launch(route_args(config, logits, bias, tokens, nullptr, nullptr), config, &ring,
         device::front_producer_grid(ring, buffer), stream, overlapped);
  ++buffer.front_calls().route;
}

}  // namespace megamoe
