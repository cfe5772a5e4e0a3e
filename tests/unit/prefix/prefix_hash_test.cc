// The prefix hash chain (server/prefix/prefix_hash.h) against golden vectors that
// tests/python/test_prefix_hash_golden.py computes independently with cbor2 and hashlib,
// the way vLLM's sha256_cbor prefix caching does.
#include "server/prefix/prefix_hash.h"

#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"

namespace kvmem::prefix {
namespace {

struct Golden {
  std::string seed, salt;
  uint32_t block_tokens = 0;
  std::vector<int32_t> tokens;
  std::vector<std::string> hashes;
};

std::vector<Golden> ReadGolden() {
  std::ifstream in(KVMEM_PREFIX_GOLDEN);
  EXPECT_TRUE(in.good()) << KVMEM_PREFIX_GOLDEN;
  std::vector<Golden> out;
  std::string line;
  while (std::getline(in, line)) {
    std::vector<std::string> f = absl::StrSplit(line, '|');
    EXPECT_EQ(f.size(), 5u) << line;
    if (f.size() != 5) continue;
    Golden g{f[0], f[1]};
    EXPECT_TRUE(absl::SimpleAtoi(f[2], &g.block_tokens));
    for (absl::string_view t : absl::StrSplit(f[3], ',', absl::SkipEmpty())) {
      int32_t v = 0;
      EXPECT_TRUE(absl::SimpleAtoi(t, &v)) << t;
      g.tokens.push_back(v);
    }
    g.hashes = absl::StrSplit(f[4], ',', absl::SkipEmpty());
    out.push_back(std::move(g));
  }
  return out;
}

TEST(PrefixHashTest, MatchesTheGoldenVectorsOfCbor2AndHashlib) {
  const std::vector<Golden> golden = ReadGolden();
  ASSERT_GE(golden.size(), 5u);
  for (const Golden& g : golden) {
    absl::StatusOr<BlockHash> root = RootHash(g.seed);
    ASSERT_TRUE(root.ok()) << root.status();
    absl::StatusOr<std::vector<BlockHash>> hashes =
        PrefixHashes(*root, g.tokens, g.block_tokens, g.salt);
    ASSERT_TRUE(hashes.ok()) << hashes.status();
    std::vector<std::string> hex;
    for (const BlockHash& h : *hashes) hex.push_back(ToHex(h));
    EXPECT_EQ(hex, g.hashes) << "seed '" << g.seed << "' salt '" << g.salt << "' B "
                             << g.block_tokens;
  }
}

TEST(PrefixHashTest, EachBlockHashIsTheChainOfTheOnesBefore) {
  absl::StatusOr<BlockHash> root = RootHash("0");
  ASSERT_TRUE(root.ok());
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5, 6};
  absl::StatusOr<std::vector<BlockHash>> all = PrefixHashes(*root, tokens, 2, "salt");
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 3u);
  absl::StatusOr<BlockHash> first =
      ChainHash(*root, absl::MakeConstSpan(tokens).first(2), std::vector<std::string>{"salt"});
  absl::StatusOr<BlockHash> second =
      ChainHash(*first, absl::MakeConstSpan(tokens).subspan(2, 2), std::nullopt);
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ((*all)[0], *first);
  EXPECT_EQ((*all)[1], *second);
  // A different token anywhere before changes every later hash.
  std::vector<int32_t> other = tokens;
  other[1] = 9;
  absl::StatusOr<std::vector<BlockHash>> changed = PrefixHashes(*root, other, 2, "salt");
  ASSERT_TRUE(changed.ok());
  for (size_t i = 0; i < 3; ++i) EXPECT_NE((*changed)[i], (*all)[i]) << i;
  EXPECT_FALSE(PrefixHashes(*root, tokens, 0, "").ok());
}

}  // namespace
}  // namespace kvmem::prefix
