#pragma once
// An environment variable set for a scope: what was there before (or nothing) is put back
// when the scope ends, an ASSERT's early return included, so that a failed test cannot
// change the tests after it in the same process (UCX_TLS: which transports UCX opens).
#include <cstdlib>
#include <optional>
#include <string>

namespace kvmem::testing {

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* before = std::getenv(name)) before_ = before;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (before_) {
      setenv(name_.c_str(), before_->c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> before_;
};

}  // namespace kvmem::testing
