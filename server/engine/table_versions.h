#pragma once
// TableVersions: what a reader of a block table can trust. Epochs (unique for ever, across
// sequences) and their seqlock words on the EpochBoard; table versions (unique too) and what
// a client that holds version v needs to catch up (a delta, or the whole table); the write
// section that moves data under an odd word; poisoning, which leaves the word odd for good.
// Every method that takes a Sequence runs under its lock.
#include <cstdint>
#include <memory>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/engine/engine_types.h"
#include "server/engine/epoch_board.h"
#include "server/engine/sequence.h"
#include "server/engine/table_board.h"
#include "server/engine/telemetry.h"
#include "server/store/block_pool.h"

namespace kvmem::engine {

// Payloads of a stale-epoch error (absl::Status::GetPayload): the sequence's current epoch
// and table version, as decimal text.
inline constexpr absl::string_view kCurrentEpochPayload = "kvmem/current_epoch";
inline constexpr absl::string_view kCurrentVersionPayload = "kvmem/current_version";

class TableVersions {
 public:
  TableVersions(std::unique_ptr<EpochBoard> board, const store::BlockPool* pool,
                Telemetry* telemetry)
      : board_(std::move(board)), pool_(pool), telemetry_(telemetry) {}

  const EpochBoard& board() const { return *board_; }
  // The table area (kvmemd --table-area-bytes), or null.
  const TableBoard* tables() const { return tables_.get(); }
  void set_tables(std::unique_ptr<TableBoard> tables) { tables_ = std::move(tables); }

  // The sequence publishes its current version (Sequence::Publish), which also goes to the
  // table area when there is one.
  void Publish(Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // Writes the sequence's current table into the table area, if there is one (a sequence
  // created or forked: its first version, before any call publishes).
  void Mirror(const Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);

  // A fresh epoch and the board slot that publishes it; RESOURCE_EXHAUSTED when every slot
  // is taken (max_sequences).
  struct Claimed {
    uint64_t epoch = 0;
    uint32_t slot = 0;
  };
  absl::StatusOr<Claimed> ClaimSlot();
  // Gives a slot back that no sequence took.
  void ReturnSlot(uint32_t slot) { board_->Release(slot); }
  // A sequence being released: its word odd for good, so that no reader accepts its tables
  // from before its blocks go back (its slot is returned after: ReturnSlot).
  void Seal(Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // A fresh version for a change of block lists (it becomes seq.version()).
  uint64_t NewVersion(Sequence& seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);
  // Marks a sequence unusable after a failure past a point of no return: its epoch word
  // turns odd for good and every later call but Release gets DATA_LOSS naming it and `why`.
  // Returns that DATA_LOSS status.
  absl::Status Poison(Sequence& seq, const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq.mu);

  // A seqlock write section on one sequence: readers of its current tables fail from the
  // moment it opens. Commit() publishes a fresh epoch; destroyed without it (an error or an
  // exception past the point of no return), it poisons the sequence.
  class WriteSection {
   public:
    WriteSection(TableVersions* versions, Sequence* seq) ABSL_EXCLUSIVE_LOCKS_REQUIRED(seq->mu);
    WriteSection(const WriteSection&) = delete;
    WriteSection& operator=(const WriteSection&) = delete;
    ~WriteSection();
    void Commit();

   private:
    TableVersions* const versions_;
    Sequence* const seq_;
    bool committed_ = false;
  };

  // The whole table, or its streams of layers [layer_begin, layer_end) (end 0: through the
  // last); notes its version as answered: the client may hold it.
  BlockTable Table(const Sequence& seq, bool positions, uint32_t layer_begin = 0,
                   uint32_t layer_end = 0) const ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  // What changed since `known_version`: a delta when that version is one of the last two
  // the sequence published, else the whole table (also for a version of another sequence,
  // or 0 = none held). `version_before`: the table's version before the call that changed
  // it; a known version past it is one no answer can have carried (a guess at the call's
  // own), and gets the whole table too.
  TableUpdate Update(const Sequence& seq, uint64_t known_version, bool positions,
                     uint64_t version_before) const ABSL_SHARED_LOCKS_REQUIRED(seq.mu);
  // Update() for a call's answer: none without a held table or for a sequence that can no
  // longer serve, nor when host memory runs out (the call applied; its client fetches its
  // table). A client that reads the table area (held->from_area) is told the version to
  // read there instead, when the area holds it.
  std::optional<TableUpdate> Answer(const Sequence& seq, const std::optional<HeldTable>& held,
                                    uint64_t version_before) const
      ABSL_SHARED_LOCKS_REQUIRED(seq.mu);

  // FAILED_PRECONDITION (or `code`) `message`, carrying the current epoch and version as
  // payloads (kCurrentEpochPayload, kCurrentVersionPayload) for the caller's error details.
  static absl::Status StaleEpoch(const Sequence& seq, absl::string_view message,
                                 absl::StatusCode code = absl::StatusCode::kFailedPrecondition)
      ABSL_SHARED_LOCKS_REQUIRED(seq.mu);

 private:
  const std::unique_ptr<EpochBoard> board_;
  std::unique_ptr<TableBoard> tables_;  // set once, before the engine serves
  const store::BlockPool* const pool_;
  Telemetry* const telemetry_;
  // Epochs are unique for ever, across restarts too: a table or a remote reader's
  // connection kept from before a restart never finds its epoch again (FirstEpoch).
  std::atomic<uint64_t> next_epoch_{FirstEpoch()};
  std::atomic<uint64_t> next_version_{1};

  // A random start in [1, 2^48): a daemon would need 2^47 epochs a boot to meet another
  // boot's (and the epoch board's words, 2 * epoch + 1, stay far from overflowing).
  static uint64_t FirstEpoch();
};

}  // namespace kvmem::engine
