#pragma once
// GgufFile: a reader for GGUF v2/v3 model files (the llama.cpp container): header,
// metadata, tensor directory, and tensor data mapped read-only. Every offset and length is
// checked against the file, so a corrupt or truncated file gives a clear error, never a
// crash.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"

namespace kvmem::worker {

// ggml tensor types this reader can turn into f32.
enum class GgmlType : uint32_t { kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

using GgufArray = std::variant<std::vector<int64_t>, std::vector<double>, std::vector<std::string>>;
// Scalars are widened: integers and bools to int64, floats to double.
using GgufValue = std::variant<int64_t, double, std::string, GgufArray>;

struct GgufTensor {
  std::string name;
  uint32_t type = 0;
  std::vector<uint64_t> dims;  // dims[0] is the row length (innermost)
  uint64_t elements = 0;
  uint64_t bytes = 0;
  const uint8_t* data = nullptr;
};

class GgufFile {
 public:
  static absl::StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  uint32_t version() const { return version_; }
  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  const std::vector<GgufTensor>& tensors() const { return tensors_; }

  absl::StatusOr<int64_t> GetInt(const std::string& key) const;
  absl::StatusOr<double> GetFloat(const std::string& key) const;
  absl::StatusOr<std::string> GetString(const std::string& key) const;
  absl::StatusOr<std::vector<std::string>> GetStrings(const std::string& key) const;
  absl::StatusOr<std::vector<int64_t>> GetInts(const std::string& key) const;
  absl::StatusOr<const GgufTensor*> Tensor(const std::string& name) const;
  // The tensor as f32, row-major with dims[0] innermost.
  absl::StatusOr<std::vector<float>> ToFloat(const GgufTensor& tensor) const;

 private:
  GgufFile() = default;
  std::string path_;
  uint8_t* map_ = nullptr;
  uint64_t size_ = 0;
  uint32_t version_ = 0;
  std::map<std::string, GgufValue> metadata_;
  std::vector<GgufTensor> tensors_;
};

// Parses an in-memory GGUF image (used by Open and by tests on crafted bytes). `data` must
// outlive the returned tensors' data pointers.
absl::Status ParseGguf(const uint8_t* data, uint64_t size, uint32_t* version,
                       std::map<std::string, GgufValue>* metadata,
                       std::vector<GgufTensor>* tensors);

}  // namespace kvmem::worker
