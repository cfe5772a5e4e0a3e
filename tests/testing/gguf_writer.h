#pragma once
// GgufWriter: GGUF images built field by field, for tests and fuzz harnesses of the reader
// (little-endian, as the format is).
#include <cstdint>
#include <string>
#include <vector>

namespace kvmem::testing {

class GgufWriter {
 public:
  template <typename T>
  void Put(T v) {
    bytes_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  void Str(const std::string& s) {
    Put<uint64_t>(s.size());
    bytes_ += s;
  }
  // A metadata entry: `key`, an array of strings.
  void Strings(const std::string& key, const std::vector<std::string>& values) {
    Str(key);
    Put<uint32_t>(9);  // array
    Put<uint32_t>(8);  // of strings
    Put<uint64_t>(values.size());
    for (const std::string& v : values) Str(v);
  }
  void Align(size_t a) {
    while (bytes_.size() % a != 0) bytes_.push_back('\0');
  }
  std::string& bytes() { return bytes_; }

 private:
  std::string bytes_;
};

}  // namespace kvmem::testing
