#include "gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"

namespace kvmem::worker {
namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" little-endian
constexpr uint64_t kMaxString = 1ull << 30;
constexpr uint64_t kMaxArray = 1ull << 32;
constexpr uint32_t kMaxDims = 4;

enum ValueType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};

// Bounds-checked cursor over the file image.
class Cursor {
 public:
  Cursor(const uint8_t* data, uint64_t size) : data_(data), size_(size) {}
  uint64_t pos() const { return pos_; }

  template <typename T>
  absl::Status Read(T* out, const char* what) {
    if (size_ - pos_ < sizeof(T)) return Truncated(what);
    std::memcpy(out, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return absl::OkStatus();
  }
  absl::Status ReadString(std::string* out, const char* what) {
    uint64_t n;
    if (absl::Status s = Read(&n, what); !s.ok()) return s;
    if (n > kMaxString) {
      return absl::DataLossError(
          absl::StrCat("gguf: ", what, " claims a string of ", n, " bytes at offset ", pos_));
    }
    if (size_ - pos_ < n) return Truncated(what);
    out->assign(reinterpret_cast<const char*>(data_ + pos_), n);
    pos_ += n;
    return absl::OkStatus();
  }
  absl::Status Truncated(const char* what) const {
    return absl::DataLossError(absl::StrCat("gguf: file truncated while reading ", what,
                                            " at offset ", pos_, " of ", size_));
  }

 private:
  const uint8_t* data_;
  uint64_t size_;
  uint64_t pos_ = 0;
};

absl::Status ReadScalar(Cursor& c, uint32_t type, GgufValue* out, const char* what) {
  auto read_int = [&](auto v) -> absl::Status {
    if (absl::Status s = c.Read(&v, what); !s.ok()) return s;
    *out = static_cast<int64_t>(v);
    return absl::OkStatus();
  };
  switch (type) {
    case kU8:
      return read_int(uint8_t{});
    case kI8:
      return read_int(int8_t{});
    case kU16:
      return read_int(uint16_t{});
    case kI16:
      return read_int(int16_t{});
    case kU32:
      return read_int(uint32_t{});
    case kI32:
      return read_int(int32_t{});
    case kBool:
      return read_int(uint8_t{});
    case kU64:
      return read_int(uint64_t{});
    case kI64:
      return read_int(int64_t{});
    case kF32: {
      float f;
      if (absl::Status s = c.Read(&f, what); !s.ok()) return s;
      *out = static_cast<double>(f);
      return absl::OkStatus();
    }
    case kF64: {
      double d;
      if (absl::Status s = c.Read(&d, what); !s.ok()) return s;
      *out = d;
      return absl::OkStatus();
    }
    case kString: {
      std::string str;
      if (absl::Status s = c.ReadString(&str, what); !s.ok()) return s;
      *out = std::move(str);
      return absl::OkStatus();
    }
    default:
      return absl::DataLossError(absl::StrCat("gguf: ", what, " has unknown value type ", type));
  }
}

absl::Status ReadValue(Cursor& c, uint32_t type, GgufValue* out, const std::string& key) {
  if (type != kArray) return ReadScalar(c, type, out, key.c_str());
  uint32_t elem;
  uint64_t n;
  if (absl::Status s = c.Read(&elem, key.c_str()); !s.ok()) return s;
  if (absl::Status s = c.Read(&n, key.c_str()); !s.ok()) return s;
  if (n > kMaxArray || elem == kArray) {
    return absl::DataLossError(absl::StrCat("gguf: metadata ", key, ": array of ", n,
                                            " elements of type ", elem, " is not supported"));
  }
  GgufArray array;
  if (elem == kString) {
    std::vector<std::string> v;
    v.reserve(std::min<uint64_t>(n, 1 << 20));
    for (uint64_t i = 0; i < n; ++i) {
      std::string str;
      if (absl::Status s = c.ReadString(&str, key.c_str()); !s.ok()) return s;
      v.push_back(std::move(str));
    }
    array = std::move(v);
  } else if (elem == kF32 || elem == kF64) {
    std::vector<double> v;
    for (uint64_t i = 0; i < n; ++i) {
      GgufValue x;
      if (absl::Status s = ReadScalar(c, elem, &x, key.c_str()); !s.ok()) return s;
      v.push_back(std::get<double>(x));
    }
    array = std::move(v);
  } else {
    std::vector<int64_t> v;
    for (uint64_t i = 0; i < n; ++i) {
      GgufValue x;
      if (absl::Status s = ReadScalar(c, elem, &x, key.c_str()); !s.ok()) return s;
      v.push_back(std::get<int64_t>(x));
    }
    array = std::move(v);
  }
  *out = std::move(array);
  return absl::OkStatus();
}

// Bytes of `elements` values of a ggml type; 0 for unknown types.
uint64_t TypeBytes(uint32_t type, uint64_t elements) {
  switch (static_cast<GgmlType>(type)) {
    case GgmlType::kF32:
      return elements * 4;
    case GgmlType::kF16:
      return elements * 2;
    case GgmlType::kQ4_0:
      return elements / 32 * 18;
    case GgmlType::kQ4_1:
      return elements / 32 * 20;
    case GgmlType::kQ8_0:
      return elements / 32 * 34;
  }
  return 0;
}

}  // namespace

absl::Status ParseGguf(const uint8_t* data, uint64_t size, uint32_t* version,
                       std::map<std::string, GgufValue>* metadata,
                       std::vector<GgufTensor>* tensors) {
  Cursor c(data, size);
  uint32_t magic;
  if (absl::Status s = c.Read(&magic, "magic"); !s.ok()) return s;
  if (magic != kMagic) return absl::DataLossError("gguf: not a GGUF file (bad magic)");
  if (absl::Status s = c.Read(version, "version"); !s.ok()) return s;
  if (*version < 2 || *version > 3) {
    return absl::DataLossError(
        absl::StrCat("gguf: version ", *version, " is not supported (2, 3)"));
  }
  uint64_t n_tensors, n_kv;
  if (absl::Status s = c.Read(&n_tensors, "tensor count"); !s.ok()) return s;
  if (absl::Status s = c.Read(&n_kv, "metadata count"); !s.ok()) return s;
  if (n_tensors > (1 << 20) || n_kv > (1 << 20)) {
    return absl::DataLossError(absl::StrCat("gguf: implausible counts (", n_tensors, " tensors, ",
                                            n_kv, " metadata entries)"));
  }
  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key;
    uint32_t type;
    if (absl::Status s = c.ReadString(&key, "metadata key"); !s.ok()) return s;
    if (absl::Status s = c.Read(&type, "metadata type"); !s.ok()) return s;
    GgufValue value;
    if (absl::Status s = ReadValue(c, type, &value, key); !s.ok()) return s;
    (*metadata)[key] = std::move(value);
  }
  uint64_t alignment = 32;
  if (auto it = metadata->find("general.alignment"); it != metadata->end()) {
    if (!std::holds_alternative<int64_t>(it->second) || std::get<int64_t>(it->second) <= 0 ||
        (std::get<int64_t>(it->second) & (std::get<int64_t>(it->second) - 1)) != 0) {
      return absl::DataLossError("gguf: general.alignment must be a power of two");
    }
    alignment = static_cast<uint64_t>(std::get<int64_t>(it->second));
  }
  std::vector<uint64_t> offsets;
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensor t;
    uint32_t n_dims;
    uint64_t offset;
    if (absl::Status s = c.ReadString(&t.name, "tensor name"); !s.ok()) return s;
    if (absl::Status s = c.Read(&n_dims, "tensor dims"); !s.ok()) return s;
    if (n_dims == 0 || n_dims > kMaxDims) {
      return absl::DataLossError(absl::StrCat("gguf: tensor ", t.name, " has ", n_dims, " dims"));
    }
    t.elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      uint64_t dim;
      if (absl::Status s = c.Read(&dim, "tensor dim"); !s.ok()) return s;
      if (dim == 0 || dim > (1ull << 32) || t.elements > (1ull << 40) / dim) {
        return absl::DataLossError(absl::StrCat("gguf: tensor ", t.name, " has a bad dim ", dim));
      }
      t.dims.push_back(dim);
      t.elements *= dim;
    }
    if (absl::Status s = c.Read(&t.type, "tensor type"); !s.ok()) return s;
    if (absl::Status s = c.Read(&offset, "tensor offset"); !s.ok()) return s;
    t.bytes = TypeBytes(t.type, t.elements);
    if (t.bytes == 0 || (t.type != 0 && t.type != 1 && t.elements % 32 != 0)) {
      return absl::UnimplementedError(absl::StrCat("gguf: tensor ", t.name, " has ggml type ",
                                                   t.type, ", which this reader cannot decode"));
    }
    offsets.push_back(offset);
    tensors->push_back(std::move(t));
  }
  const uint64_t data_start = (c.pos() + alignment - 1) / alignment * alignment;
  for (size_t i = 0; i < tensors->size(); ++i) {
    GgufTensor& t = (*tensors)[i];
    if (offsets[i] % alignment != 0 || data_start > size || offsets[i] > size - data_start ||
        t.bytes > size - data_start - offsets[i]) {
      return absl::DataLossError(absl::StrCat("gguf: tensor ", t.name, " (", t.bytes,
                                              " bytes at data offset ", offsets[i],
                                              ") lies outside the file of ", size, " bytes"));
    }
    t.data = data + data_start + offsets[i];
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) {
    return absl::NotFoundError(
        absl::StrCat("gguf: cannot open ", path, ": ", std::strerror(errno)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size <= 0) {
    close(fd);
    return absl::DataLossError(absl::StrCat("gguf: ", path, " is empty or unreadable"));
  }
  void* map = mmap(nullptr, st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (map == MAP_FAILED) {
    return absl::InternalError(absl::StrCat("gguf: mmap ", path, ": ", std::strerror(errno)));
  }
  std::unique_ptr<GgufFile> file(new GgufFile());
  file->path_ = path;
  file->map_ = static_cast<uint8_t*>(map);
  file->size_ = static_cast<uint64_t>(st.st_size);
  if (absl::Status s =
          ParseGguf(file->map_, file->size_, &file->version_, &file->metadata_, &file->tensors_);
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
  }
  return file;
}

GgufFile::~GgufFile() {
  if (map_ != nullptr) munmap(map_, size_);
}

namespace {
template <typename T>
absl::StatusOr<T> Get(const std::map<std::string, GgufValue>& m, const std::string& key,
                      const char* kind) {
  auto it = m.find(key);
  if (it == m.end())
    return absl::NotFoundError(absl::StrCat("gguf: metadata ", key, " is missing"));
  if (!std::holds_alternative<T>(it->second)) {
    return absl::DataLossError(absl::StrCat("gguf: metadata ", key, " is not ", kind));
  }
  return std::get<T>(it->second);
}
}  // namespace

absl::StatusOr<int64_t> GgufFile::GetInt(const std::string& key) const {
  return Get<int64_t>(metadata_, key, "an integer");
}

absl::StatusOr<double> GgufFile::GetFloat(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it != metadata_.end() && std::holds_alternative<int64_t>(it->second)) {
    return static_cast<double>(std::get<int64_t>(it->second));
  }
  return Get<double>(metadata_, key, "a number");
}

absl::StatusOr<std::string> GgufFile::GetString(const std::string& key) const {
  return Get<std::string>(metadata_, key, "a string");
}

absl::StatusOr<std::vector<std::string>> GgufFile::GetStrings(const std::string& key) const {
  absl::StatusOr<GgufArray> a = Get<GgufArray>(metadata_, key, "an array");
  if (!a.ok()) return a.status();
  if (!std::holds_alternative<std::vector<std::string>>(*a)) {
    return absl::DataLossError(absl::StrCat("gguf: metadata ", key, " is not a string array"));
  }
  return std::get<std::vector<std::string>>(*a);
}

absl::StatusOr<std::vector<int64_t>> GgufFile::GetInts(const std::string& key) const {
  absl::StatusOr<GgufArray> a = Get<GgufArray>(metadata_, key, "an array");
  if (!a.ok()) return a.status();
  if (!std::holds_alternative<std::vector<int64_t>>(*a)) {
    return absl::DataLossError(absl::StrCat("gguf: metadata ", key, " is not an integer array"));
  }
  return std::get<std::vector<int64_t>>(*a);
}

absl::StatusOr<const GgufTensor*> GgufFile::Tensor(const std::string& name) const {
  for (const GgufTensor& t : tensors_) {
    if (t.name == name) return &t;
  }
  return absl::NotFoundError(absl::StrCat("gguf: tensor ", name, " is missing from ", path_));
}

absl::StatusOr<std::vector<float>> GgufFile::ToFloat(const GgufTensor& t) const {
  std::vector<float> out(t.elements);
  const uint8_t* p = t.data;
  switch (static_cast<GgmlType>(t.type)) {
    case GgmlType::kF32:
      std::memcpy(out.data(), p, t.elements * 4);
      return out;
    case GgmlType::kF16:
      for (uint64_t i = 0; i < t.elements; ++i)
        out[i] = kernels::LoadElem(p, i, kernels::ElemType::kF16);
      return out;
    case GgmlType::kQ4_0:  // blocks of 32: f16 d, 16 bytes; x = d * (q - 8)
      for (uint64_t b = 0; b < t.elements / 32; ++b, p += 18) {
        const float d = kernels::LoadElem(p, 0, kernels::ElemType::kF16);
        for (int j = 0; j < 16; ++j) {
          out[b * 32 + j] = d * static_cast<float>((p[2 + j] & 0x0f) - 8);
          out[b * 32 + j + 16] = d * static_cast<float>((p[2 + j] >> 4) - 8);
        }
      }
      return out;
    case GgmlType::kQ4_1:  // blocks of 32: f16 d, f16 m, 16 bytes; x = d * q + m
      for (uint64_t b = 0; b < t.elements / 32; ++b, p += 20) {
        const float d = kernels::LoadElem(p, 0, kernels::ElemType::kF16);
        const float m = kernels::LoadElem(p, 1, kernels::ElemType::kF16);
        for (int j = 0; j < 16; ++j) {
          out[b * 32 + j] = d * static_cast<float>(p[4 + j] & 0x0f) + m;
          out[b * 32 + j + 16] = d * static_cast<float>(p[4 + j] >> 4) + m;
        }
      }
      return out;
    case GgmlType::kQ8_0:  // blocks of 32: f16 d, 32 int8; x = d * q
      for (uint64_t b = 0; b < t.elements / 32; ++b, p += 34) {
        const float d = kernels::LoadElem(p, 0, kernels::ElemType::kF16);
        for (int j = 0; j < 32; ++j)
          out[b * 32 + j] = d * static_cast<float>(static_cast<int8_t>(p[2 + j]));
      }
      return out;
  }
  return absl::UnimplementedError(absl::StrCat("gguf: tensor ", t.name, " type ", t.type));
}

}  // namespace kvmem::worker
