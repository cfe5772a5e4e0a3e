#pragma once
// A sequence moved whole from one kvmemd to another (MoveSequence): what the holder exports
// (Engine::BeginExport, ExportPiece, FinishExport) and what the receiver builds from it
// (Engine::BeginImport, SequenceImport::Add, Engine::CommitImport).
//
// The holder freezes the sequence for the move (changes are FAILED_PRECONDITION until
// FinishExport or the hold lapses) and sends, in stream order, each stream's blocks as they
// are (their live runs, precision and bytes) with their slots' state: positions, attention
// history, token signals, arrival steps, scores. Policies keep no state of their own (a
// Fork copies the same), so the receiver's sequence, with the token ids and counters, steps
// exactly as the holder's would have. Its table is new: versions and epochs are the
// receiver's.
//
// The receiver takes everything as untrusted input: each piece is checked against the
// header (stream order, slot and block counts, per-slot widths, runs within a block, a
// precision the sequence may hold, bytes as the layout says) before its blocks are
// allocated and written; the sequence becomes visible only at CommitImport, and an import
// dropped before it gives back every block, its epoch slot, its tenant hold and its host
// reservation. Prefix state moves without its hashes (recomputed here from the token ids
// when the sequence publishes) and with nothing published here yet.
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/engine/block_format.h"
#include "server/engine/host_budget.h"
#include "server/engine/layout.h"
#include "server/engine/sequence.h"
#include "server/engine/stream_planner.h"
#include "server/engine/table_versions.h"
#include "server/policy/policy.h"
#include "server/store/backend.h"
#include "server/store/block_pool.h"

namespace kvmem::engine {

class Telemetry;
class Tenants;

struct MovedBlock {
  uint32_t start = 0;
  uint32_t count = 0;
  Precision precision = Precision::kLayout;
};

// The sequence as a whole: everything but its streams.
struct MovedHeader {
  uint64_t export_id = 0;
  Layout layout;
  std::string policy;
  policy::ParamOverrides params;
  QuantConfig quant;
  std::vector<int32_t> token_ids;
  int64_t last_position = -1;
  uint64_t appended = 0;
  uint64_t steps = 0;
  int64_t policy_mark = 0;
  std::string salt;  // scoped (the tenant's)
  std::string model;
  bool auto_publish = false;
  bool compressed_document = false;
  uint32_t compressions = 0;
  bool mapped_prefix = false;
  std::vector<uint32_t> stream_slots;   // per stream
  std::vector<uint32_t> stream_blocks;  // per stream
  uint64_t block_bytes = 0;             // summed over every block
  uint32_t history_rows = 0;
  bool token_signals = false;
  bool arrival_steps = false;
  bool scores = false;
};

// A run of one stream's blocks, their slots' values and bytes.
struct MovedPiece {
  uint32_t stream = 0;
  std::vector<MovedBlock> blocks;
  std::vector<int64_t> positions;
  std::vector<float> history;  // history_rows per slot
  std::vector<float> token_entropy;
  std::vector<float> layer_distance;
  std::vector<int64_t> arrival_steps;
  std::vector<float> scores;
  std::string data;  // each block's block_bytes(precision), in order
  // Instead of `data` (an export by offsets): each block's offset in the holder's pool.
  std::vector<uint64_t> offsets;
};

// Where an export's next piece begins.
struct ExportCursor {
  uint32_t stream = 0;
  size_t block = 0;   // in the stream's list
  uint64_t slot = 0;  // the stream's slot index of that block's first live slot
};

// Exports that ended in a move (FinishExport with `moved`), remembered for a while, so that
// a receiver whose answer was lost and that asks again learns that the move happened, not
// that the sequence is unknown (and does not drop the only copy left). At most kMost
// entries, each kept kKeep.
class MovedExports {
 public:
  static constexpr size_t kMost = 4096;
  static constexpr absl::Duration kKeep = absl::Minutes(10);
  void Add(uint64_t export_id, uint64_t sequence_id, std::string owner);
  // Whether export `export_id` of sequence `sequence_id` ended in a move; `owner` null: any
  // owner's (an admin's question).
  bool Moved(uint64_t export_id, uint64_t sequence_id, const std::string* owner) const;

 private:
  struct Entry {
    uint64_t sequence_id;
    std::string owner;
    absl::Time at;
  };
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::deque<uint64_t> order_ ABSL_GUARDED_BY(mu_);  // oldest first
};

// Most bytes of K/V the pieces of one export carry each (and at least one block).
inline constexpr uint64_t kMovePieceBytes = 2 << 20;

// The rooms an import uses, the engine's.
struct ImportRooms {
  store::BlockPool* pool;
  store::Backend* backend;
  TableVersions* versions;
  Tenants* tenants;
  Telemetry* telemetry;  // counts forsaken blocks
};

class SequenceImport {
 public:
  SequenceImport(const SequenceImport&) = delete;
  SequenceImport& operator=(const SequenceImport&) = delete;
  // Gives back what an import not committed holds.
  ~SequenceImport();

  // The next piece: checked against the header and the pieces before it, then its blocks
  // allocated (charged to the sequence's tenant) and written. An error changes nothing the
  // import holds but the piece's own blocks, freed with it; the import should be dropped.
  absl::Status Add(const MovedPiece& piece);
  // Add for a piece by offsets whose bytes land in the pool in place (UCX gets straight into
  // its blocks, no copy after): the piece checked (`data` empty) and taken as Add takes it,
  // answering where each of its blocks' bytes go in this process, in the piece's order; the
  // caller gets them there and then says so (Landed, counting pieces). Only where
  // lands_in_place() (the pool is host memory). CommitImport refuses an import with pieces
  // not landed. Where every block is at the layout's precision, the first Reserve
  // allocates every block of the sequence, in the order a prefill leaves a holder's (each
  // block index of every stream in turn), so that blocks side by side in the holder's
  // pool land side by side here: the gets of several pieces merge into large ones.
  bool lands_in_place() const { return host_pool_ != nullptr; }
  absl::StatusOr<std::vector<uint8_t*>> Reserve(const MovedPiece& piece);
  void Landed(uint64_t pieces);
  // A reader may still write into the blocks reserved (a get abandoned in flight): they
  // stay out of circulation for good, charged to the tenant, rather than be handed to
  // another sequence; the import can no longer commit.
  void Forsake();
  // Every stream's blocks and slots came.
  bool complete() const;
  const MovedHeader& header() const { return header_; }
  const BlockFormat& format() const { return format_; }
  uint64_t blocks() const { return block_count_; }
  uint64_t bytes() const { return bytes_; }

 private:
  friend class Engine;
  struct Staged {
    std::vector<StreamBlock> blocks;
    std::vector<int64_t> positions, arrival_steps;
    std::vector<float> history, token_entropy, layer_distance, scores;
  };
  SequenceImport(const ImportRooms& rooms, MovedHeader header, BlockFormat format,
                 std::string tenant_key, std::string owner, store::TenantId tenant,
                 HostReservation host, std::shared_ptr<HostShare> share);
  // The first stream at or after `from` that still has blocks to come.
  uint32_t NextStream(uint32_t from) const;
  // `landing`: the piece's bytes come in place (Reserve), not in its `data`.
  absl::Status Check(const MovedPiece& piece, bool landing) const;
  // The piece's blocks allocated, charged to the tenant, into `ids` (all or none; a run of
  // blocks of one precision in one allocation).
  absl::Status Allocate(const MovedPiece& piece, std::vector<store::BlockId>* ids);
  // The checked piece's slots and blocks (`ids`, whose bytes are written) into its stream.
  void Take(const MovedPiece& piece, const std::vector<store::BlockId>& ids);

  const ImportRooms rooms_;
  const MovedHeader header_;
  const BlockFormat format_;
  const std::string tenant_key_;  // Tenants' key (the owner, or the salt without one)
  const std::string owner_;
  const store::TenantId tenant_;
  HostReservation host_;
  std::shared_ptr<HostShare> share_;
  std::vector<Staged> streams_;
  uint32_t stream_ = 0;  // the stream pieces come for now
  uint64_t block_count_ = 0;
  uint64_t bytes_ = 0;
  bool committed_ = false;    // the sequence owns the blocks and the tenant hold
  uint8_t* const host_pool_;  // the backend's host_pool(): pieces land in place
  // Reserve's: every stream's blocks allocated at once (empty: each piece's when it comes),
  // and the pieces reserved whose bytes have not landed yet.
  std::vector<std::vector<store::BlockId>> allocated_;
  uint64_t unlanded_ = 0;
  bool forsaken_ = false;
};

}  // namespace kvmem::engine
