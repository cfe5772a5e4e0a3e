#pragma once
// How the client brings a kept BlockTable up to date from a daemon's TableUpdate; exposed
// for tests (the client applies updates itself, Client::Step and the other mutating calls).
#include <cstdint>

#include "kvmem/client.h"
#include "kvmem/v1/kvmem.pb.h"

namespace kvmem::client::internal {

// Applies `update` to `table` (the whole table, or a delta from exactly table->version of
// sequence `sequence_id`); false, with `table` unchanged, when it cannot apply: another
// sequence's or another version's, or a delta that does not check out against the table.
bool ApplyTableUpdate(uint64_t sequence_id, const v1::TableUpdate& update, BlockTable* table);

}  // namespace kvmem::client::internal
