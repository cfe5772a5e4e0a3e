"""kvmem: the Python client of kvmemd, the KV-cache memory daemon.

    import kvmem
    with kvmem.Client("unix:/run/kvmem.sock") as client:
        layout = kvmem.Layout(num_layers=30, num_kv_heads=3, head_dim=64,
                              dtype=kvmem.DType.F16, vocab_size=49152)
        with client.create_sequence(layout, kvmem.PolicySpec("window")) as seq:
            seq.append(positions, k, v)   # k, v: numpy [L][H][n][D] float16
            streams = seq.read_kv()

See client/python/README.md.
"""
try:
    from kvmem.v1 import kvmem_pb2 as _stubs  # noqa: F401
except ImportError as e:  # a source checkout that was never built
    raise ImportError("kvmem: the gRPC stubs are generated at build time; install the package "
                      "(pip install ./client/python) instead of importing it from the "
                      "source tree") from e

from kvmem.block_table import BlockTable, StreamTable, TableSnapshot
from kvmem.client import (BatchEntry, BatchResult, Client, ClientOptions, FleetLookup,
                          PullResult)
from kvmem.errors import (AbortedError, DataLossError, DeadlineExceededError,
                          FailedPreconditionError, InvalidArgumentError, KvmemError,
                          NotFoundError, OutOfRangeError, PermissionDeniedError,
                          ResourceExhaustedError, StaleEpochError, UnauthenticatedError,
                          UnavailableError)
from kvmem.layout import DType, Layout, PolicySpec, Precision, bf16_to_float32, float32_to_bf16
from kvmem.messages import (AppendResult, CompressArgs, CompressResult, Info, LogitStats,
                            NewTokens, Prompt, StepArgs, StepResult, Stats, StreamKv,
                            StreamSignal)
from kvmem.sequence import Sequence

__all__ = [
    "AbortedError", "AppendResult", "BatchEntry", "BatchResult", "BlockTable", "Client",
    "ClientOptions", "CompressArgs", "CompressResult", "DType", "DataLossError",
    "DeadlineExceededError", "FailedPreconditionError", "FleetLookup", "Info",
    "InvalidArgumentError",
    "KvmemError", "Layout", "LogitStats", "NewTokens", "NotFoundError", "OutOfRangeError",
    "PermissionDeniedError", "PolicySpec", "Precision", "Prompt", "PullResult",
    "ResourceExhaustedError",
    "Sequence", "StaleEpochError", "StepArgs", "StepResult", "Stats", "StreamKv",
    "StreamSignal", "StreamTable", "TableSnapshot", "UnauthenticatedError", "UnavailableError",
    "bf16_to_float32", "float32_to_bf16",
]
