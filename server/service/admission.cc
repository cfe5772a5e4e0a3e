#include "server/service/admission.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvmem::service {

CallGate::Ticket::~Ticket() {
  if (gate_ == nullptr) return;
  kvmem::MutexLock lock(&gate_->mu_);
  --gate_->in_flight_;
}

CallGate::Ticket CallGate::Enter() {
  kvmem::MutexLock lock(&mu_);
  last_arrival_ = absl::Now();
  if (closed_) return Ticket(nullptr);
  ++in_flight_;
  return Ticket(this);
}

void CallGate::Close() {
  kvmem::MutexLock lock(&mu_);
  closed_ = true;
}

bool CallGate::AwaitQuiet(absl::Duration quiet, absl::Time deadline) {
  kvmem::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
  const bool never = false;  // a plain timed wait; the loop rechecks
  while (mu_.AwaitWithDeadline(absl::Condition(&idle), deadline)) {
    const absl::Time quiet_from = last_arrival_ + quiet;
    if (absl::Now() >= quiet_from || quiet_from >= deadline) return true;
    mu_.AwaitWithDeadline(absl::Condition(&never), quiet_from);
  }
  return false;
}

bool CallGate::closed() const {
  kvmem::MutexLock lock(&mu_);
  return closed_;
}

int64_t CallGate::in_flight() const {
  kvmem::MutexLock lock(&mu_);
  return in_flight_;
}

TenantCalls::Ticket::~Ticket() {
  if (calls_ == nullptr) return;
  kvmem::MutexLock lock(&calls_->mu_);
  auto it = calls_->calls_.find(tenant_);
  if (--it->second == 0) calls_->calls_.erase(it);
}

absl::StatusOr<TenantCalls::Ticket> TenantCalls::Enter(const std::string& tenant) {
  if (max_calls_ == 0) return Ticket();
  kvmem::MutexLock lock(&mu_);
  uint32_t& calls = calls_[tenant];
  if (calls >= max_calls_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        tenant.empty() ? std::string("the anonymous tenant")
                       : absl::StrCat("tenant '", tenant, "'"),
        " has ", calls, " calls in flight, its limit (--tenant-max-calls); retry when one ends"));
  }
  ++calls;
  return Ticket(this, tenant);
}

uint32_t TenantCalls::in_flight(const std::string& tenant) const {
  kvmem::MutexLock lock(&mu_);
  auto it = calls_.find(tenant);
  return it == calls_.end() ? 0 : it->second;
}

absl::Status DrainingError() {
  return absl::UnavailableError(
      "kvmemd is draining (shutting down); nothing was applied; retry on another instance");
}

AppendStreamBudget::Lease::~Lease() {
  if (budget_ == nullptr) return;
  kvmem::MutexLock lock(&budget_->mu_);
  budget_->bytes_ -= bytes_;
  --budget_->streams_;
  budget_->open_.erase(id_);
}

void AppendStreamBudget::Lease::Touch() {
  kvmem::MutexLock lock(&budget_->mu_);
  auto it = budget_->open_.find(id_);
  if (it != budget_->open_.end()) it->second.last_activity = absl::Now();
}

int AppendStreamBudget::CancelIdle(absl::Duration idle) {
  kvmem::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  int cancelled = 0;
  for (auto& [id, stream] : open_) {
    // The handler is still running (its lease is alive), so the context is too.
    if (stream.context != nullptr && now - stream.last_activity > idle) {
      stream.context->TryCancel();
      stream.context = nullptr;  // once
      ++cancelled;
    }
  }
  return cancelled;
}

absl::Status AppendStreamBudget::Lease::Reserve(uint64_t bytes) {
  kvmem::MutexLock lock(&budget_->mu_);
  if (bytes > budget_->max_bytes_ - budget_->bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "AppendStream: the open streams would buffer more than --max-stream-buffer-bytes=",
        budget_->max_bytes_, " bytes together (this stream holds ", bytes_, " + ", bytes,
        "); retry later or send the prefill in smaller streams"));
  }
  budget_->bytes_ += bytes;
  bytes_ += bytes;
  return absl::OkStatus();
}

void AppendStreamBudget::Lease::Return(uint64_t bytes) {
  kvmem::MutexLock lock(&budget_->mu_);
  bytes = std::min(bytes, bytes_);
  budget_->bytes_ -= bytes;
  bytes_ -= bytes;
}

uint32_t AppendStreamBudget::open() const {
  kvmem::MutexLock lock(&mu_);
  return streams_;
}

absl::StatusOr<AppendStreamBudget::Lease> AppendStreamBudget::Open(grpc::ServerContext* context) {
  kvmem::MutexLock lock(&mu_);
  if (streams_ >= max_streams_) {
    return absl::ResourceExhaustedError(
        absl::StrCat(call_, ": ", flag_, "=", max_streams_, " streams are open; ", advice_));
  }
  ++streams_;
  const uint64_t id = next_id_++;
  open_[id] = {context, absl::Now()};
  return Lease(this, id);
}

}  // namespace kvmem::service
