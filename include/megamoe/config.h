// Macros and limits shared by host and device code.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MEGAMOE_HD __host__ __device__ __forceinline__
#define MEGAMOE_DEVICE __device__ __forceinline__
#else
#define MEGAMOE_HD inline
#endif

namespace megamoe {

inline constexpr int kMaxRanks = 64;          // peer-pointer tables are sized for this many ranks
inline constexpr int kMaxTopK = 16;           // top-k choices per token
inline constexpr int kScaleBlock = 128;       // FP8 activation scales cover 1x128, weight scales 128x128
inline constexpr int kMxBlock = 32;           // MXFP4: one UE8M0 scale per 32 values
inline constexpr int kGateUpInterleave = 64;  // transformed W1 alternates 64 gate rows and 64 up rows
inline constexpr uint32_t kLibraryVersion = 2;  // bump when the buffer layout or weight layout changes

}  // namespace megamoe
