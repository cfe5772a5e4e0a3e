// KvEventPublisher::Encode: a batch's msgpack as vLLM's subscribers decode it, in both
// forms and both hash forms, read back with msgpack-cxx's own unpacker.
#include "server/service/kv_events.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "msgpack.hpp"

namespace kvmem::service {
namespace {

using Event = KvEventPublisher::Event;

prefix::BlockHash Hash(uint8_t seed) {
  prefix::BlockHash h;
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint8_t>(seed + i);
  return h;
}

// The digest's last 8 bytes, big-endian (vLLM's int form).
uint64_t AsInt(const prefix::BlockHash& h) {
  uint64_t v = 0;
  for (size_t i = h.size() - 8; i < h.size(); ++i) v = (v << 8) | h[i];
  return v;
}

std::vector<Event> Events() {
  std::vector<Event> events(4);
  events[1].kind = Event::Kind::kStored;  // a chain's first block, salted
  events[1].hash = Hash(1);
  events[1].tokens = {5, 6, 7, 8};
  events[1].salt = "tenant:alice/s";
  events[2].kind = Event::Kind::kStored;  // its child
  events[2].hash = Hash(2);
  events[2].parent = Hash(1);
  events[2].tokens = {9, 10, 11, 12};
  events[3].kind = Event::Kind::kRemoved;
  events[3].hash = Hash(1);
  return events;  // events[0]: AllBlocksCleared
}

const msgpack::object& At(const msgpack::object& array, size_t i) {
  EXPECT_EQ(array.type, msgpack::type::ARRAY);
  EXPECT_LT(i, array.via.array.size);
  return array.via.array.ptr[i];
}

// The map's value under `key` (null when absent).
const msgpack::object* Find(const msgpack::object& map, const std::string& key) {
  EXPECT_EQ(map.type, msgpack::type::MAP);
  for (uint32_t i = 0; i < map.via.map.size; ++i) {
    if (map.via.map.ptr[i].key.as<std::string>() == key) return &map.via.map.ptr[i].val;
  }
  return nullptr;
}

TEST(KvEventsEncodeTest, ThePositionalFormIsVllmsArrayLikeStructs) {
  const std::string bytes = KvEventPublisher::Encode(12.5, Events(), /*map_form=*/false,
                                                     /*int_hashes=*/true, "CPU");
  msgpack::object_handle handle = msgpack::unpack(bytes.data(), bytes.size());
  const msgpack::object& batch = handle.get();
  ASSERT_EQ(batch.via.array.size, 3u);  // [ts, events, data-parallel rank]
  EXPECT_EQ(At(batch, 0).as<double>(), 12.5);
  EXPECT_EQ(At(batch, 2).type, msgpack::type::NIL);
  const msgpack::object& events = At(batch, 1);
  ASSERT_EQ(events.via.array.size, 4u);

  const msgpack::object& cleared = At(events, 0);
  ASSERT_EQ(cleared.via.array.size, 1u);
  EXPECT_EQ(At(cleared, 0).as<std::string>(), "AllBlocksCleared");

  const msgpack::object& first = At(events, 1);
  ASSERT_EQ(first.via.array.size, 9u);  // extra_keys present: it has a salt
  EXPECT_EQ(At(first, 0).as<std::string>(), "BlockStored");
  EXPECT_EQ(At(At(first, 1), 0).as<uint64_t>(), AsInt(Hash(1)));
  EXPECT_EQ(At(first, 2).type, msgpack::type::NIL);  // no parent: the chain's first block
  EXPECT_EQ(At(first, 3).as<std::vector<int32_t>>(), (std::vector<int32_t>{5, 6, 7, 8}));
  EXPECT_EQ(At(first, 4).as<uint32_t>(), 4u);        // block_size
  EXPECT_EQ(At(first, 5).type, msgpack::type::NIL);  // lora_id
  EXPECT_EQ(At(first, 6).as<std::string>(), "CPU");  // medium
  EXPECT_EQ(At(first, 7).type, msgpack::type::NIL);  // lora_name
  EXPECT_EQ(At(At(At(first, 8), 0), 0).as<std::string>(), "tenant:alice/s");

  const msgpack::object& child = At(events, 2);
  ASSERT_EQ(child.via.array.size, 8u);  // no extra keys: omitted, as vLLM omits its default
  EXPECT_EQ(At(child, 2).as<uint64_t>(), AsInt(Hash(1)));

  const msgpack::object& removed = At(events, 3);
  ASSERT_EQ(removed.via.array.size, 3u);
  EXPECT_EQ(At(removed, 0).as<std::string>(), "BlockRemoved");
  EXPECT_EQ(At(At(removed, 1), 0).as<uint64_t>(), AsInt(Hash(1)));
  EXPECT_EQ(At(removed, 2).as<std::string>(), "CPU");
}

TEST(KvEventsEncodeTest, TheMapFormNamesEveryFieldAndCarriesWholeDigests) {
  const std::string bytes = KvEventPublisher::Encode(1.0, Events(), /*map_form=*/true,
                                                     /*int_hashes=*/false, "GPU");
  msgpack::object_handle handle = msgpack::unpack(bytes.data(), bytes.size());
  const msgpack::object& batch = handle.get();
  ASSERT_EQ(batch.via.map.size, 2u);  // ts, events (data_parallel_rank: its default, omitted)
  ASSERT_NE(Find(batch, "ts"), nullptr);
  const msgpack::object* events = Find(batch, "events");
  ASSERT_NE(events, nullptr);
  ASSERT_EQ(events->via.array.size, 4u);
  EXPECT_EQ(Find(At(*events, 0), "type")->as<std::string>(), "AllBlocksCleared");
  const msgpack::object& child = At(*events, 2);
  EXPECT_EQ(Find(child, "type")->as<std::string>(), "BlockStored");
  const msgpack::object& parent = *Find(child, "parent_block_hash");
  ASSERT_EQ(parent.type, msgpack::type::BIN);
  const prefix::BlockHash one = Hash(1);
  EXPECT_EQ(std::string(parent.via.bin.ptr, parent.via.bin.size),
            std::string(reinterpret_cast<const char*>(one.data()), one.size()));
  EXPECT_EQ(Find(child, "medium")->as<std::string>(), "GPU");
  EXPECT_EQ(Find(child, "extra_keys"), nullptr);
  EXPECT_NE(Find(At(*events, 1), "extra_keys"), nullptr);
  for (const char* field : {"block_hashes", "token_ids", "block_size", "lora_id", "lora_name"}) {
    EXPECT_NE(Find(child, field), nullptr) << field;
  }
}

}  // namespace
}  // namespace kvmem::service
