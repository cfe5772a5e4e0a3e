#pragma once
// Certificates for TLS tests, made by tests/testing/make_certificates.sh in a folder of
// their own (what it makes: see there).
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace kvmem::testing {

// Makes them in `dir`; false when openssl could not.
inline bool MakeTestCertificates(const std::string& dir) {
  return std::system(absl::StrCat("/bin/sh '", KVMEM_TEST_CERTIFICATES_SCRIPT, "' '", dir,
                                  "' >/dev/null 2>&1")
                         .c_str()) == 0;
}

// The text of `dir`/`name` (empty if it cannot be read).
inline std::string ReadTestPem(const std::string& dir, const std::string& name) {
  std::ifstream in(dir + "/" + name);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace kvmem::testing
