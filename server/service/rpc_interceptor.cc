#include "server/service/rpc_interceptor.h"

#include <chrono>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "kvmem/v1/kvmem.grpc.pb.h"
#include "server/service/parsed.h"

namespace kvmem::service {
namespace {

using grpc::experimental::InterceptionHookPoints;

// "/kvmem.v1.KvCache/": the start of every KvCache method's name (made once: an interceptor
// is made per call).
const std::string& KvCachePrefix() {
  static const std::string* prefix =
      new std::string(absl::StrCat("/", v1::KvCache::service_full_name(), "/"));
  return *prefix;
}

class RpcInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcInterceptor(metrics::RpcTelemetry* telemetry, grpc::experimental::ServerRpcInfo* info)
      : telemetry_(telemetry),
        method_(telemetry->For(info->method())),
        counts_bytes_(&method_ != &*telemetry->methods().back()),
        parsed_(absl::StartsWith(info->method(), KvCachePrefix())),
        started_(std::chrono::steady_clock::now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (counts_bytes_) {
      if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE)) {
        if (const void* m = methods->GetRecvMessage()) {
          // KvCache's requests arrive as Parsed<T> (ParsedBase at its start), the other
          // services' as their messages.
          telemetry_->bytes_in.fetch_add(
              parsed_ ? static_cast<const ParsedBase*>(m)->wire_bytes()
                      : static_cast<const google::protobuf::Message*>(m)->ByteSizeLong(),
              std::memory_order_relaxed);
        }
      }
      if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_MESSAGE)) {
        if (const void* m = methods->GetSendMessage()) {
          telemetry_->bytes_out.fetch_add(
              static_cast<const google::protobuf::Message*>(m)->ByteSizeLong(),
              std::memory_order_relaxed);
        }
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      const int code = static_cast<int>(methods->GetSendStatus().error_code());
      if (code >= 0 && code < metrics::RpcTelemetry::kCodes) {
        method_.calls[code].fetch_add(1, std::memory_order_relaxed);
      }
      method_.seconds.Observe(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count());
    }
    methods->Proceed();
  }

 private:
  metrics::RpcTelemetry* const telemetry_;
  metrics::RpcTelemetry::Method& method_;
  const bool counts_bytes_;  // KvCache's (and the other known services') protobuf messages
  const bool parsed_;        // a KvCache method: its requests are Parsed<T>
  const std::chrono::steady_clock::time_point started_;
};

class RpcInterceptorFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcInterceptorFactory(metrics::RpcTelemetry* telemetry) : telemetry_(telemetry) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new RpcInterceptor(telemetry_, info);
  }

 private:
  metrics::RpcTelemetry* const telemetry_;
};

}  // namespace

std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> RpcInterceptors(
    metrics::RpcTelemetry* telemetry) {
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> out;
  out.push_back(std::make_unique<RpcInterceptorFactory>(telemetry));
  return out;
}

std::vector<std::string> ServedMethods() {
  std::vector<std::string> names;
  const google::protobuf::ServiceDescriptor* kv =
      google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(
          kvmem::v1::KvCache::service_full_name());
  for (int i = 0; i < kv->method_count(); ++i) {
    names.push_back("/" + kv->full_name() + "/" + kv->method(i)->name());
  }
  return names;
}

}  // namespace kvmem::service
