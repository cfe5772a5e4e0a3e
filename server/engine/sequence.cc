#include "server/engine/sequence.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvmem::engine {
void Stream::Reserve(size_t more, uint32_t history_rows) {
  ForEachColumn(history_rows, [&](auto& column, size_t width) { column.Reserve(more * width); });
}

uint64_t Stream::ReserveGrowth(size_t more, uint32_t history_rows) const {
  uint64_t bytes = 0;
  ForEachColumn(history_rows, [&](const auto& column, size_t width) {
    bytes += column.GrowthBytes(more * width);
  });
  return bytes;
}

uint64_t Stream::BlockListGrowth(size_t from, size_t tail_size, size_t tail_capacity) const {
  // From 0 the list is swapped whole (SwapBlocks): the stream keeps the tail's buffer.
  const size_t now = blocks_.capacity();
  const size_t after = from == 0                 ? tail_capacity
                       : now >= from + tail_size ? now
                                                 : std::max(from + tail_size, 2 * now);
  return after > now ? (after - now) * sizeof(StreamBlock) : 0;
}

void Stream::AppendSlots(absl::Span<const int64_t> positions, uint32_t history_rows,
                         absl::Span<const float> token_entropy,
                         absl::Span<const float> layer_distance, int64_t arrival) {
  const size_t n = positions.size();
  positions_.Append(positions);
  history_.AppendFill(n * history_rows, 0.0f);
  if (token_signals_) {
    token_entropy_.Append(token_entropy);
    layer_distance_.Append(layer_distance);
  }
  if (arrival_steps_) arrival_step_.AppendFill(n, arrival);
}

void Stream::KeepSlots(const KeepSet& keep, uint32_t history_rows) {
  KeepRuns(keep, [&](auto&& f) { ForEachColumn(history_rows, f); });
}

void Stream::SwapBlocks(std::vector<StreamBlock>& other, uint64_t version, size_t from, size_t to) {
  // The KV byte tally: the old entries leave it, the new ones join it.
  auto tally = [this](const StreamBlock& b, bool add) {
    const bool layout = b.precision == Precision::kLayout;
    uint64_t& slots = layout ? layout_slots_ : quantized_slots_;
    slots = add ? slots + b.count : slots - b.count;
    if (!layout) quantized_blocks_ = add ? quantized_blocks_ + 1 : quantized_blocks_ - 1;
  };
  to = std::min(to, blocks_.size());
  const size_t old_size = blocks_.size();
  for (size_t i = from; i < to; ++i) tally(blocks_[i], false);
  // blocks_ = [prefix][old entries][suffix], other = [new entries]: exchange the middles.
  const size_t old_n = to - from, new_n = other.size();
  if (from == 0 && to == blocks_.size()) {
    blocks_.swap(other);
  } else {
    const size_t common = std::min(old_n, new_n);
    const auto at = blocks_.begin() + static_cast<ptrdiff_t>(from);
    std::swap_ranges(other.begin(), other.begin() + static_cast<ptrdiff_t>(common), at);
    if (new_n > common) {
      blocks_.insert(at + static_cast<ptrdiff_t>(common),
                     other.begin() + static_cast<ptrdiff_t>(common), other.end());
      other.resize(common);
    } else if (old_n > common) {
      other.insert(other.end(), at + static_cast<ptrdiff_t>(common),
                   at + static_cast<ptrdiff_t>(old_n));
      blocks_.erase(at + static_cast<ptrdiff_t>(common), at + static_cast<ptrdiff_t>(old_n));
    }
  }
  const std::vector<StreamBlock>& old = other;  // old[k] was entry from + k
  bool changed = new_n != old_n;
  // The first entry not at its old index, or new: the suffix moved when the middle's
  // length changed.
  size_t moved_from = new_n != old_n ? from + new_n : blocks_.size();
  size_t touched_from = from + std::min(new_n, old_n);  // the first entry changed
  size_t j = 0;                                         // old entries before j are paired or gone
  for (size_t i = from; i < from + new_n; ++i) {
    StreamBlock& b = blocks_[i];
    tally(b, true);
    size_t k = j;
    if (b.version != 0) {
      while (k < old.size() && old[k].id != b.id) ++k;
    } else {
      k = old.size();  // a new block id, or slots written
    }
    const bool paired = k < old.size();
    if (paired) j = k + 1;
    if (!paired || from + k != i) moved_from = std::min(moved_from, i);
    if (!paired || b.start != old[k].start || b.count != old[k].count ||
        b.precision != old[k].precision) {
      b.version = version;
      changed = true;
      touched_from = std::min(touched_from, i);
    }
  }
  if (moved_from < blocks_.size()) changed = true;
  for (size_t& f : reindex_from_) f = std::min(f, moved_from);
  if (!changed) return;
  RecordChange(version, old_size, std::min(touched_from, moved_from), to,
               static_cast<ptrdiff_t>(new_n) - static_cast<ptrdiff_t>(old_n));
}

void Stream::GrowTail(uint32_t n, uint64_t version) {
  StreamBlock& last = blocks_.back();
  last.count += n;
  last.version = version;
  layout_slots_ += n;
  for (size_t& f : reindex_from_) f = std::min(f, blocks_.size());
  RecordChange(version, blocks_.size(), blocks_.size() - 1, blocks_.size(), 0);
}

void Stream::RecordChange(uint64_t version, size_t old_size, size_t touched_from, size_t to,
                          ptrdiff_t moved) {
  if (version != changed_version_) previous_changed_version_ = changed_version_;
  // The run left untouched, in the list as it was before this change: all of it at the
  // first change since the list was published, else what the changes since then left.
  if (run_fresh_) {
    untouched_ = {0, old_size, 0};
    untouched_base_ = marked_version_;
    run_fresh_ = false;
  }
  // This change keeps the run's part before touched_from where it was, and its part in
  // the old suffix [to, old_size), moved by the middle's change of length; the longer
  // part stays the run.
  const UntouchedRun& run = untouched_;
  UntouchedRun before{run.begin, std::max(run.begin, std::min(run.end, touched_from)), run.shift};
  UntouchedRun after;
  if (run.end > std::max(run.begin, to)) {
    const size_t first = std::max(run.begin, to);
    after = {static_cast<size_t>(static_cast<ptrdiff_t>(first) + moved),
             static_cast<size_t>(static_cast<ptrdiff_t>(run.end) + moved), run.shift + moved};
  }
  untouched_ = after.size() > before.size() ? after : before;
  changed_version_ = version;
}

void Stream::AdoptFrom(const Stream& other, uint64_t version) {
  *this = other;
  StartTable(version);
}

void Stream::LoadMoved(std::vector<StreamBlock> blocks, uint64_t version,
                       std::vector<int64_t> positions, std::vector<float> history,
                       std::vector<float> token_entropy, std::vector<float> layer_distance,
                       std::vector<int64_t> arrival_steps) {
  Stream loaded;
  loaded.token_signals_ = token_signals_;
  loaded.arrival_steps_ = arrival_steps_;
  loaded.positions_.Assign(std::move(positions));
  loaded.history_.Assign(std::move(history));
  if (token_signals_) {
    loaded.token_entropy_.Assign(std::move(token_entropy));
    loaded.layer_distance_.Assign(std::move(layer_distance));
  }
  if (arrival_steps_) loaded.arrival_step_.Assign(std::move(arrival_steps));
  loaded.SwapBlocks(blocks, version);  // keeps the KV byte tally
  loaded.StartTable(version);
  *this = std::move(loaded);
}

void Stream::StartTable(uint64_t version) {
  for (StreamBlock& b : blocks_) {
    b.version = version;
    b.published_index[0] = b.published_index[1] = 0;
  }
  reindex_from_[0] = reindex_from_[1] = 0;
  changed_version_ = version;
  // Another stream's history says nothing of this one's.
  untouched_ = {};
  untouched_base_ = marked_version_ = 0;
  run_fresh_ = true;
}

void Stream::MarkPublished(int which, uint64_t version) {
  marked_version_ = version;
  run_fresh_ = true;
  for (size_t i = reindex_from_[which]; i < blocks_.size(); ++i) {
    blocks_[i].published_index[which] = static_cast<uint32_t>(i);
  }
  reindex_from_[which] = blocks_.size();
}

void Stream::RecordHistory(absl::Span<const float> row, size_t column, uint32_t history_rows) {
  for (size_t j = 0; j < size(); ++j) {
    history_.data()[j * history_rows + column] = j < row.size() ? row[j] : 0.0f;
  }
}

uint64_t Stream::host_bytes() const {
  return sizeof(Stream) + blocks_.capacity() * sizeof(StreamBlock) +
         positions_.capacity() * sizeof(int64_t) + history_.capacity() * sizeof(float) +
         token_entropy_.capacity() * sizeof(float) + layer_distance_.capacity() * sizeof(float) +
         arrival_step_.capacity() * sizeof(int64_t);
}

bool Sequence::Poison(absl::string_view why) {
  if (poisoned()) return false;
  poison_reason_ = std::string(why.substr(0, 512));
  if (poison_reason_.empty()) poison_reason_ = "a mutation failed past its point of no return";
  poisoned_flag_.store(true, std::memory_order_release);
  return true;
}

void Sequence::ReserveTokens(size_t more) {
  if (token_ids_.capacity() < token_ids_.size() + more) {
    token_ids_.reserve(std::max(token_ids_.size() + more, 2 * token_ids_.capacity()));
  }
}

uint64_t Sequence::SlotGrowth(size_t tokens) const {
  uint64_t bytes = 0;
  if (token_ids_.capacity() < token_ids_.size() + tokens) {
    bytes +=
        (std::max(token_ids_.size() + tokens, 2 * token_ids_.capacity()) - token_ids_.capacity()) *
        sizeof(int32_t);
  }
  for (const Stream& st : streams_) {
    bytes += st.ReserveGrowth(tokens, policy_->history_rows());
  }
  if (slots_ && !slots_->in_device_memory()) {
    bytes += slots_->AppendGrowth(static_cast<uint32_t>(tokens));
  }
  return bytes;
}

uint64_t Sequence::DeviceSlotGrowth(size_t tokens) const {
  if (!slots_ || !slots_->in_device_memory()) return 0;
  const uint64_t growth = slots_->AppendGrowth(static_cast<uint32_t>(tokens));
  // A growth moves the state to a new allocation beside the old one, for a moment.
  return growth > 0 ? growth + slots_->bytes() : 0;
}

void Sequence::RecordAppend(absl::Span<const int32_t> token_ids, int64_t last_position,
                            uint64_t tokens) {
  token_ids_.insert(token_ids_.end(), token_ids.begin(), token_ids.end());
  last_position_ = last_position;
  appended_ += tokens;
}

void Sequence::set_version(uint64_t version) {
  // Versions come from one engine-wide counter: a smaller one would let a client's stale
  // version pass for a newer one.
  if (version > version_) version_ = version;
}

void Sequence::Publish() {
  if (published_version_[newest_published_] == version_) return;
  const int which = 1 - newest_published_;  // the older of the two makes room
  for (Stream& st : streams_) st.MarkPublished(which, version_);
  published_version_[which] = version_;
  newest_published_ = which;
}

int Sequence::PublishedSlot(uint64_t version) const {
  if (version == 0) return -1;
  for (int which = 0; which < 2; ++which) {
    if (published_version_[which] == version) return which;
  }
  return -1;
}

void Sequence::CopyStateFrom(const Sequence& parent, std::unique_ptr<store::SlotState> slots) {
  streams_ = parent.streams_;
  slots_ = std::move(slots);
  kernel_step_ = parent.kernel_step_ && slots_ != nullptr;
  token_ids_ = parent.token_ids_;
  last_position_ = parent.last_position_;
  appended_ = parent.appended_;
  version_ = parent.version_;
  std::copy(std::begin(parent.published_version_), std::end(parent.published_version_),
            std::begin(published_version_));
  newest_published_ = parent.newest_published_;
  answered_version_.store(parent.answered_version(), std::memory_order_relaxed);
  steps_ = parent.steps_;
  policy_mark_ = parent.policy_mark_;
  prefix_ = parent.prefix_;
}

void Sequence::Clear() {
  for (Stream& st : streams_) st.Clear();
  slots_.reset();
  kernel_step_ = false;
  // Swapped with empty vectors: `= {}` would keep their room.
  std::vector<store::BlockId>().swap(orphan_blocks_);
  std::vector<std::vector<StreamBlock>>().swap(spare_lists_);
  plan_.reset();  // its references were taken first, with the orphans
  released_ = true;
}

uint64_t Sequence::host_bytes() const {
  uint64_t bytes = sizeof(Sequence) + token_ids_.capacity() * sizeof(int32_t) +
                   prefix_.hashes.capacity() * sizeof(prefix::BlockHash);
  for (const Stream& s : streams_) bytes += s.host_bytes();
  bytes += spare_lists_.capacity() * sizeof(std::vector<StreamBlock>);
  for (const std::vector<StreamBlock>& list : spare_lists_) {
    bytes += list.capacity() * sizeof(StreamBlock);
  }
  if (plan_) {
    bytes += plan_->streams.capacity() * sizeof(WritePlan::Target) +
             plan_->held.capacity() * sizeof(store::BlockId);
  }
  return bytes;
}

absl::Status Sequence::CheckInvariants() const {
  const uint32_t B = layout_.block_tokens;
  const uint32_t history_rows = policy_->history_rows();
  if (streams_.size() != layout_.num_streams()) {
    return absl::InternalError(absl::StrCat("sequence ", id_, ": ", streams_.size(),
                                            " streams, the layout has ", layout_.num_streams()));
  }
  for (uint64_t v : published_version_) {
    if (v > version_) {
      return absl::InternalError(absl::StrCat("sequence ", id_, ": published version ", v,
                                              " is newer than the table's ", version_));
    }
  }
  if (!released_ && policy_->descriptor().initial_score.has_value() != (slots_ != nullptr)) {
    return absl::InternalError(absl::StrCat("sequence ", id_,
                                            ": the scores have no home, or one without a policy "
                                            "that keeps them"));
  }
  for (size_t s = 0; s < streams_.size(); ++s) {
    const Stream& st = streams_[s];
    const size_t n = st.size();
    auto broken = [&](absl::string_view what) {
      return absl::InternalError(
          absl::StrCat("sequence ", id_, " stream ", s, ": ", what, " (", n, " slots)"));
    };
    const size_t signals = st.token_signals() ? n : 0;
    if (st.token_entropy().size() != signals || st.layer_distance().size() != signals ||
        st.arrival_step().size() != (st.arrival_steps() ? n : 0)) {
      return broken("per-slot signals disagree with the positions");
    }
    if (st.history().size() != n * history_rows) return broken("history disagrees");
    if (slots_ && slots_->length(static_cast<uint32_t>(s)) != n) {
      return broken("the slot state's length disagrees");
    }
    uint64_t live = 0, kv = 0;
    for (const StreamBlock& b : st.blocks()) {
      if (b.count == 0 || b.start + b.count > B) return broken("a block's live run is wrong");
      live += b.count;
      kv += format_.KvBytes(b.precision, b.count);
    }
    if (live != n) return broken("the blocks' live slots disagree with the positions");
    if (kv != format_.KvBytes(st.layout_slots(), st.quantized_slots(), st.quantized_blocks())) {
      return broken("the stream's KV byte tally disagrees with its blocks");
    }
    for (size_t j = 1; j < n; ++j) {
      if (st.positions()[j] <= st.positions()[j - 1]) return broken("positions do not increase");
    }
  }
  return absl::OkStatus();
}

uint32_t Sequence::max_stream_tokens() const {
  size_t n = 0;
  for (const Stream& s : streams_) n = std::max(n, s.size());
  return static_cast<uint32_t>(n);
}

uint64_t Sequence::retained_slots() const {
  uint64_t n = 0;
  for (const Stream& s : streams_) n += s.size();
  return n;
}

uint64_t Sequence::kv_bytes() const {
  uint64_t bytes = 0;
  for (const Stream& s : streams_) {
    bytes += format_.KvBytes(s.layout_slots(), s.quantized_slots(), s.quantized_blocks());
  }
  return bytes;
}

uint64_t Sequence::block_count() const {
  uint64_t n = 0;
  for (const Stream& s : streams_) n += s.blocks().size();
  return n;
}

uint64_t Sequence::block_bytes_held() const {
  uint64_t bytes = 0;
  for (const Stream& s : streams_) {
    for (const StreamBlock& b : s.blocks()) bytes += format_.block_bytes(b.precision);
  }
  return bytes;
}

}  // namespace kvmem::engine
