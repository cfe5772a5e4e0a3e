#include "server/engine/prefix_publisher.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace kvmem::engine {
namespace {

// A compressed document as the index keeps it: a frozen copy of the publisher's streams
// (their tables name the blocks the entry references) and scores (its host slot state; none
// for a policy that keeps none), token ids and policy mark.
class DocumentState final : public prefix::EntryPayload {
 public:
  std::vector<Stream> streams;
  std::unique_ptr<store::SlotState> slots;
  std::vector<int32_t> token_ids;
  int64_t policy_mark = -1;
  uint64_t host_bytes() const override {
    uint64_t bytes = sizeof(*this) + token_ids.capacity() * sizeof(int32_t);
    for (const Stream& st : streams) bytes += st.host_bytes();
    if (slots) bytes += slots->bytes();
    return bytes;
  }
};

}  // namespace

PrefixPublisher::PrefixPublisher(store::BlockPool* pool, prefix::BlockHash root)
    : pool_(pool), index_(std::make_unique<prefix::PrefixIndex>(pool)), root_(root) {}

absl::StatusOr<PrefixPublisher::MapPlan> PrefixPublisher::Plan(
    const Layout& layout, const PromptPrefix& prompt, const policy::Policy& policy,
    const policy::ParamOverrides& params, const QuantConfig& quant, bool device_step) const {
  // The prompt (checked first: a bad prompt changes nothing) and its published prefix. A
  // policy that needs per-token signals on every append gets none mapped: the worker
  // appends the whole prompt with its signals.
  if (absl::Status s = CheckPrompt(layout, prompt); !s.ok()) return s;
  if (prompt.document_tokens >= prompt.token_ids.size() && prompt.document_tokens > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "document_tokens: ", prompt.document_tokens, " must be less than the prompt's ",
        prompt.token_ids.size(), " tokens (the question follows the document)"));
  }
  MapPlan plan;
  if (policy.descriptor().append_signals != 0) return plan;
  absl::StatusOr<std::vector<prefix::BlockHash>> hashes = PublishedPrefix(layout, prompt);
  if (!hashes.ok()) return hashes.status();
  plan.hashes = *std::move(hashes);
  // Compressed documents are host state: not for policies that step on the device.
  if (prompt.document_tokens > 0 && !(device_step && policy.has_kernel_step())) {
    absl::StatusOr<prefix::BlockHash> key =
        DocumentKey(prompt.token_ids.first(prompt.document_tokens),
                    Representation(policy.descriptor().name, params, quant), prompt.salt);
    if (!key.ok()) return key.status();
    plan.document = *key;
  }
  return plan;
}

absl::StatusOr<uint64_t> PrefixPublisher::Map(Sequence& seq, const PromptPrefix& prompt,
                                              const MapPlan& plan, HostReservation* host,
                                              uint64_t version) {
  const Sequence::PrefixState& state = seq.prefix();
  if (plan.document) {
    prefix::PrefixIndex::MappedDocument doc =
        index_->MapDocument(state.ns, *plan.document, prompt.document_tokens);
    if (doc.payload != nullptr) {
      // Given back unless the sequence takes them (an error, or an exception).
      absl::Cleanup unref_doc = [&] { pool_->Unref(doc.blocks); };
      absl::Status s = host->Grow(doc.payload->host_bytes(), "CreateSequence");
      if (!s.ok()) return s;
      if (s = AdoptDocument(seq, *doc.payload, version); !s.ok()) return s;
      std::move(unref_doc).Cancel();
      return uint64_t{prompt.document_tokens};  // the whole document is there
    }
  }
  if (plan.hashes.empty()) return uint64_t{0};
  const Layout& layout = seq.layout();
  // Pinned from here by the sequence's references (its lease), never by the lookup.
  std::vector<std::vector<store::BlockId>> mapped =
      index_->Map(state.ns, plan.hashes, plan.hashes.size(), layout.block_tokens);
  if (mapped.empty()) return uint64_t{0};
  // Given back unless the sequence takes them (an error, or an exception).
  absl::Cleanup unref_mapped = [&] {
    for (const auto& blocks : mapped) pool_->Unref(blocks);
  };
  const uint64_t tokens = uint64_t{mapped.size()} * layout.block_tokens;
  // What MapPrefix's room takes, exactly (as an Append reserves): every stream's columns,
  // its list of mapped.size() entries, the token ids, the slot state.
  uint64_t growth = seq.SlotGrowth(tokens);
  for (const Stream& st : seq.streams()) {
    growth += st.BlockListGrowth(0, mapped.size(), mapped.size());
  }
  absl::Status s = host->Grow(growth, "CreateSequence");
  if (!s.ok()) return s;
  // A slot state in device memory: its growth from the device budget, held until it is
  // accounted (here, once mapped).
  absl::StatusOr<HostReservation> device = budget_->ReserveDevice(
      seq.DeviceSlotGrowth(tokens), "CreateSequence", seq.shared_host_share());
  if (!device.ok()) return device.status();
  Sequence::PrefixState& mutable_state = seq.mutable_prefix();
  mutable_state.hashes.assign(plan.hashes.begin(), plan.hashes.begin() + mapped.size());
  mutable_state.published_blocks = mapped.size();
  if (s = MapPrefix(seq, mapped, prompt.token_ids, version); !s.ok()) return s;
  if (device->bytes() > 0) budget_->Account(seq);
  std::move(unref_mapped).Cancel();
  mutable_state.mapped_prefix = true;
  return tokens;
}

absl::StatusOr<PrefixPublisher::Chain> PrefixPublisher::FleetChain(const Layout& layout,
                                                                   const PromptPrefix& prompt,
                                                                   size_t max_blocks) const {
  if (absl::Status s = CheckPrompt(layout, prompt); !s.ok()) return s;
  Chain chain;
  chain.ns = Namespace(layout, prompt.model);
  if (max_blocks == 0) return chain;
  absl::StatusOr<std::vector<prefix::BlockHash>> hashes =
      PublishedPrefix(layout, prompt, max_blocks);
  if (!hashes.ok()) return hashes.status();
  chain.hashes = *std::move(hashes);
  return chain;
}

absl::StatusOr<uint64_t> PrefixPublisher::Lookup(const Layout& layout, const PromptPrefix& prompt,
                                                 const policy::Policy* policy,
                                                 const policy::ParamOverrides& params,
                                                 const QuantConfig& quant, bool device_step) const {
  if (absl::Status s = CheckPrompt(layout, prompt); !s.ok()) return s;
  if (prompt.document_tokens >= prompt.token_ids.size() && prompt.document_tokens > 0) {
    return absl::InvalidArgumentError(absl::StrCat("document_tokens: ", prompt.document_tokens,
                                                   " must be less than the prompt's ",
                                                   prompt.token_ids.size(), " tokens"));
  }
  if (prompt.document_tokens > 0 && policy != nullptr) {
    // What Map would never map is not reported either: nothing for a policy that needs
    // per-token signals, no document for a device step.
    if (policy->descriptor().append_signals != 0) return uint64_t{0};
    if (!(device_step && policy->has_kernel_step())) {
      absl::StatusOr<prefix::BlockHash> key =
          DocumentKey(prompt.token_ids.first(prompt.document_tokens),
                      Representation(policy->descriptor().name, params, quant), prompt.salt);
      if (!key.ok()) return key.status();
      if (index_->ContainsDocument(Namespace(layout, prompt.model), *key)) {
        return uint64_t{prompt.document_tokens};
      }
    }
  }
  absl::StatusOr<std::vector<prefix::BlockHash>> hashes = PublishedPrefix(layout, prompt);
  if (!hashes.ok()) return hashes.status();
  const size_t matched = index_->Match(Namespace(layout, prompt.model), *hashes);
  return uint64_t{matched} * layout.block_tokens;
}

std::string PrefixPublisher::Representation(absl::string_view policy_name,
                                            const policy::ParamOverrides& params,
                                            const QuantConfig& quant) {
  std::vector<std::pair<std::string, double>> sorted(params.begin(), params.end());
  std::sort(sorted.begin(), sorted.end());
  std::string out = absl::StrCat(policy_name, "(");
  // Exact values (%a): two parameters that differ never print alike.
  for (const auto& [k, v] : sorted) absl::StrAppend(&out, k, "=", absl::StrFormat("%a", v), ";");
  absl::StrAppend(
      &out, ") ",
      quant.type ? absl::StrCat("q", static_cast<int>(*quant.type), " recent ", quant.recent_tokens)
                 : std::string("layout"));
  return out;
}

absl::StatusOr<prefix::BlockHash> PrefixPublisher::DocumentKey(absl::Span<const int32_t> tokens,
                                                               absl::string_view representation,
                                                               absl::string_view salt) const {
  // One hash over all of the document's tokens; the extra keys keep it apart from any
  // block hash and carry what the compressed form depends on besides the tokens.
  return prefix::ChainHash(
      root_, tokens,
      std::vector<std::string>{"kvmem-document", std::string(representation), std::string(salt)});
}

absl::Status PrefixPublisher::AdoptDocument(Sequence& seq, const prefix::EntryPayload& payload,
                                            uint64_t version) {
  const auto& doc = static_cast<const DocumentState&>(payload);  // the only kind published
  if (doc.streams.size() != seq.num_streams()) {
    return absl::InternalError(absl::StrCat("a published document has ", doc.streams.size(),
                                            " streams, the sequence ", seq.num_streams()));
  }
  // The sequence is not visible yet: an exception here leaves it to be discarded.
  seq.ReserveTokens(doc.token_ids.size());
  // The document's scores, a copy of its own (a host slot state: documents are never of a
  // device step), in place of the sequence's empty one.
  if (doc.slots) {
    absl::StatusOr<std::unique_ptr<store::SlotState>> slots = doc.slots->Clone();
    if (!slots.ok()) return slots.status();
    seq.set_slots(*std::move(slots), /*kernel_step=*/false);
  }
  for (size_t s = 0; s < doc.streams.size(); ++s) seq.stream(s).AdoptFrom(doc.streams[s], version);
  const auto n = static_cast<int64_t>(doc.token_ids.size());
  seq.RecordAppend(doc.token_ids, n - 1, static_cast<uint64_t>(n));
  seq.set_policy_mark(doc.policy_mark);
  seq.mutable_prefix().compressed_document = true;  // it holds the same state
  seq.mutable_prefix().compressions = 1;
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> PrefixPublisher::PublishDocument(Sequence& seq) {
  const Sequence::PrefixState& state = seq.prefix();
  auto refuse = [&](absl::string_view why) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", seq.id(), ": not a compressed document: ", why));
  };
  if (!state.compressed_document) {
    return refuse(
        "its last change must be one Compress (by the policy's own rule, no target_tokens) of "
        "the tokens it appended, before any Step");
  }
  if (state.mapped_prefix) {
    return refuse(
        "its first tokens were mapped from a published prefix, so its compression did not see "
        "their queries; create it without the prompt's ids (or with document_tokens) to "
        "compute the whole document");
  }
  if (seq.kernel_step()) {
    return refuse(absl::StrCat("policy ", seq.policy_name(),
                               " keeps its scores in the backend (device step)"));
  }
  if (seq.policy().descriptor().append_signals != 0) {
    return refuse(absl::StrCat("policy ", seq.policy_name(),
                               " needs per-token signals on every append: nothing would map it"));
  }
  absl::Span<const int32_t> tokens = seq.token_ids();
  if (tokens.empty() || seq.last_position() != static_cast<int64_t>(tokens.size()) - 1) {
    return refuse("its tokens must be at positions 0, 1, ... (appended from position 0)");
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0) return refuse(absl::StrCat("token ", i, " was appended without its id"));
  }
  absl::StatusOr<prefix::BlockHash> key = DocumentKey(
      tokens, Representation(seq.policy_name(), seq.policy_params(), seq.quant()), state.salt);
  if (!key.ok()) return key.status();
  auto doc = std::make_shared<DocumentState>();
  std::vector<store::BlockId> blocks;
  for (const Stream& st : seq.streams()) {
    for (const StreamBlock& b : st.blocks()) blocks.push_back(b.id);
  }
  absl::StatusOr<HostReservation> host =
      budget_->Reserve(seq.host_bytes() + (seq.slots() ? seq.slots()->bytes() : 0) +
                           prefix::PrefixIndex::EntryHostBytes(state.ns.size() + 48, blocks.size()),
                       "Publish");
  if (!host.ok()) return host.status();
  doc->streams.assign(seq.streams().begin(), seq.streams().end());
  if (seq.slots()) {
    absl::StatusOr<std::unique_ptr<store::SlotState>> slots = seq.slots()->Clone();
    if (!slots.ok()) return slots.status();
    doc->slots = *std::move(slots);
  }
  doc->token_ids.assign(tokens.begin(), tokens.end());
  doc->policy_mark = seq.policy_mark();
  index_->PublishDocument(state.ns, *key, std::move(blocks), std::move(doc));
  return uint64_t{tokens.size()};
}

std::string PrefixPublisher::Namespace(const Layout& layout, absl::string_view model) {
  // Everything that makes two blocks of the same tokens hold different bytes, except the
  // tokens: the model, the layout and the precision (published blocks are never quantized).
  return absl::StrCat(layout.num_layers, "x", layout.num_kv_heads, "x", layout.head_dim, " ",
                      DTypeName(layout.dtype), " b", layout.block_tokens, " v", layout.vocab_size,
                      " layout-precision ", model.size(), ":", model);
}

absl::Status PrefixPublisher::CheckPrompt(const Layout& layout, const PromptPrefix& prompt) {
  if (prompt.salt.size() > kMaxSaltBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("cache_salt: ", prompt.salt.size(), " bytes, more than ", kMaxSaltBytes));
  }
  if (prompt.model.size() > kMaxSaltBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: ", prompt.model.size(), " bytes, more than ", kMaxSaltBytes));
  }
  if (prompt.token_ids.size() > kMaxPromptTokens) {
    return absl::InvalidArgumentError(absl::StrCat(prompt.token_ids_field, ": ",
                                                   prompt.token_ids.size(), " tokens, more than ",
                                                   kMaxPromptTokens));
  }
  for (size_t i = 0; i < prompt.token_ids.size(); ++i) {
    const int32_t t = prompt.token_ids[i];
    if (t < 0 || static_cast<uint32_t>(t) >= layout.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(prompt.token_ids_field, "[", i, "]: ", t,
                                                     " is outside [0, ", layout.vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<prefix::BlockHash>> PrefixPublisher::PublishedPrefix(
    const Layout& layout, const PromptPrefix& prompt, size_t all_of_first) const {
  // The last token is never reused: the worker computes it, for the logits it samples from.
  // A prompt that starts with a document maps its compressed document or nothing: without
  // it the client computes the whole document and compresses it (a compression sees every
  // query of the document) and may publish it. Hashed block by block, only as far as the
  // index has them.
  std::vector<prefix::BlockHash> hashes;
  if (prompt.token_ids.size() < 2 || prompt.document_tokens > 0) return hashes;
  const std::string ns = Namespace(layout, prompt.model);
  const uint32_t B = layout.block_tokens;
  const size_t blocks = (prompt.token_ids.size() - 1) / B;
  const bool held_only = all_of_first == 0;
  for (size_t i = 0; i < (held_only ? blocks : std::min(blocks, all_of_first)); ++i) {
    std::optional<std::vector<std::string>> extra;
    if (i == 0 && !prompt.salt.empty()) extra = std::vector<std::string>{prompt.salt};
    absl::StatusOr<prefix::BlockHash> h = prefix::ChainHash(
        i == 0 ? root_ : hashes.back(), prompt.token_ids.subspan(i * B, B), extra);
    if (!h.ok()) return h.status();
    if (held_only && !index_->Contains(ns, *h)) break;
    hashes.push_back(*h);
  }
  return hashes;
}

absl::Status PrefixPublisher::MapPrefix(Sequence& seq,
                                        const std::vector<std::vector<store::BlockId>>& mapped,
                                        absl::Span<const int32_t> token_ids, uint64_t version) {
  const uint32_t B = seq.layout().block_tokens;
  const size_t n = mapped.size() * B;
  const float initial = seq.policy().descriptor().initial_score.value_or(std::nanf(""));
  const uint32_t R = seq.policy().history_rows();
  std::vector<int64_t> positions(n);
  std::iota(positions.begin(), positions.end(), int64_t{0});
  const std::vector<float> unsent(n, std::numeric_limits<float>::quiet_NaN());
  // Everything that can fail or allocate first; then the install, which cannot.
  std::vector<std::vector<StreamBlock>> lists(seq.num_streams());
  for (size_t s = 0; s < lists.size(); ++s) {
    seq.stream(s).Reserve(n, R);
    lists[s].resize(mapped.size());
    for (size_t i = 0; i < mapped.size(); ++i) {
      lists[s][i] = StreamBlock{mapped[i][s], 0, B, Precision::kLayout};
    }
  }
  seq.ReserveTokens(n);
  if (seq.slots()) {
    if (absl::Status s = seq.slots()->Append(positions, initial); !s.ok()) return s;
  }
  for (size_t s = 0; s < lists.size(); ++s) {
    Stream& st = seq.stream(s);
    st.SwapBlocks(lists[s], version);
    st.AppendSlots(positions, R, unsent, unsent, 0);
  }
  seq.RecordAppend(token_ids.first(n), static_cast<int64_t>(n) - 1, n);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> PrefixPublisher::Publish(Sequence& seq, uint64_t up_to_tokens) {
  const uint32_t B = seq.layout().block_tokens;
  absl::Span<const int32_t> tokens = seq.token_ids();
  if (tokens.size() != seq.appended()) {
    return absl::InternalError(absl::StrCat("sequence ", seq.id(), ": ", seq.appended(),
                                            " tokens appended but ", tokens.size(), " token ids"));
  }
  size_t want = static_cast<size_t>(std::min<uint64_t>(up_to_tokens, tokens.size()) / B);
  Sequence::PrefixState& state = seq.mutable_prefix();
  // Nothing new to publish (most auto-published appends: no block filled) while the chain's
  // last published entry is still there (then so are its ancestors: only leaves go): skip
  // the walks below, which could only find that out.
  if (want <= state.published_blocks && state.published_blocks > 0 &&
      index_->Contains(state.ns, state.hashes[state.published_blocks - 1])) {
    return uint64_t{state.published_blocks} * B;
  }
  // Appends without token ids record -1 (append.cc): only whole blocks of known tokens.
  for (size_t i = 0; i < want * B; ++i) {
    if (tokens[i] >= 0) continue;
    if (i < B) {
      return absl::FailedPreconditionError(absl::StrCat(
          "sequence ", seq.id(), ": token ", i, " was appended without its token id; publishing",
          " needs the token id of every token it publishes (Append token_ids)"));
    }
    want = i / B;
    break;
  }
  // Whole in every stream: block i holds exactly tokens [i*B, (i+1)*B) at layout precision.
  // Positions increase, so the first and last position of the block's run settle it.
  size_t whole = 0;
  for (; whole < want; ++whole) {
    bool ok = true;
    for (const Stream& st : seq.streams()) {
      if (st.blocks().size() <= whole) {
        ok = false;
        break;
      }
      const StreamBlock& b = st.blocks()[whole];
      const size_t first = whole * B;
      ok = b.start == 0 && b.count == B && b.precision == Precision::kLayout &&
           st.positions()[first] == static_cast<int64_t>(first) &&
           st.positions()[first + B - 1] == static_cast<int64_t>(first + B - 1);
      if (!ok) break;
    }
    if (!ok) break;
  }
  // Entries from the first one this sequence has not published; from its first block again
  // when the one before it has been reclaimed meanwhile (a chain is matched from its start).
  size_t from = std::min(state.published_blocks, whole);
  if (from > 0 && !index_->Contains(state.ns, state.hashes[from - 1])) from = 0;
  if (from < whole) {
    absl::StatusOr<HostReservation> host = budget_->Reserve(
        (whole - from) * (prefix::PrefixIndex::EntryHostBytes(state.ns.size(), seq.num_streams()) +
                          sizeof(prefix::BlockHash)),
        "Publish");
    if (!host.ok()) return host.status();
    // The chain as far as it is needed (computed once per block).
    state.hashes.reserve(whole);
    while (state.hashes.size() < whole) {
      const size_t i = state.hashes.size();
      std::optional<std::vector<std::string>> extra;
      if (i == 0 && !state.salt.empty()) extra = std::vector<std::string>{state.salt};
      absl::StatusOr<prefix::BlockHash> h =
          prefix::ChainHash(i == 0 ? root_ : state.hashes[i - 1], tokens.subspan(i * B, B), extra);
      if (!h.ok()) return h.status();
      state.hashes.push_back(*h);
    }
    std::vector<store::BlockId> ids(seq.num_streams());
    for (size_t i = from; i < whole; ++i) {
      for (size_t s = 0; s < ids.size(); ++s) ids[s] = seq.streams()[s].blocks()[i].id;
      index_->Publish(state.ns, i == 0 ? nullptr : &state.hashes[i - 1], state.hashes[i], ids,
                      tokens.subspan(i * B, B),
                      i == 0 && !state.salt.empty() ? &state.salt : nullptr);
      state.published_blocks = std::max(state.published_blocks, i + 1);
    }
    budget_->Account(seq);  // the hashes it keeps
  }
  return uint64_t{state.published_blocks} * B;
}

}  // namespace kvmem::engine
