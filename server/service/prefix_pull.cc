#include "server/service/prefix_pull.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <type_traits>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "kernels/block_layout.h"
#include "kvmem/convert.h"
#include "kvmem/shared_pool.h"
#include "kvmem/v1/kvmem.grpc.pb.h"
#include "server/common/client_text.h"
#include "server/transport/parse_cost.h"
#include "spdlog/spdlog.h"
#if KVMEM_WITH_UCX
#include "kvmem/ucx_pool.h"
#endif

namespace kvmem::service {
namespace {

// How long the holder keeps the sequence a pull reads if the Release never comes, and how
// long that Release may take.
constexpr int kHolderLeaseSeconds = 30;
constexpr absl::Duration kReleaseDeadline = absl::Seconds(2);

// A holder's failure, as this node's: UNAVAILABLE (a pull may be tried again), naming the
// holder and the call, with the holder's status bounded.
absl::Status FromHolder(const grpc::Status& s, absl::string_view node, absl::string_view call) {
  return absl::UnavailableError(absl::StrCat("PullPrefix: the holder ", node, " answered ", call,
                                             " with code ", static_cast<int>(s.error_code()), ": ",
                                             CutMessage(s.error_message(), kMaxDetailTextBytes)));
}

absl::Status Lied(absl::string_view node, absl::string_view what) {
  return absl::UnavailableError(
      absl::StrCat("PullPrefix: the holder ", node, "'s answer is not the prefix: ", what));
}

// Whether the holder's table is that of a mapped prefix of `tokens` tokens in `layout`:
// every stream in layer-major order, each tokens/B whole blocks at layout precision, of the
// layout's block size (published blocks are never quantized nor partial). Untrusted input,
// checked on the message itself before anything reads it.
bool IsPrefixTable(const v1::BlockTable& t, const v1::Layout& layout, uint32_t block_tokens,
                   uint64_t block_bytes, uint64_t tokens) {
  const uint32_t L = layout.num_layers(), H = layout.num_kv_heads();
  if (t.block_tokens() != block_tokens || t.block_bytes() != block_bytes ||
      t.layout().num_layers() != L || t.layout().num_kv_heads() != H ||
      t.layout().head_dim() != layout.head_dim() || t.layout().dtype() != layout.dtype() ||
      t.streams_size() != static_cast<int>(uint64_t{L} * H) || tokens % block_tokens != 0) {
    return false;
  }
  const int blocks = static_cast<int>(tokens / block_tokens);
  for (int s = 0; s < t.streams_size(); ++s) {
    const v1::StreamTable& st = t.streams(s);
    if (st.layer() != static_cast<uint32_t>(s) / H ||
        st.kv_head() != static_cast<uint32_t>(s) % H || st.block_ids_size() != blocks ||
        st.block_offsets_size() != blocks || st.block_precisions_size() != blocks ||
        st.block_starts_size() != blocks || st.block_counts_size() != blocks) {
      return false;
    }
    for (int b = 0; b < blocks; ++b) {
      if (st.block_precisions(b) != v1::PRECISION_LAYOUT || st.block_starts(b) != 0 ||
          st.block_counts(b) != block_tokens) {
        return false;
      }
    }
  }
  return true;
}

// The tokens [have, have + n) of every stream, as Append takes them: chunks of at most
// per_chunk tokens, each [L][H][m][D] of K and of V (m its tokens), filled from the holder's
// rows as they are read.
class PullChunks {
 public:
  PullChunks(uint64_t streams, uint64_t row_bytes, uint64_t have, uint64_t n, uint64_t per_chunk)
      : row_bytes_(row_bytes),
        have_(have),
        n_(n),
        per_chunk_(per_chunk),
        k_(Count(n, per_chunk)),
        v_(k_.size()) {
    for (uint64_t c = 0; c < k_.size(); ++c) {
      k_[c].resize(streams * tokens(c) * row_bytes);
      v_[c].resize(streams * tokens(c) * row_bytes);
    }
  }
  static uint64_t Count(uint64_t n, uint64_t per_chunk) { return (n + per_chunk - 1) / per_chunk; }
  uint64_t count() const { return k_.size(); }
  uint64_t tokens(uint64_t c) const { return std::min(per_chunk_, n_ - c * per_chunk_); }

  // Rows [first, first + count) of stream s, the new ones only (from `have` on), by the
  // runs that fall in one chunk each: to(chunk K, chunk V, from, bytes), where the run goes
  // and `from` its byte offset past row `first`.
  template <typename To>
  void EachRun(uint64_t s, uint64_t first, uint64_t count, const To& to) {
    for (uint64_t t = std::max(first, have_); t < first + count;) {
      const uint64_t c = (t - have_) / per_chunk_, start = c * per_chunk_;
      const uint64_t run = std::min(first + count, have_ + start + tokens(c)) - t;
      const uint64_t at = (s * tokens(c) + (t - have_ - start)) * row_bytes_;
      to(k_[c].data() + at, v_[c].data() + at, (t - first) * row_bytes_, run * row_bytes_);
      t += run;
    }
  }
  // Rows of stream s as read (K and V at `k_rows` and `v_rows`), copied in.
  void Place(uint64_t s, uint64_t first, uint64_t count, const char* k_rows, const char* v_rows) {
    EachRun(s, first, count, [&](char* k, char* v, uint64_t from, uint64_t bytes) {
      std::memcpy(k, k_rows + from, bytes);
      std::memcpy(v, v_rows + from, bytes);
    });
  }
  // The chunks as Append takes them (positions: have .. have + n - 1; token ids: the
  // prompt's from `have`); they point into this.
  std::vector<engine::AppendChunk> ForAppend(absl::Span<const int64_t> positions,
                                             absl::Span<const int32_t> token_ids) const {
    std::vector<engine::AppendChunk> out(count());
    for (uint64_t c = 0; c < count(); ++c) {
      const uint64_t first = c * per_chunk_, m = tokens(c);
      out[c].positions = positions.subspan(first, m);
      out[c].token_ids = token_ids.subspan(have_ + first, m);
      out[c].k = k_[c];
      out[c].v = v_[c];
    }
    return out;
  }
  // A transport may still write into the chunks (a get left in flight): never freed. The
  // chunks are gone from this object: nothing but its destruction may follow.
  void KeepForever() {
    client::internal::KeepForever(std::move(k_));
    client::internal::KeepForever(std::move(v_));
  }

 private:
  const uint64_t row_bytes_, have_, n_, per_chunk_;
  std::vector<std::string> k_, v_;
};

}  // namespace

metrics::PullTotals PrefixPuller::totals() const {
  metrics::PullTotals t;
  t.pulled = pulled_.load(std::memory_order_relaxed);
  t.nothing = nothing_.load(std::memory_order_relaxed);
  t.failed = failed_.load(std::memory_order_relaxed);
  t.tokens = tokens_.load(std::memory_order_relaxed);
  t.bytes = bytes_.Read();
  t.seconds = seconds_.Read();
  return t;
}

absl::StatusOr<PullResult> PrefixPuller::Pull(grpc::ServerContext* context,
                                              const v1::Layout& layout_proto,
                                              const engine::Layout& layout,
                                              const engine::PromptPrefix& prompt,
                                              const std::string& client_salt, const PullAsk& ask,
                                              const std::string& bearer, absl::Time deadline) {
  if (ask.transport != "" && ask.transport != "grpc" && ask.transport != "ucx" &&
      ask.transport != "attach") {
    return absl::InvalidArgumentError(
        absl::StrCat("transport: \"", EchoClientText(ask.transport),
                     "\" is none of \"attach\", \"ucx\", \"grpc\" or empty (any)"));
  }
  if (ask.transport == "attach" && !links_->maps_pools()) {
    return absl::FailedPreconditionError(
        "transport: \"attach\": this kvmemd maps no peer's pool (no "
        "--cluster-peer-token-file)");
  }
  if (ask.transport == "ucx" && !links_->reads_pools()) {
    return absl::FailedPreconditionError(
        "transport: \"ucx\": this kvmemd reads no peer's pool by UCX (built without UCX, or "
        "without --cluster-peer-token-file)");
  }
  const absl::Time start = absl::Now();
  absl::StatusOr<PullResult> pulled =
      Choose(context, layout_proto, layout, prompt, client_salt, ask, bearer, deadline);
  seconds_.Observe(absl::ToDoubleSeconds(absl::Now() - start));
  if (!pulled.ok()) {
    failed_.fetch_add(1, std::memory_order_relaxed);
  } else if (pulled->pulled_tokens == 0) {
    nothing_.fetch_add(1, std::memory_order_relaxed);
  } else {
    pulled_.fetch_add(1, std::memory_order_relaxed);
    tokens_.fetch_add(pulled->pulled_tokens, std::memory_order_relaxed);
  }
  if (pulled.ok() && pulled->bytes > 0) bytes_.Add(pulled->transport, pulled->bytes);
  return pulled;
}

absl::StatusOr<PullResult> PrefixPuller::Choose(grpc::ServerContext* context,
                                                const v1::Layout& layout_proto,
                                                const engine::Layout& layout,
                                                const engine::PromptPrefix& prompt,
                                                const std::string& client_salt, const PullAsk& ask,
                                                const std::string& bearer, absl::Time deadline) {
  const std::string& from_node = ask.from_node;
  if (!links_->has_peers()) {
    return absl::FailedPreconditionError(
        "PullPrefix: this kvmemd has no peers to pull from (--cluster-peers)");
  }
  if (prompt.document_tokens > 0) {
    return absl::InvalidArgumentError(
        "document_tokens: a compressed document is its node's own; only block chains are "
        "pulled");
  }
  if (from_node == self_) {
    return absl::InvalidArgumentError("from_node: names this node (--cluster-node-address)");
  }
  if (running_.fetch_add(1) >= max_pulls_) {
    running_.fetch_sub(1);
    return absl::ResourceExhaustedError(absl::StrCat(
        "PullPrefix: ", max_pulls_, " pulls are running already (--cluster-pull-concurrency)"));
  }
  absl::Cleanup one_less = [this] { running_.fetch_sub(1); };
  try {
    absl::StatusOr<uint64_t> local = engine_->Lookup(layout, prompt);
    if (!local.ok()) return local.status();
    // Only a peer the fleet's index names as a holder of this prompt is asked: the longest,
    // or the one named.
    absl::StatusOr<engine::PrefixPublisher::Chain> chain =
        engine_->FleetChain(layout, prompt, ClusterIndex::kMaxLookupBlocks);
    if (!chain.ok()) return chain.status();
    const FleetAnswer fleet = index_->Lookup(chain->ns, chain->hashes);
    if (!fleet.available) {
      return absl::UnavailableError(
          absl::StrCat("PullPrefix: the cluster index did not answer: ", fleet.unavailable));
    }
    // Longest first; a holder that fails (gone, or lost the blocks) gives way to the next,
    // at most kMostHolders tried.
    constexpr int kMostHolders = 3;
    // What a CreateSequence there can map: whole blocks, never the prompt's last token.
    const uint64_t B = layout.block_tokens;
    const uint64_t most = prompt.token_ids.empty() ? 0 : (prompt.token_ids.size() - 1) / B * B;
    int tried = 0;
    absl::Status last;
    for (const FleetHolder& h : fleet.holders) {
      const uint64_t claimed = std::min<uint64_t>(h.blocks, most / B) * B;
      if (h.node == self_ || !links_->IsPeer(h.node) || claimed <= *local ||
          (!from_node.empty() && h.node != from_node)) {
        continue;
      }
      if (claimed - *local < ask.min_tokens) {
        // Longest first: no holder after this one gains more either.
        PullResult not_worth;
        not_worth.local_tokens = *local;
        not_worth.from_node = h.node;
        not_worth.holder_tokens = claimed;
        return not_worth;
      }
      absl::StatusOr<PullResult> pulled =
          PullFrom(context, layout_proto, layout, prompt, client_salt, ask, bearer, deadline,
                   *local, h.node);
      if (pulled.ok() || !absl::IsUnavailable(pulled.status()) || ++tried == kMostHolders ||
          context->IsCancelled()) {
        return pulled;
      }
      last = pulled.status();
    }
    if (!last.ok()) return last;
    if (!from_node.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "from_node: the fleet's index names no peer \"", EchoClientText(from_node),
          "\" (--cluster-peers) holding more of this prompt than this node's ", *local, " tokens"));
    }
    PullResult nothing;  // no peer holds more than this node
    nothing.local_tokens = *local;
    return nothing;
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        "PullPrefix: out of host memory (kvmemd could not "
        "allocate)");
  }
}

absl::StatusOr<PullResult> PrefixPuller::PullFrom(
    grpc::ServerContext* context, const v1::Layout& layout_proto, const engine::Layout& layout,
    const engine::PromptPrefix& prompt, const std::string& client_salt, const PullAsk& ask,
    const std::string& bearer, absl::Time deadline, uint64_t local, const std::string& holder) {
  PullResult result;
  result.local_tokens = local;
  result.from_node = holder;
  const uint64_t B = layout.block_tokens;
  const uint64_t rows = uint64_t{layout.num_layers} * layout.num_kv_heads;
  const uint64_t row_bytes = layout.row_bytes();
  const uint64_t per_token = 2 * rows * row_bytes;  // K and V of every stream

  std::unique_ptr<v1::KvCache::Stub> stub = links_->Stub(holder);
  // The caller's cancellation goes with the calls; the deadline is this call's, capped.
  const auto call = [&]() {
    std::unique_ptr<grpc::ClientContext> c = grpc::ClientContext::FromServerContext(
        *context, grpc::PropagationOptions().disable_deadline_propagation());
    c->set_deadline(absl::ToChronoTime(deadline));
    if (!bearer.empty()) c->AddMetadata("authorization", bearer);
    return c;
  };
  v1::CreateSequenceRequest create;
  *create.mutable_layout() = layout_proto;
  create.mutable_prompt_token_ids()->Add(prompt.token_ids.begin(), prompt.token_ids.end());
  create.set_cache_salt(client_salt);
  create.set_model(prompt.model);
  create.mutable_lease()->set_seconds(kHolderLeaseSeconds);
  v1::CreateSequenceResponse created;
  if (grpc::Status s = stub->CreateSequence(call().get(), create, &created); !s.ok()) {
    return FromHolder(s, holder, "CreateSequence");
  }
  // Released with a deadline of its own (the call's may be what ended the pull); else its
  // short lease ends it.
  absl::Cleanup release_there = [&] {
    grpc::ClientContext c;
    c.set_deadline(absl::ToChronoTime(absl::Now() + kReleaseDeadline));
    if (!bearer.empty()) c.AddMetadata("authorization", bearer);
    v1::ReleaseRequest q;
    q.set_sequence_id(created.sequence_id());
    v1::ReleaseResponse a;
    stub->Release(&c, q, &a).IgnoreError();
  };
  const uint64_t r = created.reused_prefix_tokens();
  // Whole blocks of this layout, never the prompt's last token: what a CreateSequence maps.
  if (created.block_tokens() != B || r % B != 0 || r + 1 > prompt.token_ids.size()) {
    return Lied(holder, absl::StrCat(r, " tokens mapped in blocks of ", created.block_tokens(),
                                     " for a prompt of ", prompt.token_ids.size(),
                                     " tokens in blocks of ", B));
  }
  result.holder_tokens = r;
  if (r <= local || r - local < ask.min_tokens) return result;
  if (r * per_token > max_bytes_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("PullPrefix: the holder's prefix of ", r, " tokens is ", r * per_token,
                     " bytes of K/V, more than --cluster-pull-max-bytes (", max_bytes_, ")"));
  }

  // Here: a sequence that maps what this node holds; the rest comes from the holder.
  engine::PromptPrefix here = prompt;
  here.auto_publish = false;
  absl::StatusOr<engine::CreateResult> mine = engine_->CreateSequence(
      layout, "full", {}, engine::QuantConfig{}, engine_->config().default_lease, here);
  if (!mine.ok()) return mine.status();
  absl::Cleanup release_here = [&] { engine_->Release(mine->sequence_id).IgnoreError(); };
  const uint64_t have = mine->reused_prefix_tokens;
  if (have >= r) return result;  // published here meanwhile
  if (have % B != 0) {           // a mapped prefix is whole blocks: the reads below rely on it
    return absl::InternalError(
        absl::StrCat("PullPrefix: this node mapped ", have, " tokens, not whole blocks of ", B));
  }
  const uint64_t n = r - have;
  // The new tokens in chunks Append takes ([L][H][m][D] each, at most max_append_bytes),
  // filled straight from the holder's pieces.
  const uint64_t per_chunk = std::max<uint64_t>(1, engine_->config().max_append_bytes / per_token);
  // The chunks, and the reads by offsets (K and V of each block, two where a block spans
  // two chunks), in host memory until the append.
  const uint64_t most_reads = 2 * rows * (n / B + PullChunks::Count(n, per_chunk));
  absl::StatusOr<transport::ParseBudget::Reservation> held =
      transport::ParseBudget::Process().Reserve(
          n * per_token + most_reads * sizeof(client::PoolRead), "PullPrefix");
  if (!held.ok()) return held.status();
  PullChunks chunks(rows, row_bytes, have, n, per_chunk);
  std::vector<int64_t> positions(n);
  for (uint64_t i = 0; i < n; ++i) positions[i] = static_cast<int64_t>(have + i);
  std::vector<uint64_t> filled(rows, 0);
  // The holder's pool mapped (on this host), else by UCX, where this daemon may read it.
  std::optional<PeerLinks::MappedPeer> mapped;
  if (ask.transport == "attach" || ask.transport.empty()) {
    absl::StatusOr<PeerLinks::MappedPeer> m = links_->Mapped(*stub, holder, deadline);
    if (m.ok()) {
      mapped = *std::move(m);
    } else if (ask.transport == "attach") {
      return absl::FailedPreconditionError(absl::StrCat(
          "transport: \"attach\": the holder's pool cannot be mapped: ", m.status().message()));
    }
  }
  std::shared_ptr<const client::UcxPool> ucx;
  if (!mapped) {
    absl::StatusOr<std::shared_ptr<const client::UcxPool>> chosen =
        links_->Choose(*stub, holder, ask.transport, deadline);
    if (!chosen.ok()) return chosen.status();
    ucx = *std::move(chosen);
  }
  // By offsets: the holder's table (without positions: a mapped prefix holds 0 .. r-1 in
  // every stream), checked, then the blocks this node lacks, read from the mapping or by UCX
  // gets, under the holder's epoch protocol. Where any transport will do, a failure here
  // falls back to ReadKv.
  const auto read_by_offsets = [&]() -> absl::Status {
    v1::GetBlockTableRequest q;
    q.set_sequence_id(created.sequence_id());
    v1::GetBlockTableResponse a;
    if (grpc::Status s = stub->GetBlockTable(call().get(), q, &a); !s.ok()) {
      return FromHolder(s, holder, "GetBlockTable");
    }
    if (!IsPrefixTable(a.table(), layout_proto, layout.block_tokens,
                       2 * uint64_t{layout.block_tokens} * row_bytes, r)) {
      return Lied(holder, "a table that is not the prefix's");
    }
    if (mapped && a.instance_id() != mapped->instance_id) {
      // The table is another instance's than the mapping (the holder restarted since it was
      // mapped, or names no instance): mapped again, once, and read only from a mapping of
      // the table's own instance; else its board's epochs and its blocks are another's.
      absl::StatusOr<PeerLinks::MappedPeer> again =
          links_->Mapped(*stub, holder, deadline, mapped->instance_id);
      if (!again.ok() || again->instance_id != a.instance_id()) {
        return absl::UnavailableError(absl::StrCat(
            "PullPrefix: the holder ", holder, "'s pool as mapped is not the instance of its table",
            again.ok() ? "" : absl::StrCat(" (mapped again: ", again.status().message(), ")")));
      }
      mapped = *std::move(again);
    }
    client::BlockTable table = client::internal::FromProto(a.table());
    for (client::StreamTable& st : table.streams) {  // the blocks this node lacks
      st.blocks.erase(st.blocks.begin(), st.blocks.begin() + static_cast<ptrdiff_t>(have / B));
    }
    // Each block's K and V rows straight into the chunks (a block holds B whole slots: its
    // K plane, then its V plane), under one read protocol.
    const kernels::LayoutBlock plane{static_cast<uint32_t>(B), row_bytes};
    std::vector<client::PoolRead> reads;
    reads.reserve(most_reads);
    for (uint64_t s = 0; s < rows; ++s) {
      const std::vector<client::TableBlock>& blocks = table.streams[s].blocks;
      for (size_t j = 0; j < blocks.size(); ++j) {
        const uint64_t off = blocks[j].offset;
        if (off > UINT64_MAX - plane.bytes()) {  // the sums below must not wrap
          return Lied(holder, absl::StrCat("a block at offset ", off));
        }
        chunks.EachRun(s, have + j * B, B, [&](char* k, char* v, uint64_t from, uint64_t bytes) {
          reads.push_back({off + plane.k_offset(0) + from, k, bytes});
          reads.push_back({off + plane.v_offset(0) + from, v, bytes});
        });
      }
    }
    const auto read = [&](const auto& pool) {
      absl::Status s = pool.BeginRead(table);
      if (s.ok()) {
        if constexpr (std::is_same_v<std::decay_t<decltype(pool)>, client::SharedPool>) {
          s = CopyOutOfMapping(pool, reads,
                               absl::StrCat("PullPrefix: the holder ", holder, "'s table"));
        } else {
          s = pool.ReadPool(reads);
        }
      }
      if (s.ok()) s = pool.EndRead(table);  // FAILED_PRECONDITION: it changed meanwhile
      return s;
    };
    absl::Status got;
    if (mapped) {
      got = read(*mapped->pool);
    } else {
#if KVMEM_WITH_UCX
      const client::UcxPool::Deadline by_pull(deadline);
      got = read(*ucx);
      if (!got.ok() && ucx->broken() && !absl::IsDeadlineExceeded(got) && !absl::IsAborted(got)) {
        // A connection kept from before the holder restarted, or one another call's deadline
        // ended: connected again, once.
        absl::StatusOr<std::shared_ptr<const client::UcxPool>> again =
            links_->Pool(*stub, holder, deadline);
        if (again.ok()) {
          ucx = *std::move(again);
          got = read(*ucx);
        }
      }
      if (absl::IsAborted(got)) {
        // A get left in flight may still write into the chunks: never freed, never reused,
        // and still counted in --parse-memory-bytes.
        chunks.KeepForever();
        client::internal::KeepForever(*std::move(held));
        spdlog::warn("PullPrefix: {} bytes of chunks kept for good (a UCX get was left in flight)",
                     n * per_token);
        return absl::AbortedError(absl::StrCat("PullPrefix: reading the holder ", holder,
                                               "'s pool by UCX: ", got.message(),
                                               " (a get was left in flight)"));
      }
#else
      got = absl::UnimplementedError("built without UCX");
#endif
    }
    if (!got.ok()) {
      return absl::Status(absl::IsDeadlineExceeded(got) ? absl::StatusCode::kDeadlineExceeded
                                                        : absl::StatusCode::kUnavailable,
                          absl::StrCat("PullPrefix: reading the holder ", holder, "'s pool ",
                                       mapped ? "as mapped" : "by UCX", ": ", got.message()));
    }
    std::fill(filled.begin(), filled.end(), r);
    return absl::OkStatus();
  };
  if (mapped || ucx != nullptr) {
    if (absl::Status read = read_by_offsets(); read.ok()) {
      result.transport = mapped ? "attach" : "ucx";
    } else if (!ask.transport.empty() || context->IsCancelled() || absl::IsDeadlineExceeded(read) ||
               absl::IsAborted(read)) {
      return read;  // ABORTED: the chunks are given up (a get may still write into them)
    } else {
      spdlog::warn("PullPrefix: {}; reading it by ReadKv instead", std::string(read.message()));
      std::fill(filled.begin(), filled.end(), 0);
      mapped.reset();
      ucx = nullptr;
    }
  }
  if (result.transport.empty()) {
    std::unique_ptr<grpc::ClientContext> c = call();
    v1::ReadKvRequest q;
    q.set_sequence_id(created.sequence_id());
    std::unique_ptr<grpc::ClientReader<v1::ReadKvResponse>> reader = stub->ReadKv(c.get(), q);
    v1::ReadKvResponse piece;
    while (reader->Read(&piece)) {
      const uint64_t count = static_cast<uint64_t>(piece.positions_size());
      const uint64_t s = uint64_t{piece.layer()} * layout.num_kv_heads + piece.kv_head();
      // Untrusted as any peer's answer: every piece where it belongs, exactly once.
      bool fits = piece.layer() < layout.num_layers && piece.kv_head() < layout.num_kv_heads &&
                  piece.first_slot() == filled[s] && filled[s] + count <= r &&
                  piece.k().size() == count * row_bytes && piece.v().size() == count * row_bytes;
      for (uint64_t i = 0; fits && i < count; ++i) {
        fits = piece.positions(static_cast<int>(i)) == static_cast<int64_t>(filled[s] + i);
      }
      if (!fits) {
        c->TryCancel();
        return Lied(holder, "a ReadKv piece out of place");
      }
      chunks.Place(s, filled[s], count, piece.k().data(), piece.v().data());
      filled[s] += count;
    }
    if (grpc::Status s = reader->Finish(); !s.ok()) return FromHolder(s, holder, "ReadKv");
    result.transport = "grpc";
  }
  if (std::any_of(filled.begin(), filled.end(), [r](uint64_t f) { return f != r; })) {
    return Lied(holder, absl::StrCat("a stream short of ", r, " tokens"));
  }
  std::move(release_there).Invoke();
  // What was read: the new tokens by offsets, every token by ReadKv.
  result.bytes = (result.transport == "grpc" ? r : n) * per_token;

  // All chunks or none (Append is one transaction), then published.
  if (absl::StatusOr<engine::AppendResult> a = engine_->Append(
          mine->sequence_id, chunks.ForAppend(positions, prompt.token_ids), std::nullopt);
      !a.ok()) {
    return a.status();
  }
  absl::StatusOr<uint64_t> published = engine_->Publish(mine->sequence_id, r);
  if (!published.ok()) return published.status();
  result.pulled_tokens = *published > have ? std::min(*published, r) - have : 0;
  return result;
}

}  // namespace kvmem::service
