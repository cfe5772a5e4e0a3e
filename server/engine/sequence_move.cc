#include "server/engine/sequence_move.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "server/common/mutex.h"
#include "server/engine/engine.h"
#include "server/engine/guard.h"
#include "server/engine/input_checks.h"
#include "server/engine/tenants.h"
#include "spdlog/spdlog.h"

namespace kvmem::engine {
namespace {

// The holder's answers are untrusted input: an error names what was wrong with them.
absl::Status Bad(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("MoveSequence: the holder's sequence ", what));
}

// Host bytes an imported sequence's state takes: the stream columns, block lists, token ids
// and scores, as the header says they will be.
uint64_t ImportHostBytes(const MovedHeader& h) {
  uint64_t slots = 0, blocks = 0;
  for (uint32_t n : h.stream_slots) slots += n;
  for (uint32_t n : h.stream_blocks) blocks += n;
  const uint64_t per_slot = sizeof(int64_t) + uint64_t{h.history_rows} * sizeof(float) +
                            (h.token_signals ? 2 * sizeof(float) : 0) +
                            (h.arrival_steps ? sizeof(int64_t) : 0) +
                            (h.scores ? sizeof(float) : 0);
  // A block: its StreamBlock, and its id as allocated before its piece came (Reserve).
  return sizeof(Sequence) + h.stream_slots.size() * sizeof(Stream) + slots * per_slot +
         blocks * (sizeof(StreamBlock) + sizeof(store::BlockId)) +
         h.token_ids.size() * sizeof(int32_t);
}

}  // namespace

void MovedExports::Add(uint64_t export_id, uint64_t sequence_id, std::string owner) {
  kvmem::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  while (!order_.empty() &&
         (order_.size() >= kMost || entries_.at(order_.front()).at + kKeep < now)) {
    entries_.erase(order_.front());
    order_.pop_front();
  }
  if (entries_.emplace(export_id, Entry{sequence_id, std::move(owner), now}).second) {
    order_.push_back(export_id);
  }
}

bool MovedExports::Moved(uint64_t export_id, uint64_t sequence_id, const std::string* owner) const {
  kvmem::MutexLock lock(&mu_);
  auto it = entries_.find(export_id);
  return it != entries_.end() && it->second.sequence_id == sequence_id &&
         it->second.at + kKeep >= absl::Now() && (owner == nullptr || *owner == it->second.owner);
}

// ---- the holder's side

absl::StatusOr<MovedHeader> Engine::BeginExport(uint64_t sequence_id, absl::Duration hold,
                                                std::vector<std::vector<float>>* scores) {
  return GuardHostMemory("ExportSequence", [&]() -> absl::StatusOr<MovedHeader> {
    absl::StatusOr<SequenceRef> ref = registry_.LockForChange(sequence_id);
    if (!ref.ok()) return ref.status();
    Sequence& seq = **ref;
    seq.mu.AssertHeld();
    MovedHeader h;
    h.layout = seq.layout();
    h.policy = seq.policy_name();
    h.params = seq.policy_params();
    h.quant = seq.quant();
    h.token_ids.assign(seq.token_ids().begin(), seq.token_ids().end());
    h.last_position = seq.last_position();
    h.appended = seq.appended();
    h.steps = seq.steps();
    h.policy_mark = seq.policy_mark();
    const Sequence::PrefixState& prefix = seq.prefix();
    h.salt = prefix.salt;
    h.model = prefix.model;
    h.auto_publish = prefix.auto_publish;
    h.compressed_document = prefix.compressed_document;
    h.compressions = prefix.compressions;
    h.mapped_prefix = prefix.mapped_prefix;
    h.history_rows = seq.policy().history_rows();
    h.token_signals = seq.policy().descriptor().append_signals != 0;
    h.arrival_steps = seq.policy().descriptor().arrival_steps;
    h.scores = seq.slots() != nullptr;
    for (const Stream& st : seq.streams()) {
      h.stream_slots.push_back(static_cast<uint32_t>(st.size()));
      h.stream_blocks.push_back(static_cast<uint32_t>(st.blocks().size()));
      for (const StreamBlock& b : st.blocks()) {
        h.block_bytes += seq.format().block_bytes(b.precision);
      }
    }
    scores->clear();
    if (seq.slots() != nullptr) {
      if (absl::Status s = seq.slots()->ReadScores(scores); !s.ok()) return s;
    }
    // Frozen from here: no change until FinishExport or the hold lapses. A lapsed export's
    // references go first.
    h.export_id = absl::Uniform<uint64_t>(absl::BitGen(), 1, std::numeric_limits<uint64_t>::max());
    pool_->Unref(seq.EndMoveExport());
    seq.mutable_move_export().id = h.export_id;
    seq.mutable_move_export().until_ns = absl::ToUnixNanos(registry_.Now() + hold);
    // Its lease outlasts the hold: the receiver's FinishExport must find it.
    seq.set_lease_floor_ns(seq.move_export().until_ns);
    registry_.Renew(seq);
    return h;
  });
}

absl::StatusOr<bool> Engine::ExportPiece(uint64_t sequence_id, uint64_t export_id,
                                         const std::vector<std::vector<float>>& scores,
                                         bool by_offset, ExportCursor* cursor, MovedPiece* piece) {
  return GuardHostMemory("ExportSequence", [&]() -> absl::StatusOr<bool> {
    absl::StatusOr<SequenceRef> ref = registry_.Lock(sequence_id);
    if (!ref.ok()) return ref.status();
    Sequence& seq = **ref;
    seq.mu.AssertHeld();
    if (seq.move_export().id != export_id || registry_.NotMoving(seq).ok()) {
      return absl::AbortedError(absl::StrCat("ExportSequence: the export of sequence ", sequence_id,
                                             " ended or its hold lapsed"));
    }
    while (cursor->stream < seq.num_streams() &&
           cursor->block >= seq.streams()[cursor->stream].blocks().size()) {
      ++cursor->stream;
      cursor->block = 0;
      cursor->slot = 0;
    }
    if (cursor->stream >= seq.num_streams()) return false;
    const Stream& st = seq.streams()[cursor->stream];
    const uint32_t R = seq.policy().history_rows();
    *piece = MovedPiece{};
    piece->stream = cursor->stream;
    size_t end = cursor->block;
    uint64_t bytes = 0, slots = 0;
    while (end < st.blocks().size()) {
      const uint64_t b = seq.format().block_bytes(st.blocks()[end].precision);
      if (end > cursor->block && bytes + b > kMovePieceBytes) break;
      bytes += b;
      slots += st.blocks()[end].count;
      ++end;
    }
    std::vector<store::ReadOp> reads;
    if (by_offset) {
      // Held until the export ends: a reader may get them after this call.
      std::vector<store::BlockId>& held = seq.mutable_move_export().held;
      held.reserve(held.size() + (end - cursor->block));
      piece->offsets.reserve(end - cursor->block);
    } else {
      piece->data.resize(bytes);
      reads.reserve(end - cursor->block);
    }
    uint64_t at = 0;
    for (size_t i = cursor->block; i < end; ++i) {
      const StreamBlock& b = st.blocks()[i];
      piece->blocks.push_back({b.start, b.count, b.precision});
      const uint64_t n = seq.format().block_bytes(b.precision);
      if (by_offset) {
        piece->offsets.push_back(pool_->offset(b.id));
      } else {
        reads.push_back({pool_->offset(b.id), piece->data.data() + at, n});
      }
      at += n;
    }
    if (by_offset) {
      std::vector<store::BlockId>& held = seq.mutable_move_export().held;
      for (size_t i = cursor->block; i < end; ++i) held.push_back(st.blocks()[i].id);
      pool_->Ref(absl::MakeConstSpan(held).subspan(held.size() - (end - cursor->block)));
    } else {
      if (absl::Status s = backend_->Read(reads); !s.ok()) return s;
      if (absl::Status s = backend_->Synchronize(); !s.ok()) return s;
    }
    const auto slice = [&](auto span, uint64_t width, auto* out) {
      const auto first = span.begin() + static_cast<ptrdiff_t>(cursor->slot * width);
      out->assign(first, first + static_cast<ptrdiff_t>(slots * width));
    };
    slice(st.positions(), 1, &piece->positions);
    slice(st.history(), R, &piece->history);
    if (st.token_signals()) {
      slice(st.token_entropy(), 1, &piece->token_entropy);
      slice(st.layer_distance(), 1, &piece->layer_distance);
    }
    if (st.arrival_steps()) slice(st.arrival_step(), 1, &piece->arrival_steps);
    if (!scores.empty()) {
      slice(absl::MakeConstSpan(scores.at(cursor->stream)), 1, &piece->scores);
    }
    cursor->block = end;
    cursor->slot += slots;
    registry_.Renew(seq);
    return true;
  });
}

absl::StatusOr<uint64_t> Engine::FinishExport(uint64_t sequence_id, uint64_t export_id,
                                              bool moved) {
  absl::StatusOr<SequenceRef> ref = registry_.Lock(sequence_id);
  if (!ref.ok()) return ref.status();
  Sequence& seq = **ref;
  seq.mu.AssertHeld();
  if (seq.move_export().id != export_id) {
    return absl::AbortedError(absl::StrCat("export_id: sequence ", sequence_id, " has no export ",
                                           export_id,
                                           " (it ended: abandoned, lapsed and changed, or "
                                           "superseded); the sequence stays here"));
  }
  if (!moved) {
    pool_->Unref(seq.EndMoveExport());
    registry_.Renew(seq);
    return uint64_t{0};
  }
  // Once the hold has lapsed the sequence may have changed since the receiver's copy: that
  // copy is not this sequence any more, and this one stays.
  if (registry_.NotMoving(seq).ok()) {
    pool_->Unref(seq.EndMoveExport());
    return absl::AbortedError(absl::StrCat("export_id: the hold of sequence ", sequence_id,
                                           "'s export lapsed before the move was committed"));
  }
  if (absl::StatusOr<std::shared_ptr<Sequence>> taken = registry_.Take(sequence_id); !taken.ok()) {
    return taken.status();
  }
  moved_exports_.Add(export_id, sequence_id, seq.owner());
  // Moved (the caller says the receiver committed: its reads are over): the export's
  // references go now.
  uint64_t freed = pool_->Unref(seq.EndMoveExport());
  return freed + ReleaseLocked(seq);
}

// ---- the receiver's side

absl::StatusOr<std::unique_ptr<SequenceImport>> Engine::BeginImport(MovedHeader header,
                                                                    const std::string& owner) {
  return GuardHostMemory("MoveSequence", [&]() -> absl::StatusOr<std::unique_ptr<SequenceImport>> {
    MovedHeader& h = header;
    if (absl::Status s = ValidateLayout(h.layout, pool_->page_bytes()); !s.ok()) {
      return Bad(absl::StrCat("has a layout this daemon refuses: ", s.message()));
    }
    absl::StatusOr<std::unique_ptr<policy::Policy>> policy =
        policy::CreatePolicy(h.policy, h.params);
    if (!policy.ok()) {
      return Bad(absl::StrCat("has a policy this daemon refuses: ", policy.status().message()));
    }
    const policy::PolicyDescriptor& d = (*policy)->descriptor();
    if (h.quant.recent_tokens > kMaxRecentTokens) return Bad("keeps too many recent tokens");
    const BlockFormat format(h.layout, h.quant.type);
    if (h.quant.type && format.block_bytes(format.quant_precision()) > pool_->page_bytes()) {
      return Bad("has quantized blocks larger than this pool's page");
    }
    if (h.history_rows != (*policy)->history_rows() || h.token_signals != (d.append_signals != 0) ||
        h.arrival_steps != d.arrival_steps || h.scores != d.initial_score.has_value()) {
      return Bad("keeps per-slot values its policy does not");
    }
    const size_t streams = h.layout.num_streams();
    if (h.stream_slots.size() != streams || h.stream_blocks.size() != streams) {
      return Bad(absl::StrCat("has ", h.stream_slots.size(), " streams, its layout ", streams));
    }
    if (h.token_ids.size() != h.appended || h.last_position < -1) {
      return Bad("has token ids, appended tokens or a last position that disagree");
    }
    for (int32_t t : h.token_ids) {
      if (t < -1 || (t >= 0 && static_cast<uint64_t>(t) >= h.layout.vocab_size)) {
        return Bad(absl::StrCat("has token id ", t, " outside its vocabulary"));
      }
    }
    if (h.salt.size() > kMaxSaltBytes || h.model.size() > kMaxSaltBytes) {
      return Bad(absl::StrCat("has a cache salt or model longer than ", kMaxSaltBytes, " bytes"));
    }
    for (size_t s = 0; s < streams; ++s) {
      const uint64_t slots = h.stream_slots[s], blocks = h.stream_blocks[s];
      if (slots > store::SlotBook::kMaxSlots || slots > h.appended || blocks > slots ||
          slots > blocks * h.layout.block_tokens) {
        return Bad(absl::StrCat("stream ", s, " has ", slots, " slots in ", blocks, " blocks"));
      }
    }
    const std::string tenant_key = owner.empty() ? h.salt : owner;
    std::shared_ptr<HostShare> share = budget_.ShareOf(tenant_key);
    absl::StatusOr<HostReservation> host =
        budget_.Reserve(ImportHostBytes(h), "MoveSequence", share);
    if (!host.ok()) return host.status();
    absl::StatusOr<store::TenantId> tenant = tenants_.Acquire(tenant_key);
    if (!tenant.ok()) return tenant.status();
    absl::Cleanup give_back_tenant = [this, &tenant_key] { tenants_.Release(tenant_key); };
    const ImportRooms rooms{pool_.get(), backend_.get(), &versions_, &tenants_, &telemetry_};
    auto import = std::unique_ptr<SequenceImport>(
        new SequenceImport(rooms, std::move(header), format, tenant_key, owner, *tenant,
                           *std::move(host), std::move(share)));
    std::move(give_back_tenant).Cancel();  // the import's now
    return import;
  });
}

SequenceImport::SequenceImport(const ImportRooms& rooms, MovedHeader header, BlockFormat format,
                               std::string tenant_key, std::string owner, store::TenantId tenant,
                               HostReservation host, std::shared_ptr<HostShare> share)
    : rooms_(rooms),
      header_(std::move(header)),
      format_(format),
      tenant_key_(std::move(tenant_key)),
      owner_(std::move(owner)),
      tenant_(tenant),
      host_(std::move(host)),
      share_(std::move(share)),
      streams_(header_.stream_slots.size()),
      host_pool_(rooms_.backend->host_pool()) {}

SequenceImport::~SequenceImport() {
  for (size_t s = 0; s < allocated_.size(); ++s) {  // the blocks no piece took
    const std::vector<store::BlockId>& ids = allocated_[s];
    const size_t taken = streams_[s].blocks.size();
    if (taken < ids.size()) rooms_.pool->Unref(absl::MakeConstSpan(ids).subspan(taken));
  }
  if (committed_) return;
  for (Staged& st : streams_) {
    for (const StreamBlock& b : st.blocks) rooms_.pool->Unref({b.id});
  }
  rooms_.tenants->Release(tenant_key_);
}

uint32_t SequenceImport::NextStream(uint32_t from) const {
  while (from < streams_.size() && streams_[from].blocks.size() >= header_.stream_blocks[from]) {
    ++from;
  }
  return from;
}

bool SequenceImport::complete() const { return NextStream(0) == streams_.size(); }

absl::Status SequenceImport::Check(const MovedPiece& p, bool landing) const {
  const uint32_t s = NextStream(stream_);
  if (s == streams_.size()) return Bad("sent a piece after its last stream");
  if (p.stream != s) {
    return Bad(absl::StrCat("sent a piece of stream ", p.stream, " where stream ", s, " was due"));
  }
  const Staged& st = streams_[s];
  if (p.blocks.empty() || st.blocks.size() + p.blocks.size() > header_.stream_blocks[s]) {
    return Bad(absl::StrCat("sent ", p.blocks.size(), " blocks of stream ", s, " past its ",
                            header_.stream_blocks[s]));
  }
  uint64_t slots = 0, bytes = 0;
  for (const MovedBlock& b : p.blocks) {
    const bool precision_ok = b.precision == Precision::kLayout ||
                              (format_.quantizes() && b.precision == format_.quant_precision());
    if (!precision_ok || b.count == 0 || b.start >= header_.layout.block_tokens ||
        b.count > header_.layout.block_tokens - b.start) {
      return Bad(absl::StrCat("has a block of stream ", s, " with slots [", b.start, ", +", b.count,
                              ") at ", PrecisionName(b.precision)));
    }
    slots += b.count;
    bytes += format_.block_bytes(b.precision);
  }
  if (st.positions.size() + slots > header_.stream_slots[s]) {
    return Bad(
        absl::StrCat("sent more slots of stream ", s, " than its ", header_.stream_slots[s]));
  }
  const bool last = st.blocks.size() + p.blocks.size() == header_.stream_blocks[s];
  if (last && st.positions.size() + slots != header_.stream_slots[s]) {
    return Bad(
        absl::StrCat("sent fewer slots of stream ", s, " than its ", header_.stream_slots[s]));
  }
  const auto want = [&](size_t got, uint64_t n, absl::string_view what) {
    return got == n ? absl::OkStatus()
                    : Bad(absl::StrCat("sent ", got, " ", what, " for ", slots, " slots of stream ",
                                       s, " (", n, " due)"));
  };
  if (absl::Status e = want(p.positions.size(), slots, "positions"); !e.ok()) return e;
  if (absl::Status e = want(p.history.size(), slots * header_.history_rows, "history values");
      !e.ok()) {
    return e;
  }
  const uint64_t signals = header_.token_signals ? slots : 0;
  if (absl::Status e = want(p.token_entropy.size(), signals, "entropies"); !e.ok()) return e;
  if (absl::Status e = want(p.layer_distance.size(), signals, "layer distances"); !e.ok()) return e;
  if (absl::Status e =
          want(p.arrival_steps.size(), header_.arrival_steps ? slots : 0, "arrival steps");
      !e.ok()) {
    return e;
  }
  if (absl::Status e = want(p.scores.size(), header_.scores ? slots : 0, "scores"); !e.ok()) {
    return e;
  }
  if (p.data.size() != (landing ? 0 : bytes)) {
    return Bad(absl::StrCat("sent ", p.data.size(), " bytes for blocks of ", bytes));
  }
  if (bytes_ + bytes > header_.block_bytes) {
    return Bad(absl::StrCat("sent more block bytes than its header's ", header_.block_bytes));
  }
  // Values as the engine's own inputs hold them: attention history finite in [0,
  // kMaxAttention] (input_checks.h), scores finite or NaN (not scored yet), arrival steps
  // within its steps.
  for (float x : p.history) {
    if (!(x >= 0.0f && x <= kMaxAttention)) {
      return Bad(absl::StrCat("has stream ", s, " history value ", x));
    }
  }
  for (float x : p.scores) {
    if (std::isinf(x)) return Bad(absl::StrCat("has stream ", s, " score ", x));
  }
  for (int64_t a : p.arrival_steps) {
    if (a < 0 || static_cast<uint64_t>(a) > header_.steps) {
      return Bad(absl::StrCat("has stream ", s, " arrival step ", a, " past its ", header_.steps,
                              " steps"));
    }
  }
  // Positions increase within a stream and lie within what was appended.
  int64_t prev = st.positions.empty() ? -1 : st.positions.back();
  for (int64_t pos : p.positions) {
    if (pos <= prev || pos > header_.last_position) {
      return Bad(absl::StrCat("has stream ", s, " positions out of order or past ",
                              header_.last_position));
    }
    prev = pos;
  }
  return absl::OkStatus();
}

absl::Status SequenceImport::Allocate(const MovedPiece& p, std::vector<store::BlockId>* ids) {
  absl::Cleanup free_ids = [&] {
    rooms_.pool->Unref(*ids);
    ids->clear();
  };
  ids->reserve(p.blocks.size());
  std::vector<store::BlockId> run;
  for (size_t i = 0; i < p.blocks.size();) {
    size_t end = i + 1;
    while (end < p.blocks.size() && p.blocks[end].precision == p.blocks[i].precision) ++end;
    const uint64_t n = format_.block_bytes(p.blocks[i].precision);
    run.clear();
    if (absl::Status e = rooms_.pool->AllocateMany(static_cast<uint32_t>(n), end - i, &run,
                                                   store::BlockPool::Use::kGrow, tenant_);
        !e.ok()) {
      return e;
    }
    ids->insert(ids->end(), run.begin(), run.end());  // reserved: cannot throw
    i = end;
  }
  std::move(free_ids).Cancel();
  return absl::OkStatus();
}

void SequenceImport::Take(const MovedPiece& p, const std::vector<store::BlockId>& ids) {
  const uint32_t s = NextStream(stream_);
  Staged& st = streams_[s];
  const auto each_value = [&](const auto& op) {
    op(st.positions, p.positions);
    op(st.history, p.history);
    op(st.token_entropy, p.token_entropy);
    op(st.layer_distance, p.layer_distance);
    op(st.arrival_steps, p.arrival_steps);
    op(st.scores, p.scores);
  };
  // Room first: from the first value on, nothing may throw.
  st.blocks.reserve(st.blocks.size() + p.blocks.size());
  each_value([](auto& to, const auto& from) { to.reserve(to.size() + from.size()); });
  each_value([](auto& to, const auto& from) { to.insert(to.end(), from.begin(), from.end()); });
  uint64_t bytes = 0;
  for (size_t i = 0; i < p.blocks.size(); ++i) {
    StreamBlock b;
    b.id = ids[i];
    b.start = p.blocks[i].start;
    b.count = p.blocks[i].count;
    b.precision = p.blocks[i].precision;
    st.blocks.push_back(b);
    bytes += format_.block_bytes(b.precision);
  }
  stream_ = s;
  block_count_ += p.blocks.size();
  bytes_ += bytes;
}

absl::Status SequenceImport::Add(const MovedPiece& p) {
  return GuardHostMemory("MoveSequence", [&]() -> absl::Status {
    if (!allocated_.empty()) return Bad("sent a piece's bytes after pieces by offsets");
    if (absl::Status s = Check(p, /*landing=*/false); !s.ok()) return s;
    // The piece's blocks: allocated (charged to the tenant), written, then the stream's.
    std::vector<store::BlockId> ids;
    absl::Cleanup free_ids = [&] { rooms_.pool->Unref(ids); };
    if (absl::Status e = Allocate(p, &ids); !e.ok()) return e;
    std::vector<store::WriteOp> writes;
    writes.reserve(p.blocks.size());
    uint64_t at = 0;
    for (size_t i = 0; i < p.blocks.size(); ++i) {
      const uint64_t n = format_.block_bytes(p.blocks[i].precision);
      writes.push_back({p.data.data() + at, rooms_.pool->offset(ids[i]), n});
      at += n;
    }
    if (absl::Status e = rooms_.backend->Write(writes); !e.ok()) return e;
    if (absl::Status e = rooms_.backend->Synchronize(); !e.ok()) return e;
    Take(p, ids);
    std::move(free_ids).Cancel();  // the import's now
    return absl::OkStatus();
  });
}

absl::StatusOr<std::vector<uint8_t*>> SequenceImport::Reserve(const MovedPiece& p) {
  return GuardHostMemory("MoveSequence", [&]() -> absl::StatusOr<std::vector<uint8_t*>> {
    if (!lands_in_place()) {
      return absl::FailedPreconditionError("MoveSequence: this pool is not host memory");
    }
    if (absl::Status s = Check(p, /*landing=*/true); !s.ok()) return s;
    const uint64_t layout_bytes = format_.block_bytes(Precision::kLayout);
    uint64_t total = 0;
    for (uint32_t n : header_.stream_blocks) total += n;
    if (block_count_ == 0 && allocated_.empty() && header_.block_bytes == total * layout_bytes) {
      // Every block at the layout's precision: all of them now, block index by block index.
      std::vector<store::BlockId> ids;
      if (absl::Status e = rooms_.pool->AllocateMany(static_cast<uint32_t>(layout_bytes), total,
                                                     &ids, store::BlockPool::Use::kGrow, tenant_);
          !e.ok()) {
        return e;
      }
      absl::Cleanup free_ids = [&] { rooms_.pool->Unref(ids); };
      std::vector<std::vector<store::BlockId>> allocated(streams_.size());
      for (size_t s = 0; s < allocated.size(); ++s) allocated[s].reserve(header_.stream_blocks[s]);
      size_t next = 0;
      for (uint32_t b = 0; next < ids.size(); ++b) {
        for (size_t s = 0; s < allocated.size(); ++s) {
          if (b < header_.stream_blocks[s]) allocated[s].push_back(ids[next++]);
        }
      }
      std::move(free_ids).Cancel();
      allocated_ = std::move(allocated);
    }
    const size_t first = streams_[p.stream].blocks.size();
    std::vector<store::BlockId> ids;
    absl::Cleanup free_ids = [&] {
      if (allocated_.empty()) rooms_.pool->Unref(ids);
    };
    if (!allocated_.empty()) {
      for (size_t i = 0; i < p.blocks.size(); ++i) {
        if (p.blocks[i].precision != Precision::kLayout) {
          return Bad("sent a block at a precision its header's bytes leave no room for");
        }
      }
      const std::vector<store::BlockId>& mine = allocated_[p.stream];
      ids.assign(mine.begin() + static_cast<ptrdiff_t>(first),
                 mine.begin() + static_cast<ptrdiff_t>(first + p.blocks.size()));
    } else if (absl::Status e = Allocate(p, &ids); !e.ok()) {
      return e;
    }
    std::vector<uint8_t*> at(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) at[i] = host_pool_ + rooms_.pool->offset(ids[i]);
    Take(p, ids);
    std::move(free_ids).Cancel();  // the import's now
    ++unlanded_;
    return at;
  });
}

void SequenceImport::Landed(uint64_t pieces) {
  assert(pieces <= unlanded_);
  unlanded_ -= std::min(pieces, unlanded_);
}

void SequenceImport::Forsake() {
  uint64_t kept = 0, bytes = 0;
  for (size_t s = 0; s < streams_.size(); ++s) {
    // A stream's blocks: the preallocated ones (taken or not), else those its pieces took.
    if (s < allocated_.size() && allocated_[s].size() >= streams_[s].blocks.size()) {
      for (store::BlockId id : allocated_[s]) bytes += rooms_.pool->block_bytes(id);
      kept += allocated_[s].size();
    } else {
      for (const StreamBlock& b : streams_[s].blocks) bytes += rooms_.pool->block_bytes(b.id);
      kept += streams_[s].blocks.size();
    }
    streams_[s].blocks.clear();
  }
  rooms_.telemetry->blocks_forsaken += kept;
  rooms_.telemetry->bytes_forsaken += bytes;
  allocated_.clear();
  forsaken_ = true;
  spdlog::error(
      "MoveSequence: {} blocks kept out of circulation for good (a get was abandoned in flight)",
      kept);
}

absl::StatusOr<CreateResult> Engine::CommitImport(SequenceImport& import, absl::Duration lease) {
  return GuardHostMemory("MoveSequence", [&]() -> absl::StatusOr<CreateResult> {
    if (import.committed_) return absl::FailedPreconditionError("MoveSequence: committed already");
    if (import.forsaken_) return absl::AbortedError("MoveSequence: its blocks were forsaken");
    if (!import.complete()) return Bad("ended before all its streams came");
    if (import.unlanded_ != 0) {
      return absl::FailedPreconditionError("MoveSequence: committed before its blocks landed");
    }
    const MovedHeader& h = import.header_;
    if (import.bytes_ != h.block_bytes) {
      return Bad(absl::StrCat("sent ", import.bytes_, " block bytes, its header ", h.block_bytes));
    }
    absl::StatusOr<absl::Duration> granted = registry_.ResolveLease(lease);
    if (!granted.ok()) return granted.status();
    absl::StatusOr<std::unique_ptr<policy::Policy>> policy =
        policy::CreatePolicy(h.policy, h.params);
    if (!policy.ok()) return policy.status();
    const bool device_step = config_.device_step && (*policy)->has_kernel_step();
    const uint32_t streams = h.layout.num_streams();
    // The scores' home: every stream's positions, then each stream's own kept, then scored.
    std::unique_ptr<store::SlotState> slots;
    HostReservation device;
    if (h.scores) {
      if (device_step) {
        absl::StatusOr<std::unique_ptr<store::SlotState>> created =
            backend_->CreateSlotState(streams);
        if (!created.ok()) return created.status();
        slots = *std::move(created);
      } else {
        slots = store::MakeHostScoreState(streams);
      }
      std::vector<int64_t> all;
      for (const SequenceImport::Staged& st : import.streams_) {
        std::vector<int64_t> merged;
        merged.reserve(all.size() + st.positions.size());
        std::set_union(all.begin(), all.end(), st.positions.begin(), st.positions.end(),
                       std::back_inserter(merged));
        all.swap(merged);
      }
      // A slot state in device memory: what it grows to, from the device budget (held
      // until the sequence is accounted below).
      absl::StatusOr<HostReservation> reserved = budget_.ReserveDevice(
          slots->in_device_memory() ? slots->AppendGrowth(static_cast<uint32_t>(all.size())) : 0,
          "MoveSequence", import.share_);
      if (!reserved.ok()) return reserved.status();
      device = *std::move(reserved);
      if (!all.empty()) {
        if (absl::Status s = slots->Append(all, 0.0f); !s.ok()) return s;
        store::KeepSets keep(streams);
        for (uint32_t s = 0; s < streams; ++s) {
          const std::vector<int64_t>& mine = import.streams_[s].positions;
          KeepSet set;
          size_t j = 0;
          for (size_t i = 0; i < all.size() && j < mine.size(); ++i) {
            if (all[i] == mine[j]) {
              set.Add(static_cast<uint32_t>(i));
              ++j;
            }
          }
          keep[s] = std::move(set);
        }
        if (absl::Status s = slots->Keep(keep); !s.ok()) return s;
        std::vector<std::vector<float>> scores(streams);
        for (uint32_t s = 0; s < streams; ++s) scores[s] = import.streams_[s].scores;
        if (absl::Status s = slots->WriteScores(scores); !s.ok()) return s;
      }
    }
    absl::StatusOr<TableVersions::Claimed> claimed = versions_.ClaimSlot();
    if (!claimed.ok()) return claimed.status();
    absl::Cleanup give_back_slot = [this, &claimed] { versions_.ReturnSlot(claimed->slot); };
    const uint64_t id = registry_.NewId();
    std::string name((*policy)->descriptor().name);
    auto seq = std::make_shared<Sequence>(id, h.layout, std::move(name), h.params,
                                          *std::move(policy), h.quant, *granted, claimed->slot,
                                          /*parent_id=*/0, import.tenant_, import.owner_);
    seq->set_host_share(import.share_);
    {
      kvmem::MutexLock lock(&seq->mu);
      seq->set_epoch(claimed->epoch);
      const uint64_t version = versions_.NewVersion(*seq);
      for (uint32_t s = 0; s < streams; ++s) {
        SequenceImport::Staged& st = import.streams_[s];
        seq->stream(s).LoadMoved(st.blocks, version, std::move(st.positions), std::move(st.history),
                                 std::move(st.token_entropy), std::move(st.layer_distance),
                                 std::move(st.arrival_steps));
      }
      seq->set_slots(std::move(slots), device_step);
      seq->AdoptMoved(h.token_ids, h.last_position, h.appended, h.steps, h.policy_mark);
      Sequence::PrefixState& prefix = seq->mutable_prefix();
      prefix.ns = PrefixPublisher::Namespace(h.layout, h.model);
      prefix.model = h.model;
      prefix.salt = h.salt;
      prefix.auto_publish = h.auto_publish;
      prefix.compressed_document = h.compressed_document;
      prefix.compressions = h.compressions;
      prefix.mapped_prefix = h.mapped_prefix;
      if (absl::Status s = seq->CheckInvariants(); !s.ok()) {
        // The blocks stay the import's (it frees them); the sequence never was.
        for (uint32_t s2 = 0; s2 < streams; ++s2) seq->stream(s2).Clear();
        return Bad(absl::StrCat("does not hold together: ", s.message()));
      }
      seq->Publish();
      budget_.Account(*seq);
    }
    std::move(give_back_slot).Cancel();
    import.committed_ = true;   // the sequence holds the blocks and the tenant now
    import.allocated_.clear();  // every one taken (complete): the sequence's
    return Register(seq);
  });
}

}  // namespace kvmem::engine
