// The GGUF reader on crafted files: well-formed ones parse; every truncation, a bad magic,
// an unknown version or type and a tensor outside the file give a clear error, never a crash.
#include "gguf.h"

#include <cstring>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "tests/testing/gguf_writer.h"

namespace kvmem::worker {
namespace {

using ::testing::HasSubstr;

using testing::GgufWriter;

// A file with three metadata entries and two tensors: an f32 [4] and a Q8_0 [32].
std::string ValidFile() {
  GgufWriter w;
  w.Put<uint32_t>(0x46554747);
  w.Put<uint32_t>(3);
  w.Put<uint64_t>(2);  // tensors
  w.Put<uint64_t>(3);  // metadata
  w.Str("general.architecture");
  w.Put<uint32_t>(8);
  w.Str("llama");
  w.Str("llama.block_count");
  w.Put<uint32_t>(4);
  w.Put<uint32_t>(30);
  w.Str("tokenizer.ggml.tokens");
  w.Put<uint32_t>(9);
  w.Put<uint32_t>(8);
  w.Put<uint64_t>(2);
  w.Str("a");
  w.Str(
      "\xc4\xa0"
      "b");
  w.Str("norm");
  w.Put<uint32_t>(1);
  w.Put<uint64_t>(4);
  w.Put<uint32_t>(0);  // f32
  w.Put<uint64_t>(0);  // offset
  w.Str("q8");
  w.Put<uint32_t>(1);
  w.Put<uint64_t>(32);
  w.Put<uint32_t>(8);   // Q8_0
  w.Put<uint64_t>(32);  // offset (aligned)
  w.Align(32);
  for (float f : {1.0f, -2.0f, 0.5f, 4.0f}) w.Put(f);
  w.Align(32);
  w.Put<uint16_t>(kernels::FloatToHalf(0.5f));  // scale
  for (int i = 0; i < 32; ++i) w.Put<int8_t>(static_cast<int8_t>(i - 16));
  return w.bytes();
}

TEST(GgufTest, ParsesAWellFormedFile) {
  const std::string f = ValidFile();
  uint32_t version;
  std::map<std::string, GgufValue> meta;
  std::vector<GgufTensor> tensors;
  ASSERT_TRUE(
      ParseGguf(reinterpret_cast<const uint8_t*>(f.data()), f.size(), &version, &meta, &tensors)
          .ok());
  EXPECT_EQ(version, 3u);
  EXPECT_EQ(std::get<std::string>(meta["general.architecture"]), "llama");
  EXPECT_EQ(std::get<int64_t>(meta["llama.block_count"]), 30);
  ASSERT_EQ(tensors.size(), 2u);
  EXPECT_EQ(tensors[1].name, "q8");
  EXPECT_EQ(tensors[1].bytes, 34u);
}

TEST(GgufTest, EveryTruncationIsAnErrorNotACrash) {
  const std::string f = ValidFile();
  for (size_t n = 0; n < f.size(); ++n) {
    uint32_t version;
    std::map<std::string, GgufValue> meta;
    std::vector<GgufTensor> tensors;
    absl::Status s =
        ParseGguf(reinterpret_cast<const uint8_t*>(f.data()), n, &version, &meta, &tensors);
    EXPECT_FALSE(s.ok()) << "prefix of " << n << " bytes parsed";
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  }
}

TEST(GgufTest, CorruptionsNameWhatIsWrong) {
  auto parse = [](std::string f) {
    uint32_t version;
    std::map<std::string, GgufValue> meta;
    std::vector<GgufTensor> tensors;
    return ParseGguf(reinterpret_cast<const uint8_t*>(f.data()), f.size(), &version, &meta,
                     &tensors);
  };
  std::string f = ValidFile();
  f[0] = 'X';
  EXPECT_THAT(parse(f).message(), HasSubstr("bad magic"));
  f = ValidFile();
  f[4] = 9;
  EXPECT_THAT(parse(f).message(), HasSubstr("version 9"));
  f = ValidFile();
  f[16] = 0x7f;  // metadata count absurd
  f[22] = 0x7f;
  EXPECT_FALSE(parse(f).ok());
  // The Q8_0 tensor's offset pushed past the end of the file.
  f = ValidFile();
  const size_t off = f.find("q8") + 2 + 4 + 8 + 4;
  f[off + 1] = 0x10;
  EXPECT_THAT(parse(f).message(), HasSubstr("outside the file"));
  // A huge string length.
  f = ValidFile();
  f[24] = '\xff';
  f[31] = '\x0f';
  EXPECT_EQ(parse(f).code(), absl::StatusCode::kDataLoss);
}

TEST(GgufTest, OpenReportsMissingFiles) {
  auto f = GgufFile::Open("/nonexistent/model.gguf");
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound);
}

TEST(GgufTest, DequantizesQ8AndF32) {
  const std::string bytes = ValidFile();
  const std::string path = ::testing::TempDir() + "/valid.gguf";
  FILE* out = std::fopen(path.c_str(), "wb");
  std::fwrite(bytes.data(), 1, bytes.size(), out);
  std::fclose(out);
  auto file = GgufFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  auto norm = (*file)->ToFloat(**(*file)->Tensor("norm"));
  EXPECT_EQ(*norm, (std::vector<float>{1.0f, -2.0f, 0.5f, 4.0f}));
  auto q8 = (*file)->ToFloat(**(*file)->Tensor("q8"));
  for (int i = 0; i < 32; ++i) EXPECT_EQ((*q8)[i], 0.5f * (i - 16));
  EXPECT_EQ(*(*file)->GetStrings("tokenizer.ggml.tokens"), (std::vector<std::string>{"a",
                                                                                     "\xc4\xa0"
                                                                                     "b"}));
  EXPECT_FALSE((*file)->GetInt("general.architecture").ok());
}

}  // namespace
}  // namespace kvmem::worker
