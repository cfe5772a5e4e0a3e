// The GGUF reader on arbitrary bytes: a parse either fails with a status or yields tensors
// whose data lies inside the image, every one of its declared bytes.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "client/worker/gguf.h"
#include "fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  uint32_t version = 0;
  std::map<std::string, kvmem::worker::GgufValue> metadata;
  std::vector<kvmem::worker::GgufTensor> tensors;
  if (!kvmem::worker::ParseGguf(data, size, &version, &metadata, &tensors).ok()) return 0;
  FUZZ_CHECK(version == 2 || version == 3, "version %u parsed", version);
  for (const kvmem::worker::GgufTensor& t : tensors) {
    FUZZ_CHECK(t.data >= data && t.bytes <= size &&
                   t.data - data <= static_cast<ptrdiff_t>(size - t.bytes),
               "tensor %s: %llu bytes at offset %td of a %zu-byte image", t.name.c_str(),
               static_cast<unsigned long long>(t.bytes), t.data - data, size);
    // The size again, from the dims and the type's block size here, not the reader's.
    unsigned __int128 elements = 1;
    for (uint64_t d : t.dims) elements *= d;
    unsigned __int128 expected = 0;
    switch (t.type) {
      case 0:
        expected = elements * 4;
        break;  // f32
      case 1:
        expected = elements * 2;
        break;  // f16
      case 2:
        expected = elements / 32 * 18;
        break;  // q4_0: 32 values in 2 + 16 bytes
      case 3:
        expected = elements / 32 * 20;
        break;  // q4_1: 32 values in 4 + 16 bytes
      case 8:
        expected = elements / 32 * 34;
        break;  // q8_0: 32 values in 2 + 32 bytes
      default:
        expected = t.bytes;
        break;  // a type the reader does not convert
    }
    FUZZ_CHECK(expected == t.bytes && elements == t.elements,
               "tensor %s of type %u: %llu bytes and %llu elements declared for its dims",
               t.name.c_str(), t.type, static_cast<unsigned long long>(t.bytes),
               static_cast<unsigned long long>(t.elements));
    // Touch the first and last byte: an address outside the image faults under ASan.
    if (t.bytes > 0) {
      volatile uint8_t first = t.data[0], last = t.data[t.bytes - 1];
      (void)first;
      (void)last;
    }
  }
  return 0;
}
