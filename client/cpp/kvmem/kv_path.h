#pragma once
// KvPath: how this process moves K/V with one kvmemd, chosen once from its GetInfo.
//
//   attach  the pool mapped in place (kvmem/shared_pool.h): the daemon is on this host (its
//           attach socket answers) and offers this caller the pool; zero copies.
//   ucx     RMA gets of the pool (kvmem/ucx_pool.h) and appends as active messages
//           (kvmem/ucx_sender.h): kvmemd runs --ucx, both sides are built with UCX.
//   grpc    ReadKv, and the K/V inside the Append.
//
// Reads and appends choose apart: a caller the daemon gives its pool's keys reads by
// attach, else UCX, else gRPC; appends go by UCX whenever the daemon offers its appends'
// worker (to every caller) and the payload fits --ucx-max-payload-bytes, else in the request
// (on the same host, a StepBatch's in-place writes are the fast path; see SharedPool). kAuto
// takes the first that works and says why in reason(); a transport asked by name that
// cannot be had is an error naming what is missing. UCX's own transports come from its
// environment (UCX_TLS: tcp, shared memory, CMA, ...). A UCX read whose connection broke
// (the daemon restarted, or a read outlasted its deadline) is read once more on a connection
// made anew; while one is being made, and for 5 s after one could not be, reads go by gRPC
// (they wait for it when UCX was asked for).
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kvmem/client.h"

namespace kvmem::client {

class SharedPool;
class UcxPool;

enum class KvTransport { kAuto, kAttach, kUcx, kGrpc };

// "auto", "attach" (or "shm"), "ucx", "grpc"; INVALID_ARGUMENT naming them otherwise.
absl::StatusOr<KvTransport> ParseKvTransport(absl::string_view name);
absl::string_view KvTransportName(KvTransport transport);

class KvPath {
 public:
  struct Options {
    KvTransport transport = KvTransport::kAuto;
    // attach: map the pool read-write too (in-place writes, Info::in_place_writes).
    bool writable = false;
    // ucx: a daemon that goes away fails a read within this.
    absl::Duration ucx_deadline = absl::Seconds(10);
  };
  // `client` is kept (not owned) and must outlive the path; `info` is its GetInfo, fresh
  // (an attach ticket is good for a minute or so).
  static absl::StatusOr<std::unique_ptr<KvPath>> Open(Client* client, const Info& info,
                                                      Options options);
  ~KvPath();
  KvPath(const KvPath&) = delete;
  KvPath& operator=(const KvPath&) = delete;

  KvTransport reads() const { return reads_; }
  KvTransport appends() const { return appends_; }
  // Why each was chosen (for a log line): "reads: attach (same host); appends: grpc (...)".
  const std::string& reason() const { return reason_; }
  // The mapping, when reads() is kAttach (StreamBlocks reads blocks in place); else null.
  SharedPool* attached() const { return attached_.get(); }

  // Every stream of `table`'s sequence at table.epoch, layer-major as ReadKv gives them
  // (quantized blocks dequantized to the layout dtype; positions: the table's on attach
  // and UCX, so empty for a table fetched without them). FAILED_PRECONDITION or ABORTED
  // when the table is stale or changed during the read: fetch it again; nothing read is
  // given out. Thread-safe.
  absl::StatusOr<std::vector<StreamKv>> Read(const BlockTable& table) const;
  // Whether an append of `kv_bytes` of K and V together goes by UCX.
  bool AppendsByUcx(uint64_t kv_bytes) const;
  // Client::Append, its K/V by UCX where AppendsByUcx, else in the request.
  absl::StatusOr<AppendResult> Append(uint64_t sequence_id, const AppendArgs& args,
                                      BlockTable* table = nullptr);
  // K/V bytes moved by UCX so far: read, and sent.
  uint64_t ucx_bytes_read() const;
  uint64_t ucx_bytes_sent() const;

 private:
  KvPath() = default;
  absl::Status OpenReads(const Info& info, const Options& options, std::string* why);
  absl::Status OpenAppends(const Info& info, const Options& options, std::string* why);
  // Reads by UCX; nullopt where they go by gRPC instead (no connection to be had).
  std::optional<absl::StatusOr<std::vector<StreamKv>>> ReadByUcx(const BlockTable& table) const;
  // The pool reader, connected anew when the last one broke (at most once per pause after
  // a failure unless UCX was asked for); null where reads go by gRPC meanwhile.
  absl::StatusOr<std::shared_ptr<UcxPool>> UcxReader() const;

  Client* client_ = nullptr;
  Options options_;
  KvTransport reads_ = KvTransport::kGrpc, appends_ = KvTransport::kGrpc;
  std::string reason_;
  uint64_t ucx_max_payload_bytes_ = 0;
  bool every_append_by_ucx_ = false;  // asked for UCX: small appends too
  std::unique_ptr<SharedPool> attached_;
  struct Ucx;  // the pool reader and the sender, where built with UCX
  std::unique_ptr<Ucx> ucx_;
};

}  // namespace kvmem::client
