#include "tokenizer.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvmem::worker {
namespace {

using ::testing::ElementsAre;

TEST(PreTokenizeTest, SmolLmSplitsDigitsThenGpt2) {
  EXPECT_THAT(Tokenizer::PreTokenize("Hello world, it's 2024!"),
              ElementsAre("Hello", " world", ",", " it", "'s", " ", "2", "0", "2", "4", "!"));
  // Runs of whitespace leave their last character to what follows (\s+(?!\S)), and a lone
  // whitespace before a word stands alone unless it is a space.
  EXPECT_THAT(Tokenizer::PreTokenize("a   b\n\nc"), ElementsAre("a", "  ", " b", "\n", "\n", "c"));
  // Non-ASCII letters are letters; punctuation runs stay together.
  EXPECT_THAT(Tokenizer::PreTokenize("Größe über €5..."),
              ElementsAre("Größe", " über", " €", "5", "..."));
  EXPECT_THAT(Tokenizer::PreTokenize("日本語 テキスト"), ElementsAre("日本語", " テキスト"));
  EXPECT_THAT(Tokenizer::PreTokenize("trailing  "), ElementsAre("trailing", "  "));
}

TEST(PreTokenizeTest, MalformedUtf8NeverCrashes) {
  const std::string bad = "ab\xff\xfe\xc3";
  std::string joined;
  for (const std::string& p : Tokenizer::PreTokenize(bad)) joined += p;
  EXPECT_EQ(joined, bad);  // every byte lands in some piece
}

}  // namespace
}  // namespace kvmem::worker
