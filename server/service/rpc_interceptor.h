#pragma once
// A gRPC server interceptor that counts every call by method and status code, times it
// (from the call's start to its status), and adds the bytes of its messages (RpcTelemetry).
#include <memory>

#include "grpcpp/support/server_interceptor.h"
#include "server/metrics/rpc_telemetry.h"

namespace kvmem::service {

// The interceptor factories to give ServerBuilder::experimental().SetInterceptorCreators;
// `telemetry` must outlive the server.
std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> RpcInterceptors(
    metrics::RpcTelemetry* telemetry);

// Every method of the services kvmemd serves (full names), for RpcTelemetry.
std::vector<std::string> ServedMethods();

}  // namespace kvmem::service
