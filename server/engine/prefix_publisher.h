#pragma once
// PrefixPublisher: a sequence's side of prefix sharing. Publishes a sequence's leading full
// blocks under their hash chain (vLLM's sha256_cbor), or its whole compressed cache as a
// shared document; at creation, plans and maps the longest published prefix (or document) of
// a new sequence's prompt into it. Owns the index of published blocks (prefix/), which holds
// pool references: it goes before the pool. Methods that take a Sequence run under its lock.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/engine/engine_types.h"
#include "server/engine/host_budget.h"
#include "server/engine/sequence.h"
#include "server/policy/policy.h"
#include "server/prefix/prefix_hash.h"
#include "server/prefix/prefix_index.h"
#include "server/store/block_pool.h"

namespace kvmem::engine {

class PrefixPublisher {
 public:
  PrefixPublisher(store::BlockPool* pool, prefix::BlockHash root);
  // Set once the budget exists (it counts the index's own memory).
  void set_budget(HostBudget* budget) { budget_ = budget; }

  prefix::PrefixIndex& index() { return *index_; }
  const prefix::PrefixIndex& index() const { return *index_; }

  // The namespace of a layout and model: what makes two blocks of the same tokens hold
  // different bytes, except the tokens.
  static std::string Namespace(const Layout& layout, absl::string_view model);
  // A prompt's sizes and token ids against the limits and the layout.
  static absl::Status CheckPrompt(const Layout& layout, const PromptPrefix& prompt);

  // What a new sequence of this layout, policy and prompt would map: the hashes of its
  // leading published blocks (never the block of its last token), or the key of its
  // published compressed document. `device_step`: the policy steps in a SlotState (no
  // documents: they are host state). Checks the prompt.
  struct MapPlan {
    std::vector<prefix::BlockHash> hashes;
    std::optional<prefix::BlockHash> document;
  };
  absl::StatusOr<MapPlan> Plan(const Layout& layout, const PromptPrefix& prompt,
                               const policy::Policy& policy, const policy::ParamOverrides& params,
                               const QuantConfig& quant, bool device_step) const;
  // Maps what `plan` names into a new, empty sequence (references taken for it, host bytes
  // added to `host`) under `version`; returns the tokens reused (0: nothing found). An error
  // changes nothing.
  absl::StatusOr<uint64_t> Map(Sequence& seq, const PromptPrefix& prompt, const MapPlan& plan,
                               HostReservation* host, uint64_t version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // The prompt's chain as a fleet's shared index names it (service/cluster_index.h): the
  // namespace and the hashes of the blocks Lookup counts (at most max_blocks), held here or
  // not. None for a prompt that starts with a document (documents are this node's own).
  struct Chain {
    std::string ns;
    std::vector<prefix::BlockHash> hashes;
  };
  absl::StatusOr<Chain> FleetChain(const Layout& layout, const PromptPrefix& prompt,
                                   size_t max_blocks) const;
  // How many tokens of the prompt a new sequence would reuse now. Pins nothing. `policy`
  // (the sequence's, for its document's representation) is needed with document_tokens.
  absl::StatusOr<uint64_t> Lookup(const Layout& layout, const PromptPrefix& prompt,
                                  const policy::Policy* policy,
                                  const policy::ParamOverrides& params, const QuantConfig& quant,
                                  bool device_step) const;

  // Publishes the sequence's leading full blocks up to `up_to_tokens`, as far as they are
  // whole in every stream and their token ids were sent; returns the tokens published.
  // Idempotent.
  absl::StatusOr<uint64_t> Publish(Sequence& seq, uint64_t up_to_tokens)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // Publishes the sequence's whole cache as the compressed form of its tokens (its last
  // change a Compress by the policy's rule, no Step before); returns the tokens.
  absl::StatusOr<uint64_t> PublishDocument(Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);

 private:
  // A representation's name (policy, parameters, quantization) and a document's key.
  static std::string Representation(absl::string_view policy_name,
                                    const policy::ParamOverrides& params, const QuantConfig& quant);
  absl::StatusOr<prefix::BlockHash> DocumentKey(absl::Span<const int32_t> tokens,
                                                absl::string_view representation,
                                                absl::string_view salt) const;
  // The hashes of the prompt's blocks that Lookup counts: as far as the index holds them
  // (all_of_first 0), else the first all_of_first of them, held or not.
  absl::StatusOr<std::vector<prefix::BlockHash>> PublishedPrefix(const Layout& layout,
                                                                 const PromptPrefix& prompt,
                                                                 size_t all_of_first = 0) const;
  absl::Status MapPrefix(Sequence& seq, const std::vector<std::vector<store::BlockId>>& mapped,
                         absl::Span<const int32_t> token_ids, uint64_t version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  absl::Status AdoptDocument(Sequence& seq, const prefix::EntryPayload& payload, uint64_t version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);

  store::BlockPool* const pool_;
  const std::unique_ptr<prefix::PrefixIndex> index_;
  const prefix::BlockHash root_;
  HostBudget* budget_ = nullptr;
};

}  // namespace kvmem::engine
