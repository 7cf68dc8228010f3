// The one exception type megamoe throws: its message names the argument and the rule it broke.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace megamoe {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

// An Error of the device or its runtime rather than of an argument: a CUDA or NCCL call that failed,
// or what the kernels recorded (SymmBuffer::check_device_error). The Python extension raises these as
// RuntimeError and every other Error as ValueError.
class DeviceFailure : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <typename... Parts>
std::string concat(Parts&&... parts) {
  std::ostringstream out;
  (out << ... << std::forward<Parts>(parts));
  return out.str();
}
}  // namespace detail

// Throws megamoe::Error("<argument>: <rule pieces...>") when the condition is false.
template <typename... Parts>
inline void require(bool condition, const char* argument, Parts&&... rule) {
  if (!condition) throw Error(detail::concat(argument, ": ", std::forward<Parts>(rule)...));
}

}  // namespace megamoe
