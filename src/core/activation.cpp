#include "megamoe/activation.h"

#include "megamoe/error.h"

namespace megamoe {

float kernel_activation_clamp(float activation_clamp, const char* argument) {
  require(!std::isnan(activation_clamp) && activation_clamp >= 0.0f, argument,
          "must be positive (the clamp), 0 or +infinity (no clamp), got ", activation_clamp);
  return activation_clamp == 0.0f ? std::numeric_limits<float>::infinity() : activation_clamp;
}

}  // namespace megamoe
