#include "server/engine/table_versions.h"

#include <new>
#include <random>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "server/engine/sequence_registry.h"
#include "spdlog/spdlog.h"

namespace kvmem::engine {

uint64_t TableVersions::FirstEpoch() {
  std::random_device device;  // the kernel's randomness (getrandom)
  const uint64_t bits = (uint64_t{device()} << 32) | device();
  return 1 + bits % ((uint64_t{1} << 48) - 1);
}

absl::StatusOr<TableVersions::Claimed> TableVersions::ClaimSlot() {
  const uint64_t epoch = next_epoch_.fetch_add(1);
  absl::StatusOr<uint32_t> slot = board_->Acquire(epoch);
  if (!slot.ok()) return slot.status();
  return Claimed{epoch, *slot};
}

void TableVersions::Seal(Sequence& seq) {
  board_->BeginWrite(seq.epoch_slot(), seq.epoch());
  if (tables_) tables_->Clear(seq.epoch_slot());
}

void TableVersions::Publish(Sequence& seq) {
  seq.Publish();
  Mirror(seq);
}

void TableVersions::Mirror(const Sequence& seq) {
  if (tables_ && !seq.poisoned() && !seq.released()) tables_->Write(seq, *pool_);
}

uint64_t TableVersions::NewVersion(Sequence& seq) {
  seq.set_version(next_version_.fetch_add(1));
  return seq.version();
}

absl::Status TableVersions::Poison(Sequence& seq, const absl::Status& why) {
  if (seq.Poison(why.message())) {
    ++telemetry_->sequences_poisoned;
    spdlog::error("sequence {} poisoned: {}", seq.id(), why.ToString());
  }
  // Odd for good: readers of any table of this sequence fail from now on.
  Seal(seq);
  return SequenceRegistry::Unusable(seq);
}

TableVersions::WriteSection::WriteSection(TableVersions* versions, Sequence* seq)
    : versions_(versions), seq_(seq) {
  versions_->board_->BeginWrite(seq_->epoch_slot(), seq_->epoch());
}

void TableVersions::WriteSection::Commit() {
  seq_->mu.AssertHeld();  // a section lives inside its sequence's lock (its constructor's)
  seq_->set_epoch(versions_->next_epoch_.fetch_add(1));
  versions_->board_->EndWrite(seq_->epoch_slot(), seq_->epoch());
  committed_ = true;
}

TableVersions::WriteSection::~WriteSection() {
  seq_->mu.AssertHeld();
  if (!committed_) {
    versions_->Poison(*seq_, absl::InternalError("a write section ended without its commit"))
        .IgnoreError();
  }
}

absl::Status TableVersions::StaleEpoch(const Sequence& seq, absl::string_view message,
                                       absl::StatusCode code) {
  absl::Status status(code, message);
  status.SetPayload(kCurrentEpochPayload, absl::Cord(absl::StrCat(seq.epoch())));
  status.SetPayload(kCurrentVersionPayload, absl::Cord(absl::StrCat(seq.version())));
  return status;
}

BlockTable TableVersions::Table(const Sequence& seq, bool positions, uint32_t layer_begin,
                                uint32_t layer_end) const {
  BlockTable table;
  table.sequence_id = seq.id();
  table.epoch = seq.epoch();
  table.version = seq.version();
  seq.NoteAnswered(table.version);
  table.layout = seq.layout();
  table.epoch_slot = seq.epoch_slot();
  table.quantization = seq.format().quant_precision();
  table.quantized_block_bytes =
      seq.quant().type ? seq.format().block_bytes(seq.format().quant_precision()) : 0;
  const size_t heads = seq.layout().num_kv_heads;
  const size_t first = layer_begin * heads;
  const size_t last = layer_end == 0 ? seq.streams().size() : layer_end * heads;
  table.streams.resize(last - first);
  for (size_t s = first; s < last; ++s) {
    const Stream& st = seq.streams()[s];
    StreamTable& out = table.streams[s - first];
    out.layer = static_cast<uint32_t>(s / seq.layout().num_kv_heads);
    out.kv_head = static_cast<uint32_t>(s % seq.layout().num_kv_heads);
    out.blocks.reserve(st.blocks().size());
    for (const StreamBlock& b : st.blocks()) {
      out.blocks.push_back({b.id, pool_->offset(b.id), b.start, b.count, b.precision});
    }
    if (positions) out.positions.assign(st.positions().begin(), st.positions().end());
  }
  table.positions = positions;
  return table;
}

std::optional<TableUpdate> TableVersions::Answer(const Sequence& seq,
                                                 const std::optional<HeldTable>& held,
                                                 uint64_t version_before) const {
  if (!held || seq.poisoned() || seq.released()) return std::nullopt;
  if (held->from_area && !held->positions && held->version != seq.version() && tables_ &&
      tables_->Holds(seq.epoch_slot(), seq.id(), seq.version())) {
    seq.NoteAnswered(seq.version());
    return std::optional<TableUpdate>(
        std::in_place,
        TableUpdate{held->version, seq.version(), seq.epoch(), std::nullopt, {}, true});
  }
  try {
    return Update(seq, held->version, held->positions, version_before);
  } catch (const std::bad_alloc&) {
    return std::nullopt;
  }
}

TableUpdate TableVersions::Update(const Sequence& seq, uint64_t known_version, bool positions,
                                  uint64_t version_before) const {
  if (known_version > version_before) known_version = 0;  // a guess: none held
  TableUpdate update;
  update.base_version = known_version;
  update.version = seq.version();
  update.epoch = seq.epoch();
  // A version past every one a client was told of cannot be held: the whole table.
  const int which = known_version <= seq.answered_version() ? seq.PublishedSlot(known_version) : -1;
  if (which < 0) {
    update.table = Table(seq, positions);  // notes the version as answered
    return update;
  }
  seq.NoteAnswered(update.version);
  update.streams.reserve(seq.streams().size());
  for (size_t s = 0; s < seq.streams().size(); ++s) {
    const Stream& st = seq.streams()[s];
    if (st.changed_version() <= known_version) continue;
    const std::vector<StreamBlock>& blocks = st.blocks();
    StreamDelta delta;
    delta.stream = static_cast<uint32_t>(s);
    delta.block_count = static_cast<uint32_t>(blocks.size());
    absl::Span<const int64_t> all = st.positions();
    size_t slot = 0;  // the first slot of blocks[i]
    // Entries the changes since the client's version left untouched (an append's front, a step's
    // blocks between its head and its tail): where the client holds them, one run, without
    // walking them. The ends are checked all the same; positions need every block's slot
    // count: walk then.
    const Stream::UntouchedRun& run = st.untouched();
    const bool skip = !positions && run.size() > 0 && run.end <= blocks.size() &&
                      st.untouched_base() == known_version &&
                      blocks[run.begin].version <= known_version &&
                      blocks[run.end - 1].version <= known_version &&
                      static_cast<ptrdiff_t>(blocks[run.begin].published_index[which]) ==
                          static_cast<ptrdiff_t>(run.begin) - run.shift &&
                      static_cast<ptrdiff_t>(blocks[run.end - 1].published_index[which]) ==
                          static_cast<ptrdiff_t>(run.end - 1) - run.shift;
    // `count` entries from index `at` held by the client from its index `from` on.
    const auto keep = [&delta](size_t at, uint32_t from, uint32_t count) {
      KeptRun* last = delta.kept.empty() ? nullptr : &delta.kept.back();
      if (last != nullptr && last->at + last->count == at && last->from + last->count == from) {
        last->count += count;
      } else {
        delta.kept.push_back({static_cast<uint32_t>(at), from, count});
      }
    };
    for (size_t i = 0; i < blocks.size(); slot += blocks[i].count, ++i) {
      if (skip && i == run.begin) {
        keep(i, blocks[i].published_index[which], static_cast<uint32_t>(run.size()));
        i = run.end - 1;  // (`slot` goes wrong from here: it counts for positions only)
        continue;
      }
      const StreamBlock& b = blocks[i];
      if (b.version <= known_version) {  // held by the client: where it sits there
        keep(i, b.published_index[which], 1);
        continue;
      }
      delta.blocks.push_back({b.id, pool_->offset(b.id), b.start, b.count, b.precision});
      if (positions) {
        delta.positions.insert(delta.positions.end(), all.begin() + static_cast<ptrdiff_t>(slot),
                               all.begin() + static_cast<ptrdiff_t>(slot + b.count));
      }
    }
    update.streams.push_back(std::move(delta));
  }
  return update;
}

}  // namespace kvmem::engine
