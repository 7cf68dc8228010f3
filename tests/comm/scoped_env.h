// Sets or unsets an environment variable for one scope, restoring it afterwards.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

namespace megamoe::comm_test {

class ScopedEnv {
 public:
  // A null `value` unsets the variable.
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) previous_ = old;
    if (value != nullptr) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (previous_) {
      setenv(name_.c_str(), previous_->c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> previous_;
};

// The timeout scenarios wait this long for a rank or block that never comes.
inline constexpr const char* kShortTimeoutMs = "1000";

}  // namespace megamoe::comm_test
