// The tokenizer on arbitrary text (any bytes, malformed UTF-8 included): encoding never
// fails or crashes, and byte-level BPE loses nothing, so decoding the ids gives the text
// back, with special tokens parsed or not. The vocabulary is a small GPT-2 style one built
// here: every byte's symbol, a few merges, the chat format's special tokens.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/worker/gguf.h"
#include "client/worker/tokenizer.h"
#include "fuzz/fuzz_input.h"
#include "tests/testing/gguf_writer.h"

namespace kvmem::fuzz {
namespace {

// GPT-2's byte-to-symbol map: printable bytes stand for themselves, the rest for 256 + k.
std::string Symbol(int byte) {
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae);
    const uint32_t cp = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + next++);
    if (b != byte) continue;
    std::string out;
    if (cp < 0x80) {
      out.push_back(static_cast<char>(cp));
    } else {
      out.push_back(static_cast<char>(0xc0 | (cp >> 6)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    }
    return out;
  }
  return "";
}

std::string VocabularyFile() {
  std::vector<std::string> tokens, merges;
  std::vector<int32_t> types;
  for (int b = 0; b < 256; ++b) {
    tokens.push_back(Symbol(b));
    types.push_back(1);
  }
  // Each word merged left to right: "t h", "th e", ... with every merged token in the vocabulary.
  for (const char* word : {"the", " the", " and", "ing", "tion", "12", " \n", "ab"}) {
    std::string left = Symbol(static_cast<uint8_t>(word[0]));
    for (const char* c = word + 1; *c != '\0'; ++c) {
      const std::string right = Symbol(static_cast<uint8_t>(*c));
      merges.push_back(absl::StrCat(left, " ", right));
      left += right;
      tokens.push_back(left);
      types.push_back(1);
    }
  }
  for (const char* special : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) {
    tokens.push_back(special);
    types.push_back(3);
  }
  testing::GgufWriter w;
  w.Put<uint32_t>(0x46554747);  // "GGUF"
  w.Put<uint32_t>(3);
  w.Put<uint64_t>(0);  // tensors
  w.Put<uint64_t>(4);  // metadata
  w.Str("tokenizer.ggml.model");
  w.Put<uint32_t>(8);
  w.Str("gpt2");
  w.Strings("tokenizer.ggml.tokens", tokens);
  w.Strings("tokenizer.ggml.merges", merges);
  w.Str("tokenizer.ggml.token_type");
  w.Put<uint32_t>(9);
  w.Put<uint32_t>(5);  // int32
  w.Put<uint64_t>(types.size());
  for (int32_t t : types) w.Put<int32_t>(t);
  return w.bytes();
}

const worker::Tokenizer* tokenizer = nullptr;

}  // namespace
}  // namespace kvmem::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  using namespace kvmem;
  const std::string path = absl::StrCat("/tmp/kvmem_tokenizer_fuzz.", getpid(), ".gguf");
  const std::string bytes = fuzz::VocabularyFile();
  FILE* out = std::fopen(path.c_str(), "wb");
  FUZZ_CHECK(out != nullptr, "cannot write %s", path.c_str());
  std::fwrite(bytes.data(), 1, bytes.size(), out);
  std::fclose(out);
  auto file = worker::GgufFile::Open(path);
  std::remove(path.c_str());
  FUZZ_CHECK(file.ok(), "%s", file.status().ToString().c_str());
  auto made = worker::Tokenizer::FromGguf(**file);
  FUZZ_CHECK(made.ok(), "%s", made.status().ToString().c_str());
  fuzz::tokenizer = made->release();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvmem;
  if (size == 0) return 0;
  const bool parse_special = data[0] & 1;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  const std::vector<int32_t> ids = fuzz::tokenizer->Encode(text, parse_special);
  for (int32_t id : ids) {
    FUZZ_CHECK(id >= 0 && id < fuzz::tokenizer->vocab_size(), "id %d", id);
  }
  const std::string back = fuzz::tokenizer->Decode(ids);
  FUZZ_CHECK(back == text, "%zu bytes encoded into %zu ids decode to %zu other bytes", text.size(),
             ids.size(), back.size());
  std::string joined;
  for (const std::string& piece : worker::Tokenizer::PreTokenize(text)) joined += piece;
  FUZZ_CHECK(joined == text, "the pre-tokenizer's pieces do not join into the text");
  return 0;
}
