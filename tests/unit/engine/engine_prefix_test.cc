// Prefix sharing in the engine: Publish, Lookup, reuse at CreateSequence, the immutability
// of shared blocks, the cache of blocks only the index holds, and its reclaim when the pool
// is full.
#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "tests/unit/engine/engine_fixture.h"

namespace kvmem::engine {
namespace {

using ::testing::HasSubstr;

class PrefixTest : public EngineTest {
 protected:
  // The prompt's token ids: token i is 100 + i (vocab 1000).
  static std::vector<int32_t> Tokens(size_t n, int32_t first = 100) {
    std::vector<int32_t> t(n);
    for (size_t i = 0; i < n; ++i) t[i] = first + static_cast<int32_t>(i);
    return t;
  }

  // Appends positions first..first+n-1 with their token ids (100 + position).
  absl::StatusOr<AppendResult> AppendTokens(uint64_t id, int64_t first, uint32_t n) {
    positions_ = testing::Range(first, n);
    tokens_ = Tokens(n, 100 + static_cast<int32_t>(first));
    k_ = testing::Payload16(kL * kH, first, n, kD, 0);
    v_ = testing::Payload16(kL * kH, first, n, kD, 1);
    AppendChunk chunk{positions_, tokens_, k_, v_, {}, {}};
    return engine_->Append(id, absl::MakeConstSpan(&chunk, 1));
  }

  absl::StatusOr<CreateResult> CreateWith(const std::vector<int32_t>& prompt,
                                          const std::string& policy = "full",
                                          policy::ParamOverrides params = {}, std::string salt = "",
                                          std::string model = "m", bool auto_publish = false) {
    PromptPrefix p{model, salt, prompt, auto_publish};
    return engine_->CreateSequence(TestLayout(), policy, params, {}, absl::ZeroDuration(), p);
  }

  uint64_t LookupTokens(const std::vector<int32_t>& prompt, std::string salt = "",
                        std::string model = "m") {
    absl::StatusOr<uint64_t> n = engine_->Lookup(TestLayout(), PromptPrefix{model, salt, prompt});
    EXPECT_TRUE(n.ok()) << n.status();
    return n.value_or(0);
  }

  // A publisher of the first `n` tokens (positions 0..n-1), published whole.
  uint64_t Publisher(uint32_t n, std::string salt = "") {
    auto created = CreateWith({}, "full", {}, salt);
    EXPECT_TRUE(created.ok()) << created.status();
    EXPECT_TRUE(AppendTokens(created->sequence_id, 0, n).ok());
    absl::StatusOr<uint64_t> published = engine_->Publish(created->sequence_id, std::nullopt);
    EXPECT_TRUE(published.ok()) << published.status();
    EXPECT_EQ(published.value_or(0), n / kB * kB);
    return created->sequence_id;
  }

  std::vector<int32_t> tokens_;
};

TEST_F(PrefixTest, APublishedPromptIsMappedIntoANewSequenceThatReadsTheSameKV) {
  const uint64_t a = Publisher(40);  // two whole blocks published (32 tokens)
  const uint64_t blocks = engine_->Stats(false).pool.blocks_used;
  auto b = CreateWith(Tokens(46));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->reused_prefix_tokens, 32u);
  EXPECT_EQ(engine_->Stats(false).pool.blocks_used, blocks);  // mapped, not copied
  // The same blocks, in every stream.
  BlockTable ta = *engine_->GetBlockTable(a), tb = *engine_->GetBlockTable(b->sequence_id);
  for (size_t s = 0; s < ta.streams.size(); ++s) {
    ASSERT_EQ(tb.streams[s].blocks.size(), 2u);
    EXPECT_EQ(tb.streams[s].blocks[0].id, ta.streams[s].blocks[0].id);
    EXPECT_EQ(tb.streams[s].blocks[1].id, ta.streams[s].blocks[1].id);
    EXPECT_EQ(tb.streams[s].positions, testing::Range(0, 32));
  }
  ExpectContentMatchesPositions(b->sequence_id);
  // The worker appends the rest of the prompt after them.
  ASSERT_TRUE(AppendTokens(b->sequence_id, 32, 14).ok());
  ExpectContentMatchesPositions(b->sequence_id);
  ExpectContentMatchesPositions(a);
  EXPECT_TRUE(engine_->Fingerprint(b->sequence_id).ok());  // its invariants hold
  const EngineStats stats = engine_->Stats(false);
  EXPECT_EQ(stats.prefix.queries, 1u);
  EXPECT_EQ(stats.prefix.hits, 1u);
  EXPECT_EQ(stats.prefix.reused_tokens, 32u);
  EXPECT_EQ(stats.prefix.entries, 2u);
  EXPECT_EQ(stats.prefix.indexed_blocks, 2u * kL * kH);
}

TEST_F(PrefixTest, TheLastPromptTokenIsNeverReused) {
  Publisher(48);
  EXPECT_EQ(LookupTokens(Tokens(48)), 32u);  // 47 tokens may be reused: 2 whole blocks
  EXPECT_EQ(LookupTokens(Tokens(49)), 48u);
  EXPECT_EQ(CreateWith(Tokens(48))->reused_prefix_tokens, 32u);
  EXPECT_EQ(LookupTokens(Tokens(16)), 0u);
  EXPECT_EQ(LookupTokens({}), 0u);
}

TEST_F(PrefixTest, SaltModelLayoutAndTokensSeparateWhatIsShared) {
  Publisher(64, "tenant-a");
  EXPECT_EQ(LookupTokens(Tokens(65), "tenant-a"), 64u);
  EXPECT_EQ(LookupTokens(Tokens(65), "tenant-b"), 0u);
  EXPECT_EQ(LookupTokens(Tokens(65), ""), 0u);
  EXPECT_EQ(LookupTokens(Tokens(65), "tenant-a", "other-model"), 0u);
  Layout other = TestLayout();
  other.head_dim = 16;
  EXPECT_EQ(*engine_->Lookup(other, PromptPrefix{"m", "tenant-a", Tokens(65)}), 0u);
  // A different token in block 2: blocks 0 and 1 still match.
  std::vector<int32_t> diverged = Tokens(65);
  diverged[40] = 7;
  EXPECT_EQ(LookupTokens(diverged, "tenant-a"), 32u);
}

TEST_F(PrefixTest, BadPromptsAreRefusedAndChangeNothing) {
  auto bad = CreateWith({1, 2, 5000});
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(bad.status()));
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("prompt_token_ids[2]"));
  auto salty = CreateWith(Tokens(20), "full", {}, std::string(300, 's'));
  ASSERT_FALSE(salty.ok());
  EXPECT_THAT(std::string(salty.status().message()), HasSubstr("cache_salt"));
  EXPECT_EQ(engine_->Stats(false).sequences_active, 0u);
  EXPECT_EQ(engine_->Stats(false).pool.blocks_used, 0u);
}

TEST_F(PrefixTest, PublishingNeedsEveryTokenId) {
  const uint64_t id = Create();
  ASSERT_TRUE(AppendRange(id, 0, 32).ok());  // no token ids
  absl::StatusOr<uint64_t> published = engine_->Publish(id, std::nullopt);
  ASSERT_FALSE(published.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(published.status())) << published.status();
  EXPECT_THAT(std::string(published.status().message()), HasSubstr("token id"));
  EXPECT_EQ(engine_->Stats(false).prefix.entries, 0u);
}

TEST_F(PrefixTest, PublishStopsAtTheFirstBlockThatIsNotWhole) {
  auto created = CreateWith({}, "window", {{"window", 20}});
  ASSERT_TRUE(created.ok());
  ASSERT_TRUE(AppendTokens(created->sequence_id, 0, 48).ok());
  EXPECT_EQ(*engine_->Publish(created->sequence_id, 16), 16u);  // up_to_tokens: one block
  ASSERT_TRUE(engine_->Step(created->sequence_id, {}).ok());    // evicts the head
  // Block 0 was published before the eviction; nothing after it is whole any more.
  EXPECT_EQ(*engine_->Publish(created->sequence_id, std::nullopt), 16u);
  EXPECT_EQ(engine_->Stats(false).prefix.entries, 1u);
  EXPECT_EQ(LookupTokens(Tokens(49)), 16u);
}

TEST_F(PrefixTest, SharersNeverEditAPublishedBlock) {
  const uint64_t a = Publisher(64);
  const std::string before = Content(a);
  // A sharer with a small window evicts the mapped head: it copies, never edits.
  auto b = CreateWith(Tokens(70), "window", {{"window", 20}});
  ASSERT_TRUE(b.ok());
  ASSERT_EQ(b->reused_prefix_tokens, 64u);
  ASSERT_TRUE(AppendTokens(b->sequence_id, 64, 6).ok());
  ASSERT_TRUE(engine_->Step(b->sequence_id, {}).ok());
  ExpectContentMatchesPositions(b->sequence_id);
  EXPECT_EQ(Content(a), before);
  // A sharer that quantizes copies too.
  auto q =
      engine_->CreateSequence(TestLayout(), "full", {}, QuantConfig{kernels::QuantType::kInt8, 16},
                              absl::ZeroDuration(), PromptPrefix{"m", "", Tokens(70)});
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->reused_prefix_tokens, 64u);
  ASSERT_TRUE(AppendTokens(q->sequence_id, 64, 6).ok());
  ASSERT_TRUE(engine_->Step(q->sequence_id, {}).ok());
  EXPECT_EQ(Content(a), before);
  // And a new sequence still maps the original blocks.
  auto c = CreateWith(Tokens(70));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->reused_prefix_tokens, 64u);
  ExpectContentMatchesPositions(c->sequence_id);
}

TEST_F(PrefixTest, AKernelStepPolicyGetsSlotStateForTheMappedTokens) {
  Publisher(48);
  auto b = CreateWith(Tokens(50), "h2o", {{"budget", 20}, {"recent", 4}});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->reused_prefix_tokens, 48u);
  EXPECT_TRUE(engine_->Fingerprint(b->sequence_id).ok());  // slot state lengths agree
  ASSERT_TRUE(AppendTokens(b->sequence_id, 48, 2).ok());
  StepInput input;
  input.epoch = engine_->GetBlockTable(b->sequence_id)->epoch;
  std::vector<std::vector<float>> rows(kL * kH, std::vector<float>(50, 0.02f));
  for (uint32_t s = 0; s < kL * kH; ++s) input.attention.push_back({s / kH, s % kH, rows[s]});
  ASSERT_TRUE(engine_->Step(b->sequence_id, input).ok());
  EXPECT_TRUE(engine_->Fingerprint(b->sequence_id).ok());
  ExpectContentMatchesPositions(b->sequence_id);
}

TEST_F(PrefixTest, AutoPublishPublishesEachBlockAsItFills) {
  auto a = CreateWith({}, "full", {}, "", "m", /*auto_publish=*/true);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(AppendTokens(a->sequence_id, 0, 20).ok());
  EXPECT_EQ(LookupTokens(Tokens(40)), 16u);
  ASSERT_TRUE(AppendTokens(a->sequence_id, 20, 20).ok());
  EXPECT_EQ(LookupTokens(Tokens(40)), 32u);
}

TEST_F(PrefixTest, ReleasedPublishersLeaveTheBlocksCachedUntilThePoolNeedsThem) {
  // A pool of 64 pages of 4 KiB, one 512-byte block per stream and 16 tokens: 8 blocks a
  // page, so 512 blocks = 64 blocks per stream = 1024 tokens.
  MakeEngine(64 * 4096);
  const uint64_t a = Publisher(512);  // half the pool, all published
  ASSERT_TRUE(engine_->Release(a).ok());
  EngineStats stats = engine_->Stats(false);
  EXPECT_EQ(stats.prefix.cached_blocks, 32u * kL * kH);  // held by nothing else
  EXPECT_EQ(stats.pool.blocks_used, 32u * kL * kH);
  EXPECT_EQ(LookupTokens(Tokens(513)), 512u);  // still there; Lookup pins nothing

  // Another sequence needs more than the free half: the cache gives way (half of it)
  // instead of an error.
  const uint64_t big = Create();
  ASSERT_TRUE(AppendRange(big, 0, 768).ok());
  stats = engine_->Stats(false);
  EXPECT_GT(stats.prefix.reclaimed_bytes, 0u);
  EXPECT_LT(LookupTokens(Tokens(513)), 512u);
  ExpectContentMatchesPositions(big);
  // Reclaimed from the chain's end: what is left is still a prefix.
  EXPECT_EQ(LookupTokens(Tokens(513)) / kB, stats.prefix.entries);

  // What a sequence maps is pinned by it, never reclaimed underneath it.
  ASSERT_TRUE(engine_->Release(big).ok());
  const uint64_t left = LookupTokens(Tokens(513));
  ASSERT_GT(left, 0u);
  auto pinned = CreateWith(Tokens(513));
  ASSERT_TRUE(pinned.ok());
  EXPECT_EQ(pinned->reused_prefix_tokens, left);
  const uint64_t filler = Create();
  absl::StatusOr<AppendResult> fill = AppendRange(filler, 0, 1024);
  EXPECT_TRUE(absl::IsResourceExhausted(fill.status())) << fill.status();
  ExpectContentMatchesPositions(pinned->sequence_id);
  // Everything released and reclaimed: the pool is empty again.
  ASSERT_TRUE(engine_->Release(pinned->sequence_id).ok());
  ASSERT_TRUE(AppendRange(filler, 0, 1024).ok());
  ASSERT_TRUE(engine_->Release(filler).ok());
  stats = engine_->Stats(false);
  EXPECT_EQ(stats.pool.blocks_used, 0u);
  EXPECT_EQ(stats.prefix.entries, 0u);
  EXPECT_EQ(stats.pool.bad_unrefs, 0u);
}

TEST_F(PrefixTest, PastTheHighWatermarkTheCacheShrinksToTheLowOne) {
  // 64 pages (one published block range of 8 streams x 512 bytes is one page); high 50%
  // (32 pages), low 40% (25.6 pages).
  MakeEngine(64 * 4096, [](EngineConfig& c) {
    c.cache_high_watermark = 0.5;
    c.cache_low_watermark = 0.4;
  });
  ASSERT_TRUE(engine_->Release(Publisher(256)).ok());  // 16 pages, only cached
  EXPECT_EQ(engine_->ReclaimToWatermark(), 0u);        // under the high mark
  const uint64_t live = Create();
  ASSERT_TRUE(AppendRange(live, 0, 288).ok());  // 18 more pages: 34 of 64 in use
  EXPECT_EQ(engine_->Stats(false).pool.pages_used, 34u);
  EXPECT_GT(engine_->ReclaimToWatermark(), 0u);
  // Entries go from the chain's end until enough whole pages are free (a page holds one
  // stream's blocks of 8 entries: the chain's second half frees 8 pages, then the rest).
  const EngineStats stats = engine_->Stats(false);
  EXPECT_LE(stats.pool.pages_used, 25u);  // at most 40%
  EXPECT_GE(stats.pool.pages_used, 18u);  // the live sequence is untouched
  EXPECT_LT(stats.prefix.entries, 16u);
  EXPECT_EQ(LookupTokens(Tokens(257)), stats.prefix.entries * kB);  // still a prefix
  ExpectContentMatchesPositions(live);
  EXPECT_EQ(engine_->ReclaimToWatermark(), 0u);  // under the high mark again
  // Bad watermarks are refused at creation.
  EngineConfig bad;
  bad.cache_low_watermark = 0.9;
  bad.cache_high_watermark = 0.5;
  EXPECT_FALSE(Engine::Create(bad, *store::CpuBackend::Create(1 << 20), &clock_).ok());
}

// With tenant arenas each part of the pool keeps its own watermark: the shared part past
// its high mark drops what is cached there, never a tenant's cache in its arena (the whole
// pool past the mark used to, since those were the only cached blocks).
TEST_F(PrefixTest, TheSharedPartPastItsWatermarkLeavesAnArenasCacheAlone) {
  MakeEngine(
      128 * 4096,
      [](EngineConfig& c) {
        c.cache_high_watermark = 0.5;
        c.cache_low_watermark = 0.4;
        c.tenant_arenas = {{"alice", 64 * 4096}};
      },
      [](std::unique_ptr<store::Backend>) -> std::unique_ptr<store::Backend> {
        return *store::CpuBackend::Create(128 * 4096, {64 * 4096});
      });
  const std::vector<int32_t> prompt = Tokens(257, 100);
  PromptPrefix hers{"m", "", {}};
  hers.owner = "alice";
  auto created = engine_->CreateSequence(TestLayout(), "full", {}, {}, absl::ZeroDuration(), hers);
  ASSERT_TRUE(created.ok()) << created.status();
  ASSERT_TRUE(AppendTokens(created->sequence_id, 0, 256).ok());
  ASSERT_TRUE(engine_->Publish(created->sequence_id, std::nullopt).ok());
  ASSERT_TRUE(engine_->Release(created->sequence_id).ok());  // 16 of her 64 pages, cached
  hers.token_ids = prompt;
  ASSERT_EQ(*engine_->Lookup(TestLayout(), hers), 256u);
  PromptPrefix his{"m", "", {}};
  his.owner = "bob";
  auto live = engine_->CreateSequence(TestLayout(), "full", {}, {}, absl::ZeroDuration(), his);
  ASSERT_TRUE(live.ok()) << live.status();
  for (int64_t at = 0; at < 960; at += 240) {  // 60 of the shared part's 64 pages
    ASSERT_TRUE(AppendRange(live->sequence_id, at, 240).ok());
  }
  EXPECT_EQ(engine_->ReclaimToWatermark(), 0u);
  EXPECT_EQ(*engine_->Lookup(TestLayout(), hers), 256u);
}

TEST_F(PrefixTest, AChainWhoseHeadWasReclaimedIsPublishedAgainFromItsStart) {
  MakeEngine(64 * 4096, [](EngineConfig& c) {
    c.cache_high_watermark = 0.01;
    c.cache_low_watermark = 0.01;
  });
  ASSERT_TRUE(engine_->Release(Publisher(32)).ok());  // H0, H1: only cached
  // D computes the same prompt itself; its Publish finds H0 and H1 there and only touches
  // them.
  auto d = CreateWith({});
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(AppendTokens(d->sequence_id, 0, 32).ok());
  EXPECT_EQ(*engine_->Publish(d->sequence_id, std::nullopt), 32u);
  engine_->ReclaimToWatermark();  // the cached H0, H1 go; D's own blocks were never indexed
  EXPECT_EQ(LookupTokens(Tokens(49)), 0u);
  // D's next block: its chain is published again from the start, with D's blocks.
  ASSERT_TRUE(AppendTokens(d->sequence_id, 32, 16).ok());
  EXPECT_EQ(*engine_->Publish(d->sequence_id, std::nullopt), 48u);
  EXPECT_EQ(LookupTokens(Tokens(49)), 48u);
  // Everything released and reclaimed: nothing is left pinned by a stale child count.
  ASSERT_TRUE(engine_->Release(d->sequence_id).ok());
  engine_->ReclaimToWatermark();
  const EngineStats stats = engine_->Stats(false);
  EXPECT_EQ(stats.prefix.entries, 0u);
  EXPECT_EQ(stats.pool.blocks_used, 0u);
  EXPECT_EQ(stats.pool.bad_unrefs, 0u);
}

TEST_F(PrefixTest, PublishTakesTheWholeBlocksOfKnownTokensAndForkChildrenPublishTheirOwn) {
  auto a = CreateWith({});
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(AppendTokens(a->sequence_id, 0, 32).ok());
  ASSERT_TRUE(AppendRange(a->sequence_id, 32, 16).ok());  // decode tokens without ids
  EXPECT_EQ(*engine_->Publish(a->sequence_id, std::nullopt), 32u);
  // A fork child publishes its own chain: its parent's tokens and then its own.
  auto b = CreateWith({});
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(AppendTokens(b->sequence_id, 0, 40).ok());
  auto forked = engine_->Fork(b->sequence_id, absl::ZeroDuration());
  ASSERT_TRUE(forked.ok());
  ASSERT_TRUE(AppendTokens(forked->sequence_id, 40, 24).ok());
  EXPECT_EQ(*engine_->Publish(forked->sequence_id, 48), 48u);
  EXPECT_EQ(LookupTokens(Tokens(65)), 48u);
  ExpectContentMatchesPositions(forked->sequence_id);
}

TEST_F(PrefixTest, OversizedNamesAndPromptsAreRefusedWithTheirLimits) {
  auto model = CreateWith({}, "full", {}, "", std::string(300, 'm'));
  ASSERT_FALSE(model.ok());
  EXPECT_THAT(std::string(model.status().message()), HasSubstr("model: 300 bytes"));
  auto salt = CreateWith({}, "full", {}, std::string(257, 's'));
  ASSERT_FALSE(salt.ok());
  EXPECT_THAT(std::string(salt.status().message()), HasSubstr("cache_salt: 257 bytes"));
  auto lookup =
      engine_->Lookup(TestLayout(), PromptPrefix{"m", "", Tokens(kMaxPromptTokens + 1, 0)});
  ASSERT_FALSE(lookup.ok());
  EXPECT_THAT(std::string(lookup.status().message()), HasSubstr("prompt_token_ids"));
  EXPECT_EQ(engine_->Stats(false).sequences_active, 0u);
}

TEST_F(PrefixTest, APolicyThatNeedsPerTokenSignalsGetsNothingMapped) {
  Publisher(48);
  auto info = CreateWith(Tokens(49), "infokv");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->reused_prefix_tokens, 0u);  // it appends the prompt with its entropies
}

TEST_F(PrefixTest, ConcurrentPublishersSharersAndReclaimsNeverMixUpBlocks) {
  // Publishers, sharers that evict (copy-on-write), and a filler that drives the pool into
  // reclaiming, all at once (and under ThreadSanitizer in scripts/tsan.sh): every sequence
  // reads back exactly the K/V of its positions, and the pool's accounting ends exact.
  MakeEngine(128 * 4096, [](EngineConfig& c) { c.max_sequences = 64; });
  std::atomic<bool> stop{false};
  std::atomic<int> mapped{0}, checked{0};
  auto content_ok = [&](uint64_t id) {
    bool ok = true;
    absl::Status s = engine_->ReadKV(id, 0, 0, 0, [&](StreamKV&& kv) {
      const uint32_t stream = kv.layer * kH + kv.kv_head;
      ok = ok && kv.k == testing::Expected16(stream, kv.positions, kD, 0) &&
           kv.v == testing::Expected16(stream, kv.positions, kD, 1);
      return absl::OkStatus();
    });
    return ok && s.ok();
  };
  auto append = [&](uint64_t id, int64_t first, uint32_t n) {
    const std::vector<int64_t> positions = testing::Range(first, n);
    const std::vector<int32_t> tokens = Tokens(n, 100 + static_cast<int32_t>(first));
    const std::string k = testing::Payload16(kL * kH, first, n, kD, 0);
    const std::string v = testing::Payload16(kL * kH, first, n, kD, 1);
    AppendChunk chunk{positions, tokens, k, v, {}, {}};
    return engine_->Append(id, absl::MakeConstSpan(&chunk, 1)).ok();
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {  // publishers of prompts of 32..80 tokens
      for (int i = 0; !stop; ++i) {
        PromptPrefix none{"m", "", {}};
        auto a = engine_->CreateSequence(TestLayout(), "full", {}, {}, absl::ZeroDuration(), none);
        if (!a.ok()) continue;
        if (append(a->sequence_id, 0, 32 + 16 * ((i + t) % 4))) {
          engine_->Publish(a->sequence_id, std::nullopt).IgnoreError();
        }
        engine_->Release(a->sequence_id).IgnoreError();
      }
    });
  }
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&] {  // sharers: map, append, evict, check
      const std::vector<int32_t> prompt = Tokens(90);
      while (!stop) {
        PromptPrefix p{"m", "", prompt};
        auto b = engine_->CreateSequence(TestLayout(), "window", {{"window", 20}}, {},
                                         absl::ZeroDuration(), p);
        if (!b.ok()) continue;
        if (b->reused_prefix_tokens > 0) ++mapped;
        const auto first = static_cast<int64_t>(b->reused_prefix_tokens);
        if (append(b->sequence_id, first, static_cast<uint32_t>(90 - first)) &&
            engine_->Step(b->sequence_id, {}).ok()) {
          EXPECT_TRUE(content_ok(b->sequence_id));
          ++checked;
        }
        engine_->Release(b->sequence_id).IgnoreError();
      }
    });
  }
  threads.emplace_back([&] {  // a filler that needs most of the pool now and then
    while (!stop) {
      const uint64_t f = Create();
      if (f != 0) {
        AppendRange(f, 0, 1990).IgnoreError();
        engine_->Release(f).IgnoreError();
      }
    }
  });
  absl::SleepFor(absl::Seconds(3));
  stop = true;
  for (std::thread& t : threads) t.join();
  EXPECT_GT(mapped.load(), 0);
  EXPECT_GT(checked.load(), 0);
  EngineStats stats = engine_->Stats(false);
  EXPECT_GT(stats.prefix.reclaimed_bytes, 0u);
  EXPECT_EQ(stats.sequences_active, 0u);
  // Only the cache is left, and all of it can go.
  EXPECT_EQ(stats.pool.blocks_used, stats.prefix.indexed_blocks);
  const uint64_t filler = Create();
  ASSERT_TRUE(AppendRange(filler, 0, 2048).ok());  // the whole pool
  ASSERT_TRUE(engine_->Release(filler).ok());
  stats = engine_->Stats(false);
  EXPECT_EQ(stats.pool.blocks_used, 0u);
  EXPECT_EQ(stats.prefix.entries, 0u);
  EXPECT_EQ(stats.pool.bad_unrefs, 0u);
}

TEST_F(PrefixTest, SixteenClientsCreatingAtOnceHoldOneCopyOfThePrefix) {
  // 16 threads create sequences with the same published 64-token prefix at the same moment
  // (and under ThreadSanitizer in scripts/tsan.sh), then each appends its own 4-token tail:
  // the pool holds one copy of the prefix plus 16 private tails, every sharer reads its own
  // K/V, and after all release only the cached prefix is left, with exact references.
  constexpr int kClients = 16;
  MakeEngine(256 * 4096, [](EngineConfig& c) { c.max_sequences = 32; });
  const uint64_t publisher = Publisher(64);
  ASSERT_TRUE(engine_->Release(publisher).ok());
  const uint64_t prefix_blocks = engine_->Stats(false).pool.blocks_used;
  ASSERT_EQ(prefix_blocks, 64 / kB * kL * kH);
  const std::vector<int32_t> prompt = Tokens(68);
  std::atomic<int> ready{0};
  std::vector<uint64_t> ids(kClients, 0);
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      ++ready;
      while (ready.load() < kClients) {
      }
      PromptPrefix p{"m", "", prompt};
      auto created = engine_->CreateSequence(TestLayout(), "full", {}, {}, absl::ZeroDuration(), p);
      ASSERT_TRUE(created.ok()) << created.status();
      ASSERT_EQ(created->reused_prefix_tokens, 64u);
      ids[c] = created->sequence_id;
      const std::vector<int64_t> positions = testing::Range(64, 4);
      const std::vector<int32_t> tail = Tokens(4, 164);
      const std::string k = testing::Payload16(kL * kH, 64, 4, kD, 0);
      const std::string v = testing::Payload16(kL * kH, 64, 4, kD, 1);
      AppendChunk chunk{positions, tail, k, v, {}, {}};
      ASSERT_TRUE(engine_->Append(created->sequence_id, absl::MakeConstSpan(&chunk, 1)).ok());
    });
  }
  for (std::thread& t : threads) t.join();
  EngineStats stats = engine_->Stats(false);
  EXPECT_EQ(stats.pool.blocks_used, prefix_blocks + uint64_t{kClients} * kL * kH);
  for (uint64_t id : ids) {
    ASSERT_NE(id, 0u);
    ExpectContentMatchesPositions(id);
  }
  for (uint64_t id : ids) ASSERT_TRUE(engine_->Release(id).ok());
  stats = engine_->Stats(false);
  EXPECT_EQ(stats.pool.blocks_used, prefix_blocks);
  EXPECT_EQ(stats.prefix.cached_blocks, prefix_blocks);
  EXPECT_EQ(stats.pool.bad_unrefs, 0u);
}

TEST_F(PrefixTest, EachSaltHoldsAtMostItsQuotaOfThePool) {
  // 32 KiB per tenant: 64 blocks of 512 bytes, 8 per stream = 128 tokens.
  MakeEngine(1 << 20, [](EngineConfig& c) {
    c.tenant_quota_bytes = 32 * 1024;
    c.tenant_quotas = {{"big", 64 * 1024}};
  });
  auto a = CreateWith({}, "full", {}, "tenant-a");
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(AppendTokens(a->sequence_id, 0, 128).ok());
  const std::string before = Content(a->sequence_id);
  absl::StatusOr<AppendResult> over = AppendTokens(a->sequence_id, 128, 16);
  ASSERT_FALSE(over.ok());
  EXPECT_TRUE(absl::IsResourceExhausted(over.status()));
  EXPECT_THAT(std::string(over.status().message()), HasSubstr("tenant 'tenant-a'"));
  EXPECT_THAT(std::string(over.status().message()), HasSubstr("quota of 32768 bytes"));
  EXPECT_EQ(Content(a->sequence_id), before);  // nothing changed
  // A fork of it is the same tenant.
  auto child = engine_->Fork(a->sequence_id, absl::ZeroDuration());
  ASSERT_TRUE(child.ok());
  EXPECT_FALSE(AppendTokens(child->sequence_id, 128, 16).ok());
  // Other tenants, an overridden quota, and no salt at all are not affected.
  auto b = CreateWith({}, "full", {}, "tenant-b");
  ASSERT_TRUE(AppendTokens(b->sequence_id, 0, 128).ok());
  auto big = CreateWith({}, "full", {}, "big");
  ASSERT_TRUE(AppendTokens(big->sequence_id, 0, 256).ok());
  // No salt is a tenant too (the quota held nowhere before: 512 tokens went in).
  const uint64_t none = Create();
  ASSERT_TRUE(AppendTokens(none, 0, 128).ok());
  EXPECT_TRUE(absl::IsResourceExhausted(AppendTokens(none, 128, 16).status()));
  // Released, its bytes come back to it.
  ASSERT_TRUE(engine_->Release(child->sequence_id).ok());
  ASSERT_TRUE(engine_->Release(a->sequence_id).ok());
  auto again = CreateWith({}, "full", {}, "tenant-a");
  ASSERT_TRUE(AppendTokens(again->sequence_id, 0, 128).ok());
}

TEST_F(PrefixTest, ATenantsOwnCachedBlocksGiveWayToItsQuota) {
  MakeEngine(1 << 20, [](EngineConfig& c) { c.tenant_quota_bytes = 32 * 1024; });
  ASSERT_TRUE(engine_->Release(Publisher(128, "t")).ok());  // its whole quota, only cached
  auto b = CreateWith({}, "full", {}, "t");
  ASSERT_TRUE(b.ok());
  EXPECT_TRUE(AppendTokens(b->sequence_id, 0, 32).ok());  // the cache gave way
  EXPECT_GT(engine_->Stats(false).prefix.reclaimed_bytes, 0u);
}

TEST_F(PrefixTest, ATenantIsRegisteredOnlyWhileItHoldsSomething) {
  // Before: every salt stayed registered for the daemon's life, and past 65,536 of them
  // every new tenant was refused until a restart.
  MakeEngine(1 << 20, [](EngineConfig& c) { c.tenant_quota_bytes = 32 * 1024; });
  const size_t n = store::BlockPool::kMaxTenants + 16;
  for (size_t i = 0; i < n; ++i) {
    auto created = CreateWith({}, "full", {}, absl::StrCat("salt-", i));
    ASSERT_TRUE(created.ok()) << i << ": " << created.status();
    ASSERT_TRUE(engine_->Release(created->sequence_id).ok());
  }
  EXPECT_EQ(engine_->tenants_registered(), 0u);
  // One holding cached blocks and no sequence stays until the blocks go; a fork holds its
  // parent's tenant as long as it lives.
  ASSERT_TRUE(engine_->Release(Publisher(32, "cached")).ok());
  EXPECT_EQ(engine_->tenants_registered(), 1u);
  auto a = CreateWith({}, "full", {}, "t");
  auto child = engine_->Fork(a->sequence_id, absl::ZeroDuration());
  ASSERT_TRUE(child.ok());
  ASSERT_TRUE(engine_->Release(a->sequence_id).ok());
  EXPECT_EQ(engine_->tenants_registered(), 2u);
  ASSERT_TRUE(AppendTokens(child->sequence_id, 0, 128).ok());  // still the quota of 't'
  EXPECT_TRUE(absl::IsResourceExhausted(AppendTokens(child->sequence_id, 128, 16).status()));
  ASSERT_TRUE(engine_->Release(child->sequence_id).ok());
  EXPECT_EQ(engine_->tenants_registered(), 1u);
}

TEST_F(PrefixTest, TheOwnersQuotaHoldsWhateverTheSalt) {
  // With an authenticated owner, the owner is the tenant: switching salts escapes nothing.
  MakeEngine(1 << 20, [](EngineConfig& c) { c.tenant_quota_bytes = 32 * 1024; });
  uint64_t appended = 0;
  absl::Status refused;
  for (int i = 0; i < 8 && refused.ok(); ++i) {
    PromptPrefix p{"m", absl::StrCat("salt-", i), {}};
    p.owner = "alice";
    auto created = engine_->CreateSequence(TestLayout(), "full", {}, {}, absl::ZeroDuration(), p);
    ASSERT_TRUE(created.ok()) << created.status();
    refused = AppendTokens(created->sequence_id, 0, 64).status();
    if (refused.ok()) appended += 64;
  }
  EXPECT_EQ(appended, 128u);  // 32 KiB: 128 tokens of this layout
  EXPECT_TRUE(absl::IsResourceExhausted(refused));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("tenant 'alice'"));
}

TEST_F(PrefixTest, OneTenantCannotTakeTheWholeHostBudget) {
  // Before, one tenant's sequences could hold all of --host-metadata-bytes and refuse every
  // other tenant's calls; now each holds at most its share, whatever its salts or forks.
  constexpr uint64_t kShare = 48 << 10;
  MakeEngine(1 << 20, [](EngineConfig& c) {
    c.host_metadata_bytes = 256 << 10;
    c.tenant_host_metadata_bytes = kShare;
  });
  auto create = [&](const std::string& owner, int salt) {
    PromptPrefix p{"m", absl::StrCat("salt-", salt), {}};
    p.owner = owner;
    return engine_->CreateSequence(TestLayout(), "full", {}, {}, absl::ZeroDuration(), p);
  };
  // Alice's sequences (one in three forked) until her share refuses; how many it held.
  auto fill = [&](std::vector<uint64_t>* ids) -> absl::Status {
    for (int i = 0; i < 200; ++i) {
      absl::StatusOr<CreateResult> created = create("alice", i);
      if (!created.ok()) return created.status();
      ids->push_back(created->sequence_id);
      if (absl::Status s = AppendTokens(created->sequence_id, 0, 64).status(); !s.ok()) return s;
      if (i % 3 == 0) {
        absl::StatusOr<CreateResult> child =
            engine_->Fork(created->sequence_id, absl::ZeroDuration());
        if (!child.ok()) return child.status();
        ids->push_back(child->sequence_id);
      }
    }
    return absl::OkStatus();
  };
  std::vector<uint64_t> alices;
  const absl::Status refused = fill(&alices);
  ASSERT_TRUE(absl::IsResourceExhausted(refused)) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("tenant 'alice'"));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("--tenant-host-metadata-bytes"));
  const EngineStats full = engine_->Stats(false);
  EXPECT_LE(full.host_metadata_bytes + full.slot_state_bytes, kShare);
  // Bob is served as if Alice were not there.
  absl::StatusOr<CreateResult> bobs = create("bob", 0);
  ASSERT_TRUE(bobs.ok()) << bobs.status();
  ASSERT_TRUE(AppendTokens(bobs->sequence_id, 0, 64).ok());
  // What Alice releases is hers again, all of it: the same fill holds as many.
  for (uint64_t id : alices) ASSERT_TRUE(engine_->Release(id).ok());
  std::vector<uint64_t> again;
  EXPECT_TRUE(absl::IsResourceExhausted(fill(&again)));
  EXPECT_EQ(again.size(), alices.size());
}

TEST_F(PrefixTest, ATenantHoldsAtMostItsSequenceLimit) {
  // Before, one tenant could take every epoch slot (--max-sequences) from the others.
  MakeEngine(1 << 20, [](EngineConfig& c) { c.tenant_max_sequences = 3; });
  auto create = [&](const std::string& owner) {
    PromptPrefix p{"m", "", {}};
    p.owner = owner;
    return engine_->CreateSequence(TestLayout(), "full", {}, {}, absl::ZeroDuration(), p);
  };
  std::vector<uint64_t> alices;
  for (int i = 0; i < 3; ++i) alices.push_back(create("alice")->sequence_id);
  absl::StatusOr<CreateResult> over = create("alice");
  ASSERT_TRUE(absl::IsResourceExhausted(over.status())) << over.status();
  EXPECT_THAT(std::string(over.status().message()), HasSubstr("tenant 'alice'"));
  EXPECT_THAT(std::string(over.status().message()), HasSubstr("--tenant-max-sequences"));
  // A fork is one more of the parent's tenant's.
  EXPECT_TRUE(absl::IsResourceExhausted(engine_->Fork(alices[0], absl::ZeroDuration()).status()));
  EXPECT_TRUE(create("bob").ok());
  ASSERT_TRUE(engine_->Release(alices[0]).ok());
  auto child = engine_->Fork(alices[1], absl::ZeroDuration());
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_TRUE(absl::IsResourceExhausted(create("alice").status()));
  ASSERT_TRUE(engine_->Release(child->sequence_id).ok());
  EXPECT_TRUE(create("alice").ok());
}

TEST_F(PrefixTest, BlocksADocumentSharesWithPublishedPrefixesAreStillReclaimed) {
  // A snapkv that keeps everything (budget > n): its document's blocks are its published
  // prefix blocks; once nobody holds them, both entries go.
  MakeEngine(64 * 4096);
  auto a = CreateWith({}, "snapkv", {{"budget", 1000}, {"window", 8}});
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(AppendTokens(a->sequence_id, 0, 64).ok());
  ASSERT_EQ(*engine_->Publish(a->sequence_id, std::nullopt), 64u);
  CompressInput input;
  input.epoch = engine_->GetBlockTable(a->sequence_id)->epoch;
  const std::vector<float> row(64, 1.0f);
  for (uint32_t s = 0; s < kL * kH; ++s) input.window_scores.push_back({s / kH, s % kH, row});
  ASSERT_TRUE(engine_->Compress(a->sequence_id, input).ok());
  ASSERT_EQ(*engine_->PublishDocument(a->sequence_id), 64u);
  ASSERT_TRUE(engine_->Release(a->sequence_id).ok());
  EngineStats stats = engine_->Stats(false);
  EXPECT_EQ(stats.prefix.entries, 5u);  // four blocks and the document
  EXPECT_EQ(stats.prefix.cached_blocks, stats.pool.blocks_used);
  const uint64_t filler = Create();
  ASSERT_TRUE(AppendRange(filler, 0, 1024).ok());  // the whole pool
  ASSERT_TRUE(engine_->Release(filler).ok());
  stats = engine_->Stats(false);
  EXPECT_EQ(stats.prefix.entries, 0u);
  EXPECT_EQ(stats.pool.blocks_used, 0u);
}

TEST_F(PrefixTest, AForkOfASharerHoldsItsOwnReferences) {
  Publisher(32);
  auto b = CreateWith(Tokens(33));
  ASSERT_TRUE(b.ok());
  auto child = engine_->Fork(b->sequence_id, absl::ZeroDuration());
  ASSERT_TRUE(child.ok());
  ASSERT_TRUE(engine_->Release(b->sequence_id).ok());
  ExpectContentMatchesPositions(child->sequence_id);
  ASSERT_TRUE(engine_->Release(child->sequence_id).ok());
  EXPECT_EQ(engine_->Stats(false).pool.bad_unrefs, 0u);
}

}  // namespace
}  // namespace kvmem::engine

namespace kvmem::engine {
namespace {

// Shared compressed documents: a document compressed once by a query-agnostic rule and
// published; a later request with the same document and representation maps it whole.
class DocumentTest : public PrefixTest {
 protected:
  static constexpr uint32_t kDoc = 100;
  const policy::ParamOverrides kSnap = {{"budget", 24}, {"window", 8}};

  // A snapkv sequence with the document appended (ids 100 + i) and compressed by its own
  // end-of-document window scores.
  uint64_t Compressed(const policy::ParamOverrides& params) {
    auto created = CreateWith({}, "snapkv", params);
    EXPECT_TRUE(created.ok()) << created.status();
    const uint64_t id = created->sequence_id;
    EXPECT_TRUE(AppendTokens(id, 0, kDoc).ok());
    CompressInput input;
    input.epoch = engine_->GetBlockTable(id)->epoch;
    std::vector<std::vector<float>> rows(kL * kH, std::vector<float>(kDoc));
    for (uint32_t s = 0; s < kL * kH; ++s) {
      for (uint32_t j = 0; j < kDoc; ++j) rows[s][j] = static_cast<float>((j * 7 + s * 13) % 31);
      input.window_scores.push_back({s / kH, s % kH, rows[s]});
    }
    auto c = engine_->Compress(id, input);
    EXPECT_TRUE(c.ok()) << c.status();
    return id;
  }

  // The document and a question (PromptPrefix holds a span: the vector must outlive it).
  const std::vector<int32_t>& Prompt() const { return prompt_; }

  absl::StatusOr<CreateResult> CreateReader(const policy::ParamOverrides& params) {
    PromptPrefix p{"m", "", Prompt()};
    p.document_tokens = kDoc;
    return engine_->CreateSequence(TestLayout(), "snapkv", params, {}, absl::ZeroDuration(), p);
  }

  const std::vector<int32_t> prompt_ = Tokens(kDoc + 5);
};

TEST_F(DocumentTest, AMappedDocumentIsExactlyTheCacheCompressingItGives) {
  const uint64_t publisher = Compressed(kSnap);
  EXPECT_EQ(*engine_->PublishDocument(publisher), kDoc);
  const uint64_t blocks = engine_->Stats(false).pool.blocks_used;
  EXPECT_EQ(*engine_->Lookup(
                TestLayout(),
                [&] {
                  PromptPrefix p{"m", "", Prompt()};
                  p.document_tokens = kDoc;
                  return p;
                }(),
                "snapkv", kSnap),
            kDoc);

  auto reader = CreateReader(kSnap);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->reused_prefix_tokens, kDoc);
  EXPECT_EQ(engine_->Stats(false).pool.blocks_used, blocks);  // mapped, not copied
  const uint64_t control = Compressed(kSnap);                 // compressing it here
  EXPECT_EQ(Content(reader->sequence_id), Content(control));
  ExpectContentMatchesPositions(reader->sequence_id);
  // The question is appended uncompressed; both stay identical.
  ASSERT_TRUE(AppendTokens(reader->sequence_id, kDoc, 5).ok());
  ASSERT_TRUE(AppendTokens(control, kDoc, 5).ok());
  EXPECT_EQ(Content(reader->sequence_id), Content(control));
  EXPECT_TRUE(engine_->Fingerprint(reader->sequence_id).ok());
}

TEST_F(DocumentTest, SharersNeverEditThePublishedDocument) {
  const uint64_t publisher = Compressed(kSnap);
  ASSERT_EQ(*engine_->PublishDocument(publisher), kDoc);
  const std::string before = Content(publisher);
  auto reader = CreateReader(kSnap);
  ASSERT_TRUE(reader.ok());
  ASSERT_TRUE(AppendTokens(reader->sequence_id, kDoc, 5).ok());
  // The reader compresses again (its question included): the shared blocks are copied.
  CompressInput input;
  input.epoch = engine_->GetBlockTable(reader->sequence_id)->epoch;
  input.target_tokens = 10;
  const size_t n = engine_->GetBlockTable(reader->sequence_id)->streams[0].positions.size();
  std::vector<float> row(n, 1.0f);
  for (uint32_t s = 0; s < kL * kH; ++s) input.window_scores.push_back({s / kH, s % kH, row});
  ASSERT_TRUE(engine_->Compress(reader->sequence_id, input).ok());
  ExpectContentMatchesPositions(reader->sequence_id);
  EXPECT_EQ(Content(publisher), before);
  // A second reader still maps the document as published.
  auto second = CreateReader(kSnap);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->reused_prefix_tokens, kDoc);
  ExpectContentMatchesPositions(second->sequence_id);
}

// An open AppendStream holds its sequence against every other change, publishing included:
// its chunks may already sit in the free tails of the blocks a document would share.
TEST_F(DocumentTest, AnOpenAppendStreamHoldsOffPublishing) {
  const uint64_t publisher = Compressed(kSnap);
  const std::string compressed = Content(publisher);
  {
    auto session = engine_->BeginAppend(publisher);
    ASSERT_TRUE(session.ok()) << session.status();
    ASSERT_TRUE(AddRange(**session, kDoc, 2).ok());
    auto refused = engine_->PublishDocument(publisher);
    ASSERT_FALSE(refused.ok());
    EXPECT_TRUE(absl::IsFailedPrecondition(refused.status())) << refused.status();
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("AppendStream"));
  }  // ends without Commit
  EXPECT_EQ(Content(publisher), compressed);
  ASSERT_EQ(*engine_->PublishDocument(publisher), kDoc);
  auto reader = CreateReader(kSnap);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->reused_prefix_tokens, kDoc);
  EXPECT_EQ(Content(reader->sequence_id), compressed);
}

TEST_F(DocumentTest, OnlyTheSameRepresentationMapsIt) {
  ASSERT_EQ(*engine_->PublishDocument(Compressed(kSnap)), kDoc);
  auto other = CreateReader({{"budget", 32}, {"window", 8}});
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(other->reused_prefix_tokens, 0u);  // nothing plain was published either
  PromptPrefix p{"m", "tenant", Prompt()};
  p.document_tokens = kDoc;
  auto salted = engine_->CreateSequence(TestLayout(), "snapkv", kSnap, {}, absl::ZeroDuration(), p);
  ASSERT_TRUE(salted.ok());
  EXPECT_EQ(salted->reused_prefix_tokens, 0u);
  p.salt = "";
  p.document_tokens = static_cast<uint32_t>(Prompt().size());  // no question: refused
  auto whole = engine_->CreateSequence(TestLayout(), "snapkv", kSnap, {}, absl::ZeroDuration(), p);
  ASSERT_FALSE(whole.ok());
  EXPECT_THAT(std::string(whole.status().message()), HasSubstr("document_tokens"));
}

// A prompt that starts with a document not published compressed maps nothing, not even a
// published plain prefix: its client computes and compresses the whole document. A
// sequence that did map a plain prefix (no document_tokens) and compressed it is no
// document: its compression never saw the mapped tokens' queries.
TEST_F(DocumentTest, APromptWithADocumentMapsItWholeOrNothing) {
  Publisher(8 * kB);  // a plain chain of document and question together
  const std::vector<int32_t> ids = Tokens(8 * kB);
  PromptPrefix p{"m", "", ids};
  p.document_tokens = 5 * kB;
  EXPECT_EQ(*engine_->Lookup(TestLayout(), p, "snapkv", kSnap), 0u);
  auto reader = engine_->CreateSequence(TestLayout(), "snapkv", kSnap, {}, absl::ZeroDuration(), p);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->reused_prefix_tokens, 0u);

  p.document_tokens = 0;  // no document: the whole chain but the last token's block
  EXPECT_EQ(*engine_->Lookup(TestLayout(), p, "snapkv", kSnap), 7 * kB);
  const std::vector<int32_t> doc = Tokens(kDoc + 5);
  PromptPrefix plain{"m", "", doc};
  auto mapped =
      engine_->CreateSequence(TestLayout(), "snapkv", kSnap, {}, absl::ZeroDuration(), plain);
  ASSERT_TRUE(mapped.ok());
  ASSERT_GT(mapped->reused_prefix_tokens, 0u);
  const auto first = static_cast<int64_t>(mapped->reused_prefix_tokens);
  ASSERT_TRUE(AppendTokens(mapped->sequence_id, first, static_cast<uint32_t>(kDoc - first)).ok());
  CompressInput input;
  input.epoch = engine_->GetBlockTable(mapped->sequence_id)->epoch;
  const std::vector<float> row(kDoc, 1.0f);
  for (uint32_t s = 0; s < kL * kH; ++s) input.window_scores.push_back({s / kH, s % kH, row});
  ASSERT_TRUE(engine_->Compress(mapped->sequence_id, input).ok());
  auto refused = engine_->PublishDocument(mapped->sequence_id);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(refused.status())) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("mapped"));
}

TEST_F(DocumentTest, OnlyAFreshlyCompressedPromptIsADocument) {
  const uint64_t id = Compressed(kSnap);
  ASSERT_TRUE(AppendTokens(id, kDoc, 1).ok());  // changed since its Compress
  auto refused = engine_->PublishDocument(id);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(refused.status())) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("Compress"));
  auto plain = CreateWith({});
  ASSERT_TRUE(plain.ok());
  ASSERT_TRUE(AppendTokens(plain->sequence_id, 0, 20).ok());
  EXPECT_FALSE(engine_->PublishDocument(plain->sequence_id).ok());  // never compressed
}

TEST_F(DocumentTest, ASecondCompressOrAClientTargetIsNoDocument) {
  const uint64_t twice = Compressed(kSnap);
  CompressInput input;
  input.epoch = engine_->GetBlockTable(twice)->epoch;
  const size_t n = engine_->GetBlockTable(twice)->streams[0].positions.size();
  const std::vector<float> row(n, 1.0f);
  for (uint32_t s = 0; s < kL * kH; ++s) input.window_scores.push_back({s / kH, s % kH, row});
  ASSERT_TRUE(engine_->Compress(twice, input).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(engine_->PublishDocument(twice).status()));

  auto targeted = CreateWith({}, "snapkv", kSnap);
  ASSERT_TRUE(AppendTokens(targeted->sequence_id, 0, kDoc).ok());
  CompressInput with_target;
  with_target.epoch = engine_->GetBlockTable(targeted->sequence_id)->epoch;
  with_target.target_tokens = 10;
  const std::vector<float> full_row(kDoc, 1.0f);
  for (uint32_t s = 0; s < kL * kH; ++s) {
    with_target.window_scores.push_back({s / kH, s % kH, full_row});
  }
  ASSERT_TRUE(engine_->Compress(targeted->sequence_id, with_target).ok());
  EXPECT_TRUE(absl::IsFailedPrecondition(engine_->PublishDocument(targeted->sequence_id).status()));
}

TEST_F(DocumentTest, AReleasedDocumentIsCachedAndReclaimedUnderPressure) {
  MakeEngine(64 * 4096);
  const uint64_t publisher = Compressed(kSnap);
  ASSERT_EQ(*engine_->PublishDocument(publisher), kDoc);
  ASSERT_TRUE(engine_->Release(publisher).ok());
  EXPECT_GT(engine_->Stats(false).prefix.cached_blocks, 0u);
  const uint64_t big = Create();
  ASSERT_TRUE(AppendRange(big, 0, 1024).ok());  // the whole pool: the document gives way
  ExpectContentMatchesPositions(big);
  auto reader = CreateReader(kSnap);
  ASSERT_TRUE(reader.ok());
  EXPECT_EQ(reader->reused_prefix_tokens, 0u);
  EXPECT_EQ(engine_->Stats(false).prefix.entries, 0u);
  EXPECT_EQ(engine_->Stats(false).pool.bad_unrefs, 0u);
}

}  // namespace
}  // namespace kvmem::engine
