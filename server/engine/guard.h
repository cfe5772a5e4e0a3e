#pragma once
// GuardHostMemory: runs a call so that host memory exhaustion (std::bad_alloc) comes back as
// RESOURCE_EXHAUSTED instead of crossing the engine's boundary. A write section open when it
// is thrown poisons its sequence on the way out (TableVersions::WriteSection).
#include <new>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvmem::engine {

template <typename F>
auto GuardHostMemory(absl::string_view what, F&& call) -> decltype(call()) {
  try {
    return call();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, ": out of host memory (kvmemd could not allocate)"));
  }
}

}  // namespace kvmem::engine
