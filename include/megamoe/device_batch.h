// One rank's RankBatch (reference.h) in device memory, as the layer's inputs: for tools and tests
// that generate inputs on the host.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "megamoe/layer.h"
#include "megamoe/problem.h"
#include "megamoe/reference.h"

namespace megamoe {

class DeviceBatch {
 public:
  // Allocates room for `num_tokens` tokens. Allocate before any rank launches work: on a GPU shared
  // by emulated ranks an allocation may wait for another rank's kernels.
  DeviceBatch(const Problem& problem, int32_t num_tokens);
  ~DeviceBatch();
  DeviceBatch(const DeviceBatch&) = delete;
  DeviceBatch& operator=(const DeviceBatch&) = delete;

  // Copies `batch` (same token count) in, ordered on `stream`; returns when the copies are done.
  void fill(const RankBatch& batch, cudaStream_t stream);

  const LayerInputs& inputs() const { return inputs_; }

 private:
  struct Memory;
  std::unique_ptr<Memory> memory_;
  LayerInputs inputs_;
};

}  // namespace megamoe
