#include "kvmem/kv_path.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "kvmem/shared_pool.h"
#if KVMEM_WITH_UCX
#include "absl/synchronization/mutex.h"
#include "kvmem/ucx_pool.h"
#include "kvmem/ucx_sender.h"
#endif

namespace kvmem::client {
namespace {

// The daemon's default --ucx-max-payload-bytes, for one that does not say.
constexpr uint64_t kDefaultUcxMaxPayloadBytes = 256ull << 20;
// Below this an append's message would go eager, copied as the request's bytes are: the
// request alone is the cheaper of the two (kAuto).
constexpr uint64_t kUcxAppendLeastBytes = 32 << 10;

}  // namespace

struct KvPath::Ucx {
#if KVMEM_WITH_UCX
  // The pool reader: replaced when it breaks (a read holds the one it started with).
  absl::Mutex mu;
  std::shared_ptr<UcxPool> pool ABSL_GUARDED_BY(mu);
  uint64_t bytes_read_before ABSL_GUARDED_BY(mu) = 0;  // by the readers replaced
  absl::Time next_connect ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  bool connecting ABSL_GUARDED_BY(mu) = false;  // a reader is connecting anew
  std::unique_ptr<UcxSender> sender;
#endif
};

namespace {

// After a connection that could not be had, how long reads go by gRPC before trying again.
constexpr absl::Duration kReconnectPause = absl::Seconds(5);

}  // namespace

absl::StatusOr<KvTransport> ParseKvTransport(absl::string_view name) {
  if (name == "auto") return KvTransport::kAuto;
  if (name == "attach" || name == "shm") return KvTransport::kAttach;
  if (name == "ucx") return KvTransport::kUcx;
  if (name == "grpc") return KvTransport::kGrpc;
  return absl::InvalidArgumentError(
      absl::StrCat("transport: \"", name, "\" is none of auto, attach (shm), ucx, grpc"));
}

absl::string_view KvTransportName(KvTransport transport) {
  switch (transport) {
    case KvTransport::kAuto:
      return "auto";
    case KvTransport::kAttach:
      return "attach";
    case KvTransport::kUcx:
      return "ucx";
    case KvTransport::kGrpc:
      return "grpc";
  }
  return "?";
}

KvPath::~KvPath() = default;

absl::StatusOr<std::unique_ptr<KvPath>> KvPath::Open(Client* client, const Info& info,
                                                     Options options) {
  std::unique_ptr<KvPath> path(new KvPath());
  path->client_ = client;
  path->options_ = options;
  path->ucx_ = std::make_unique<Ucx>();
  path->every_append_by_ucx_ = options.transport == KvTransport::kUcx;
  path->ucx_max_payload_bytes_ =
      info.ucx.max_payload_bytes != 0 ? info.ucx.max_payload_bytes : kDefaultUcxMaxPayloadBytes;
  std::string reads_why, appends_why;
  if (absl::Status s = path->OpenReads(info, options, &reads_why); !s.ok()) return s;
  if (absl::Status s = path->OpenAppends(info, options, &appends_why); !s.ok()) return s;
  path->reason_ =
      absl::StrCat("reads: ", KvTransportName(path->reads_), " (", reads_why,
                   "); appends: ", KvTransportName(path->appends_), " (", appends_why, ")");
  return path;
}

absl::Status KvPath::OpenReads(const Info& info, const Options& options, std::string* why) {
  const KvTransport want = options.transport;
  if (want == KvTransport::kGrpc) {
    *why = "asked for";
    return absl::OkStatus();
  }
  if (want == KvTransport::kAuto || want == KvTransport::kAttach) {
    std::string no;
    if (info.shm_bytes == 0) {
      no = info.cuda_ipc_handle.empty()
               ? "the daemon's pool is not in shared memory"
               : "the daemon's pool is on its GPU (a GPU worker maps it: kvmem/cuda_pool.h)";
    } else if (info.attach.ticket.empty()) {
      no = "the daemon offers this caller no attach";
    } else {
      absl::StatusOr<std::unique_ptr<SharedPool>> pool = SharedPool::Attach(info, options.writable);
      if (pool.ok()) {
        attached_ = *std::move(pool);
        reads_ = KvTransport::kAttach;
        *why = want == KvTransport::kAttach ? "asked for" : "same host";
        return absl::OkStatus();
      }
      no = absl::IsUnavailable(pool.status())
               ? absl::StrCat("the daemon's attach socket is not here (another host): ",
                              pool.status().message())
               : std::string(pool.status().message());
    }
    if (want == KvTransport::kAttach) {
      return absl::FailedPreconditionError(absl::StrCat("transport attach: ", no));
    }
    absl::StrAppend(why, "no attach: ", no);
  }
  std::string no;
#if KVMEM_WITH_UCX
  if (info.ucx.worker_address.empty()) {
    no = info.ucx.append_worker_address.empty()
             ? "the daemon runs no UCX worker (kvmemd --ucx)"
             : "the daemon gives this caller no pool key (only a caller that may read the "
               "pool gets one)";
  } else {
    absl::StatusOr<std::unique_ptr<UcxPool>> pool = UcxPool::Connect(info, options.ucx_deadline);
    if (pool.ok()) {
      absl::MutexLock lock(&ucx_->mu);
      ucx_->pool = *std::move(pool);
      reads_ = KvTransport::kUcx;
      if (why->empty()) *why = "asked for";
      return absl::OkStatus();
    }
    no = std::string(pool.status().message());
  }
#else
  no = "this client was built without UCX (WITH_UCX)";
#endif
  if (want == KvTransport::kUcx) {
    return absl::FailedPreconditionError(absl::StrCat("transport ucx, reads: ", no));
  }
  absl::StrAppend(why, "; no ucx: ", no);
  reads_ = KvTransport::kGrpc;
  return absl::OkStatus();
}

absl::Status KvPath::OpenAppends(const Info& info, const Options& options, std::string* why) {
  const KvTransport want = options.transport;
  if (want == KvTransport::kGrpc || want == KvTransport::kAttach) {
    *why = want == KvTransport::kGrpc ? "asked for" : "in the request, with attach";
    return absl::OkStatus();
  }
  std::string no;
#if KVMEM_WITH_UCX
  if (info.ucx.append_worker_address.empty()) {
    no = "the daemon runs no UCX worker (kvmemd --ucx)";
  } else {
    absl::StatusOr<std::unique_ptr<UcxSender>> sender = UcxSender::Connect(info);
    if (sender.ok()) {
      ucx_->sender = *std::move(sender);
      appends_ = KvTransport::kUcx;
      *why = want == KvTransport::kUcx
                 ? "asked for"
                 : absl::StrCat("payloads of ", kUcxAppendLeastBytes >> 10, " KiB to ",
                                ucx_max_payload_bytes_ >> 20, " MiB; smaller ones in the request");
      return absl::OkStatus();
    }
    no = std::string(sender.status().message());
  }
#else
  no = "this client was built without UCX (WITH_UCX)";
#endif
  if (want == KvTransport::kUcx) {
    return absl::FailedPreconditionError(absl::StrCat("transport ucx, appends: ", no));
  }
  *why = absl::StrCat("no ucx: ", no);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<StreamKv>> KvPath::Read(const BlockTable& table) const {
  if (attached_ != nullptr) {
    absl::StatusOr<std::vector<StreamKv>> read = attached_->ReadStreams(table);
    // A mapping of a piece of the pool (kvmemd's tenant arenas: an admin maps the shared
    // part) does not hold every sequence's blocks: those elsewhere come as if nothing were
    // mapped, unless attach alone was asked for.
    if (read.ok() || !absl::IsOutOfRange(read.status()) ||
        options_.transport == KvTransport::kAttach || attached_->Maps(0, attached_->bytes())) {
      return read;
    }
  }
  if (reads_ == KvTransport::kUcx) {
    std::optional<absl::StatusOr<std::vector<StreamKv>>> read = ReadByUcx(table);
    if (read.has_value()) return *std::move(read);
  }
  return client_->ReadKv(table.sequence_id, table.epoch);
}

std::optional<absl::StatusOr<std::vector<StreamKv>>> KvPath::ReadByUcx(
    const BlockTable& table) const {
#if KVMEM_WITH_UCX
  const bool asked = options_.transport == KvTransport::kUcx;
  std::optional<absl::StatusOr<std::vector<StreamKv>>> read;
  // A read that breaks the connection (the daemon restarted, or went away) is read once
  // more on a new one.
  for (int attempt = 0; attempt < 2; ++attempt) {
    absl::StatusOr<std::shared_ptr<UcxPool>> pool = UcxReader();
    if (!pool.ok()) return asked ? std::make_optional(pool.status()) : std::nullopt;
    if (*pool == nullptr) return std::nullopt;
    read = (*pool)->ReadStreams(table);
    if (read->ok() || !(*pool)->broken()) return read;
  }
  return asked ? read : std::nullopt;
#else
  (void)table;
  return std::nullopt;
#endif
}

#if KVMEM_WITH_UCX
absl::StatusOr<std::shared_ptr<UcxPool>> KvPath::UcxReader() const {
  const bool asked = options_.transport == KvTransport::kUcx;
  std::shared_ptr<UcxPool> retired;  // ended outside the lock (closing may wait)
  {
    absl::MutexLock lock(&ucx_->mu);
    if (asked) {
      ucx_->mu.Await(absl::Condition(
          +[](bool* connecting) { return !*connecting; }, &ucx_->connecting));
    } else if (ucx_->connecting) {
      return nullptr;  // by gRPC meanwhile
    }
    if (ucx_->pool != nullptr && !ucx_->pool->broken()) return ucx_->pool;
    if (!asked && absl::Now() < ucx_->next_connect) return nullptr;
    if (ucx_->pool != nullptr) ucx_->bytes_read_before += ucx_->pool->bytes_read();
    retired = std::move(ucx_->pool);
    ucx_->connecting = true;
  }
  // Connected anew from the daemon's GetInfo (a restarted daemon has a new worker and new
  // keys), outside the lock: other readers go by gRPC meanwhile (or wait, UCX asked for).
  absl::StatusOr<Info> info = client_->GetInfo();
  absl::StatusOr<std::unique_ptr<UcxPool>> connected =
      info.ok() ? UcxPool::Connect(*info, options_.ucx_deadline)
                : absl::StatusOr<std::unique_ptr<UcxPool>>(info.status());
  absl::MutexLock lock(&ucx_->mu);
  ucx_->connecting = false;
  if (connected.ok()) {
    ucx_->pool = *std::move(connected);
    return ucx_->pool;
  }
  ucx_->next_connect = absl::Now() + kReconnectPause;
  if (!asked) return nullptr;
  return absl::UnavailableError(
      absl::StrCat("transport ucx: the connection to the daemon's pool broke and cannot be made "
                   "again: ",
                   connected.status().message()));
}
#endif

bool KvPath::AppendsByUcx(uint64_t kv_bytes) const {
  if (appends_ != KvTransport::kUcx || kv_bytes == 0 || kv_bytes > ucx_max_payload_bytes_) {
    return false;
  }
  return every_append_by_ucx_ || kv_bytes >= kUcxAppendLeastBytes;
}

absl::StatusOr<AppendResult> KvPath::Append(uint64_t sequence_id, const AppendArgs& args,
                                            BlockTable* table) {
#if KVMEM_WITH_UCX
  if (AppendsByUcx(args.k.size() + args.v.size())) {
    return ucx_->sender->Append(*client_, sequence_id, args, table);
  }
#endif
  return client_->Append(sequence_id, args, table);
}

uint64_t KvPath::ucx_bytes_read() const {
#if KVMEM_WITH_UCX
  absl::MutexLock lock(&ucx_->mu);
  return ucx_->bytes_read_before + (ucx_->pool != nullptr ? ucx_->pool->bytes_read() : 0);
#else
  return 0;
#endif
}

uint64_t KvPath::ucx_bytes_sent() const {
#if KVMEM_WITH_UCX
  if (ucx_->sender != nullptr) return ucx_->sender->bytes_sent();
#endif
  return 0;
}

}  // namespace kvmem::client
