#include "server/service/prefix_pull.h"

#include <grpcpp/grpcpp.h>

#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "kvmem/v1/kvmem.grpc.pb.h"

namespace kvmem::service {
namespace {

absl::Status FromHolder(const grpc::Status& s, absl::string_view node, absl::string_view call) {
  return absl::Status(
      static_cast<absl::StatusCode>(s.error_code()),
      absl::StrCat("PullPrefix: the holder ", node, " answered ", call, ": ", s.error_message()));
}

}  // namespace

absl::StatusOr<PullResult> PrefixPuller::Pull(const v1::Layout& layout_proto,
                                              const engine::Layout& layout,
                                              const engine::PromptPrefix& prompt,
                                              const std::string& client_salt, std::string from_node,
                                              const std::string& bearer, absl::Time deadline) {
  if (running_.fetch_add(1) >= max_pulls_) {
    running_.fetch_sub(1);
    return absl::ResourceExhaustedError(absl::StrCat(
        "PullPrefix: ", max_pulls_, " pulls are running already (--cluster-pull-concurrency)"));
  }
  absl::Cleanup one_less = [this] { running_.fetch_sub(1); };
  if (prompt.document_tokens > 0) {
    return absl::InvalidArgumentError(
        "document_tokens: a compressed document is its node's own; only block chains are "
        "pulled");
  }
  PullResult result;
  absl::StatusOr<uint64_t> local = engine_->Lookup(layout, prompt);
  if (!local.ok()) return local.status();
  result.local_tokens = *local;
  const uint64_t B = layout.block_tokens;
  if (from_node == self_) {
    return absl::InvalidArgumentError("from_node: names this node (--cluster-node-address)");
  }
  // Only a node the fleet's index names as a holder of this prompt is asked (never an
  // address a caller made up): the longest, or the one named.
  absl::StatusOr<engine::PrefixPublisher::Chain> chain =
      engine_->FleetChain(layout, prompt, ClusterIndex::kMaxLookupBlocks);
  if (!chain.ok()) return chain.status();
  const FleetAnswer fleet = index_->Lookup(chain->ns, chain->hashes);
  if (!fleet.available) {
    return absl::UnavailableError(
        absl::StrCat("PullPrefix: the cluster index did not answer: ", fleet.unavailable));
  }
  const FleetHolder* holder = nullptr;
  for (const FleetHolder& h : fleet.holders) {  // longest first
    if (h.node != self_ && h.blocks * B > *local && (from_node.empty() || h.node == from_node)) {
      holder = &h;
      break;
    }
  }
  if (holder == nullptr) {
    if (from_node.empty()) return result;  // nobody holds more than this node
    return absl::FailedPreconditionError(
        absl::StrCat("from_node: the fleet's index names no node \"", from_node.substr(0, 256),
                     "\" holding more of this prompt than this node's ", *local, " tokens"));
  }
  from_node = holder->node;
  result.from_node = from_node;
  const uint64_t rows = uint64_t{layout.num_layers} * layout.num_kv_heads;
  const uint64_t row_bytes = layout.row_bytes();
  const uint64_t per_token = 2 * rows * row_bytes;  // K and V of every stream

  // The holder: a sequence there maps its published prefix; read it, release it.
  std::unique_ptr<v1::KvCache::Stub> stub =
      v1::KvCache::NewStub(grpc::CreateChannel(from_node, grpc::InsecureChannelCredentials()));
  const auto prepare = [&](grpc::ClientContext* c) {
    c->set_deadline(absl::ToChronoTime(deadline));
    if (!bearer.empty()) c->AddMetadata("authorization", bearer);
  };
  v1::CreateSequenceRequest create;
  *create.mutable_layout() = layout_proto;
  create.mutable_prompt_token_ids()->Add(prompt.token_ids.begin(), prompt.token_ids.end());
  create.set_cache_salt(client_salt);
  create.set_model(prompt.model);
  v1::CreateSequenceResponse created;
  {
    grpc::ClientContext c;
    prepare(&c);
    if (grpc::Status s = stub->CreateSequence(&c, create, &created); !s.ok()) {
      return FromHolder(s, from_node, "CreateSequence");
    }
  }
  absl::Cleanup release_there = [&] {
    grpc::ClientContext c;
    prepare(&c);
    v1::ReleaseRequest q;
    q.set_sequence_id(created.sequence_id());
    v1::ReleaseResponse a;
    stub->Release(&c, q, &a).IgnoreError();  // else its lease ends it
  };
  const uint64_t r = created.reused_prefix_tokens();
  if (r <= *local) return result;
  if (r * per_token > max_bytes_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("PullPrefix: the holder's prefix of ", r, " tokens is ", r * per_token,
                     " bytes of K/V, more than --cluster-pull-max-bytes (", max_bytes_, ")"));
  }
  // [L][H][r][D] each, as Append takes them.
  std::string k(r * per_token / 2, '\0'), v(r * per_token / 2, '\0');
  std::vector<uint64_t> filled(rows, 0);
  {
    grpc::ClientContext c;
    prepare(&c);
    v1::ReadKvRequest q;
    q.set_sequence_id(created.sequence_id());
    std::unique_ptr<grpc::ClientReader<v1::ReadKvResponse>> reader = stub->ReadKv(&c, q);
    v1::ReadKvResponse piece;
    while (reader->Read(&piece)) {
      const uint64_t n = static_cast<uint64_t>(piece.positions_size());
      const uint64_t s = uint64_t{piece.layer()} * layout.num_kv_heads + piece.kv_head();
      // Untrusted as any peer's answer: every piece where it belongs, exactly once.
      if (piece.layer() >= layout.num_layers || piece.kv_head() >= layout.num_kv_heads ||
          piece.first_slot() != filled[s] || filled[s] + n > r ||
          piece.k().size() != n * row_bytes || piece.v().size() != n * row_bytes) {
        c.TryCancel();
        return absl::DataLossError(absl::StrCat("PullPrefix: the holder ", from_node,
                                                "'s ReadKv is not the prefix it mapped"));
      }
      for (uint64_t i = 0; i < n; ++i) {
        if (piece.positions(static_cast<int>(i)) != static_cast<int64_t>(filled[s] + i)) {
          c.TryCancel();
          return absl::DataLossError(absl::StrCat("PullPrefix: the holder ", from_node,
                                                  "'s prefix does not hold positions 0..", r - 1,
                                                  " in order"));
        }
      }
      const uint64_t at = (s * r + filled[s]) * row_bytes;
      std::memcpy(k.data() + at, piece.k().data(), n * row_bytes);
      std::memcpy(v.data() + at, piece.v().data(), n * row_bytes);
      filled[s] += n;
    }
    if (grpc::Status s = reader->Finish(); !s.ok()) return FromHolder(s, from_node, "ReadKv");
  }
  for (uint64_t f : filled) {
    if (f != r) {
      return absl::DataLossError(absl::StrCat("PullPrefix: the holder ", from_node,
                                              "'s ReadKv left a stream short of ", r, " tokens"));
    }
  }
  std::move(release_there).Invoke();
  result.bytes = r * per_token;

  // Here: what this node holds is mapped, the rest appended and published.
  engine::PromptPrefix here = prompt;
  here.auto_publish = false;
  absl::StatusOr<engine::CreateResult> mine = engine_->CreateSequence(
      layout, "full", {}, engine::QuantConfig{}, engine_->config().default_lease, here);
  if (!mine.ok()) return mine.status();
  absl::Cleanup release_here = [&] { engine_->Release(mine->sequence_id).IgnoreError(); };
  const uint64_t have = mine->reused_prefix_tokens;
  if (have >= r) return result;  // published here meanwhile
  const uint64_t n = r - have;
  std::string k_rest, v_rest;
  absl::string_view k_new = k, v_new = v;
  if (have > 0) {  // the rows past `have` of every stream, packed
    k_rest.resize(n * per_token / 2);
    v_rest.resize(n * per_token / 2);
    for (uint64_t s = 0; s < rows; ++s) {
      std::memcpy(k_rest.data() + s * n * row_bytes, k.data() + (s * r + have) * row_bytes,
                  n * row_bytes);
      std::memcpy(v_rest.data() + s * n * row_bytes, v.data() + (s * r + have) * row_bytes,
                  n * row_bytes);
    }
    k_new = k_rest;
    v_new = v_rest;
  }
  std::vector<int64_t> positions(n);
  for (uint64_t i = 0; i < n; ++i) positions[i] = static_cast<int64_t>(have + i);
  engine::AppendChunk chunk;
  chunk.positions = positions;
  chunk.token_ids = prompt.token_ids.subspan(have, n);
  chunk.k = k_new;
  chunk.v = v_new;
  if (absl::StatusOr<engine::AppendResult> a = engine_->Append(mine->sequence_id, {chunk}, {});
      !a.ok()) {
    return a.status();
  }
  absl::StatusOr<uint64_t> published = engine_->Publish(mine->sequence_id, r);
  if (!published.ok()) return published.status();
  result.pulled_tokens = n;
  return result;
}

}  // namespace kvmem::service
