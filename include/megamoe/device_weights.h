// Expert weights of one rank on its GPU, in the layout the kernels read: transformed from a
// WeightSource (canonical stored weights) and uploaded once.
#pragma once

#include <memory>

#include "megamoe/layer.h"
#include "megamoe/problem.h"
#include "megamoe/reference.h"

namespace megamoe {

class DeviceWeights {
 public:
  // Transforms and uploads the experts local to `problem.rank` and, when there are shared experts,
  // their concatenation. The current CUDA device must be the rank's.
  DeviceWeights(const Problem& problem, const WeightSource& source);
  ~DeviceWeights();
  DeviceWeights(const DeviceWeights&) = delete;
  DeviceWeights& operator=(const DeviceWeights&) = delete;

  const LayerWeights& view() const { return view_; }

  struct Allocations;

 private:
  std::unique_ptr<Allocations> allocations_;
  LayerWeights view_;
};

}  // namespace megamoe
