#include "kvmem/table_update.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "kvmem/convert.h"

namespace kvmem::client::internal {

// Brings `table` to the update's version. A delta applies only to the version it was made
// from; false when it cannot apply (the table moved meanwhile: a concurrent call on the
// same sequence answered first), and the table is left as it was.
bool ApplyTableUpdate(uint64_t sequence_id, const v1::TableUpdate& update, BlockTable* table) {
  if (update.has_table()) {
    if (update.table().sequence_id() != sequence_id) return false;
    *table = FromProto(update.table());
    return true;
  }
  if (!update.has_delta()) return false;
  const v1::TableDelta& d = update.delta();
  // Versions are unique to a sequence's history only: a table of another sequence (or one
  // that moved meanwhile) takes no delta.
  if (table->sequence_id != sequence_id || d.base_version() != table->version) return false;
  const int listed = d.stream_size(), runs = d.kept_at_size(), given = d.block_ids_size();
  if (d.block_count_size() != listed || d.run_count_size() != listed ||
      d.kept_from_size() != runs || d.kept_count_size() != runs ||
      d.block_offsets_size() != given || d.block_precisions_size() != given ||
      d.block_starts_size() != given || d.block_counts_size() != given) {
    return false;
  }
  // Checked whole before anything applies: streams ascending, each named once; each
  // stream's kept runs lie inside both lists, in order in both, and with its given entries
  // (and their positions) fill its new list exactly; the columns hold nothing more.
  struct Listed {
    int run = 0, given = 0;  // the stream's first run and given entry in the columns
    int position = 0;        // its given entries' first position
    bool in_place = false;   // every kept run stays at its index
  };
  std::vector<Listed> where(static_cast<size_t>(listed));
  int run = 0, entry = 0;
  uint64_t position = 0;
  for (int i = 0; i < listed; ++i) {
    const uint32_t s = d.stream(i);
    if (s >= table->streams.size() || (i > 0 && s <= d.stream(i - 1))) return false;
    const StreamTable& st = table->streams[s];
    if (d.run_count(i) > static_cast<uint32_t>(runs - run)) return false;
    Listed& w = where[static_cast<size_t>(i)];
    w = {run, entry, static_cast<int>(position), !table->positions};
    const int end = run + static_cast<int>(d.run_count(i));
    uint64_t at = 0, from = 0, kept = 0;
    for (; run < end; ++run) {
      if (d.kept_at(run) < at || d.kept_from(run) < from ||
          uint64_t{d.kept_from(run)} + d.kept_count(run) > st.blocks.size()) {
        return false;
      }
      at = uint64_t{d.kept_at(run)} + d.kept_count(run);
      from = uint64_t{d.kept_from(run)} + d.kept_count(run);
      kept += d.kept_count(run);
      w.in_place = w.in_place && d.kept_at(run) == d.kept_from(run);
    }
    if (at > d.block_count(i) || kept > d.block_count(i) ||
        d.block_count(i) - kept > static_cast<uint64_t>(given - entry)) {
      return false;
    }
    const int entries_end = entry + static_cast<int>(d.block_count(i) - kept);
    for (; entry < entries_end; ++entry) position += d.block_counts(entry);
    if (table->positions) {
      uint64_t held_slots = 0;
      for (const TableBlock& b : st.blocks) held_slots += b.count;
      if (held_slots != st.positions.size() ||
          position > static_cast<uint64_t>(d.positions_size())) {
        return false;
      }
    }
  }
  if (run != runs || entry != given ||
      (table->positions && position != static_cast<uint64_t>(d.positions_size()))) {
    return false;
  }
  const auto given_entry = [&d](int g) {
    return TableBlock{d.block_ids(g), d.block_offsets(g), d.block_starts(g), d.block_counts(g),
                      static_cast<Precision>(d.block_precisions(g))};
  };
  // Every new list is built before any is installed: an allocation failure leaves the
  // table as it was. A list whose kept entries all stay at their index (an append's new
  // tail, a window's changed first block) is not built but changed in place, into room
  // reserved here: a decode step then costs what changed, not the whole list (90 streams of
  // 500 entries at 8,000 tokens).
  std::vector<std::pair<std::vector<TableBlock>, std::vector<int64_t>>> built(
      static_cast<size_t>(listed));
  for (int i = 0; i < listed; ++i) {
    const Listed& w = where[static_cast<size_t>(i)];
    const StreamTable& st = table->streams[d.stream(i)];
    const int run_end = w.run + static_cast<int>(d.run_count(i));
    if (w.in_place) {
      std::vector<TableBlock>& blocks = table->streams[d.stream(i)].blocks;
      if (d.block_count(i) > blocks.capacity()) {  // contents unchanged; growth amortized
        blocks.reserve(std::max<size_t>(d.block_count(i), 2 * blocks.capacity()));
      }
      continue;
    }
    // Where each held block's positions start, when positions are kept.
    std::vector<size_t> first_slot;
    if (table->positions) {
      first_slot.reserve(st.blocks.size() + 1);
      first_slot.push_back(0);
      for (const TableBlock& b : st.blocks) first_slot.push_back(first_slot.back() + b.count);
    }
    std::vector<TableBlock>& blocks = built[static_cast<size_t>(i)].first;
    std::vector<int64_t>& positions = built[static_cast<size_t>(i)].second;
    blocks.reserve(d.block_count(i));
    int r = w.run, g = w.given, slot = w.position;
    while (blocks.size() < d.block_count(i)) {
      if (r < run_end && d.kept_at(r) == blocks.size()) {
        const uint32_t from = d.kept_from(r), count = d.kept_count(r);
        blocks.insert(blocks.end(), st.blocks.begin() + from, st.blocks.begin() + from + count);
        if (table->positions) {
          positions.insert(positions.end(),
                           st.positions.begin() + static_cast<ptrdiff_t>(first_slot[from]),
                           st.positions.begin() + static_cast<ptrdiff_t>(first_slot[from + count]));
        }
        ++r;
        continue;
      }
      blocks.push_back(given_entry(g));
      if (table->positions) {
        positions.insert(positions.end(), d.positions().begin() + slot,
                         d.positions().begin() + slot + d.block_counts(g));
        slot += static_cast<int>(d.block_counts(g));
      }
      ++g;
    }
  }
  for (int i = 0; i < listed; ++i) {  // nothing here allocates
    const Listed& w = where[static_cast<size_t>(i)];
    StreamTable& st = table->streams[d.stream(i)];
    if (!w.in_place) {
      st.blocks = std::move(built[static_cast<size_t>(i)].first);
      if (table->positions) st.positions = std::move(built[static_cast<size_t>(i)].second);
      continue;
    }
    // Kept runs stay where they are; the given entries fill the indices between them.
    st.blocks.resize(d.block_count(i));
    const int run_end = w.run + static_cast<int>(d.run_count(i));
    size_t at = 0;
    int g = w.given;
    for (int r = w.run; r <= run_end; ++r) {
      const size_t run_at = r < run_end ? d.kept_at(r) : st.blocks.size();
      for (; at < run_at; ++at, ++g) st.blocks[at] = given_entry(g);
      if (r < run_end) at = run_at + d.kept_count(r);
    }
  }
  table->version = d.version();
  table->epoch = d.epoch();
  return true;
}

}  // namespace kvmem::client::internal
