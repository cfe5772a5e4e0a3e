#pragma once
// Certificates for TLS tests, made by the openssl command in a folder of their own: CAs
// "ca" and "other"; "server", for localhost and 127.0.0.1, signed by ca; clients "alice"
// and "bob" signed by ca, and "mallory", whose common name is alice, signed by other. Each
// NAME has NAME.pem and NAME.key.
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace kvmem::testing {

// Makes them in `dir` (emptied first); false when openssl could not.
inline bool MakeTestCertificates(const std::string& dir) {
  const std::string script = absl::StrCat(
      "set -e; rm -rf ", dir, "; mkdir -p ", dir, "; cd ", dir, "\n",
      "key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:prime256v1 "
      "-out $1.key 2>/dev/null; }\n",
      "ca() { key $1; openssl req -x509 -new -key $1.key -out $1.pem -days 2 -subj /CN=$1; }\n",
      "cert() { key $1; openssl req -new -key $1.key -out $1.csr -subj /CN=$2; "
      "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > $1.ext; "
      "openssl x509 -req -in $1.csr -CA $3.pem -CAkey $3.key -CAcreateserial -out $1.pem "
      "-days 2 -extfile $1.ext 2>/dev/null; }\n",
      "ca ca; ca other; cert server localhost ca; cert alice alice ca; cert bob bob ca; "
      "cert mallory alice other\n");
  return std::system(
             absl::StrCat("/bin/sh -c '", absl::StrReplaceAll(script, {{"'", "'\\''"}}), "'")
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
