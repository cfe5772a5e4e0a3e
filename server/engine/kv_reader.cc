#include "server/engine/kv_reader.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/block_layout.h"
#include "server/engine/table_versions.h"

namespace kvmem::engine {

absl::Status KvReader::Read(uint64_t sequence_id, uint64_t epoch, uint32_t layer_begin,
                            uint32_t layer_end, const std::function<absl::Status(StreamKV&&)>& sink,
                            uint64_t piece_bytes) {
  Layout layout;
  {
    absl::StatusOr<SequenceRef> found = registry_->Find(sequence_id);
    if (!found.ok()) return found.status();
    layout = (*found)->layout();  // fixed for the sequence's life
  }
  if (layer_begin == 0 && layer_end == 0) layer_end = layout.num_layers;
  if (layer_end > layout.num_layers || layer_begin >= layer_end) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer_begin/layer_end: [", layer_begin, ", ", layer_end,
                     ") is not a non-empty range within [0, ", layout.num_layers, ")"));
  }
  const uint64_t row = layout.row_bytes();
  const uint32_t B = layout.block_tokens;
  // Slots per piece: a slot is 2 rows (K and V) and a position (at most 10 bytes packed).
  const uint64_t piece_slots =
      piece_bytes == 0 ? ~uint64_t{0} : std::max<uint64_t>(1, piece_bytes / (2 * row + 10));
  uint64_t read_epoch = epoch;
  uint64_t read_version = 0;  // the table's version at the first piece: every piece's
  bool first_piece = true;
  for (uint32_t layer = layer_begin; layer < layer_end; ++layer) {
    for (uint32_t head = 0; head < layout.num_kv_heads; ++head) {
      // Where the next piece's blocks begin: the table stays as it was for the whole read
      // (checked at each piece), so each piece walks only its own blocks.
      size_t next_block = 0;
      uint64_t next_block_slot = 0;  // the stream's slot index at that block's first slot
      // Pieces of the stream until its last slot (a stream with no slot gives one, empty).
      for (uint64_t first = 0, slots = 1; first < slots; first += piece_slots) {
        StreamKV out;
        {
          // Found anew for each piece: a reader that stops taking pieces (a client that
          // does not read) holds no call on the sequence, whose lease can then lapse.
          absl::StatusOr<SequenceRef> found = registry_->Find(sequence_id);
          if (!found.ok()) return found.status();
          Sequence& seq = **found;
          kvmem::MutexLock lock(&seq.mu);
          if (absl::Status s = SequenceRegistry::Unusable(seq); !s.ok()) return s;
          if (read_epoch == 0) read_epoch = seq.epoch();
          if (first_piece) read_version = seq.version();
          if (seq.epoch() == read_epoch && seq.version() != read_version) {
            // An append grows the streams within an epoch: the pieces read so far and the
            // ones to come would hold different tokens.
            return TableVersions::StaleEpoch(
                seq,
                absl::StrCat("ReadKV: the block table changed from version ", read_version, " to ",
                             seq.version(), " during the read; read again"),
                absl::StatusCode::kAborted);
          }
          if (seq.epoch() != read_epoch) {
            if (first_piece) {
              return TableVersions::StaleEpoch(
                  seq, absl::StrCat("epoch: asked for epoch ", read_epoch,
                                    " but the block table is at epoch ", seq.epoch()));
            }
            return TableVersions::StaleEpoch(
                seq,
                absl::StrCat("epoch: the block table changed from epoch ", read_epoch, " to ",
                             seq.epoch(), " during the read; read again"),
                absl::StatusCode::kAborted);
          }
          const Stream& st = seq.streams()[size_t{layer} * layout.num_kv_heads + head];
          slots = std::max<uint64_t>(st.size(), 1);
          const uint64_t end = std::min<uint64_t>(st.size(), first + piece_slots);
          const uint64_t n = end > first ? end - first : 0;
          out.layer = layer;
          out.kv_head = head;
          out.epoch = seq.epoch();
          out.first_slot = first;
          out.positions.assign(st.positions().begin() + static_cast<ptrdiff_t>(first),
                               st.positions().begin() + static_cast<ptrdiff_t>(first + n));
          out.k.resize(n * row);
          out.v.resize(n * row);
          std::vector<store::ReadOp> reads;
          std::vector<store::DequantizeOp> dequantizes;
          uint64_t at = next_block_slot;  // the stream's slot index at the block's first slot
          for (size_t i = next_block; i < st.blocks().size(); ++i) {
            const StreamBlock& b = st.blocks()[i];
            // The block's slots [at, at + count) that fall in the piece [first, end).
            const uint64_t from = std::max(at, first), to = std::min(at + b.count, end);
            if (from < to) {
              const uint32_t start = b.start + static_cast<uint32_t>(from - at);
              const uint32_t count = static_cast<uint32_t>(to - from);
              char* k = out.k.data() + (from - first) * row;
              char* v = out.v.data() + (from - first) * row;
              const uint64_t off = pool_->offset(b.id);
              if (b.precision == Precision::kLayout) {
                const kernels::LayoutBlock plane{B, row};
                reads.push_back({off + plane.k_offset(start), k, count * row});
                reads.push_back({off + plane.v_offset(start), v, count * row});
              } else {
                dequantizes.push_back({off, start, count, k, v});
              }
            }
            if (at + b.count > end) {  // the next piece begins inside this block
              next_block = i;
              next_block_slot = at;
              break;
            }
            at += b.count;
            next_block = i + 1;
            next_block_slot = at;
          }
          absl::Status io = backend_->Read(reads);
          if (io.ok() && !dequantizes.empty()) {
            io = backend_->Dequantize(seq.format().quant_geometry(), seq.format().elem(),
                                      dequantizes);
          }
          if (io.ok()) io = backend_->Synchronize();
          if (!io.ok()) return io;
          registry_->Renew(seq);
        }
        first_piece = false;
        if (absl::Status s = sink(std::move(out)); !s.ok()) return s;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvmem::engine
