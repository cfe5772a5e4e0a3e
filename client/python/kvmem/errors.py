"""Exceptions of the kvmem client: one per gRPC status code the daemon answers, each carrying
the code, the daemon's message unchanged, and what its google.rpc details say.

The daemon's details (server/service/error_details.cc, kvmem.proto's header):
- INVALID_ARGUMENT, OUT_OF_RANGE: google.rpc.BadRequest, the request's field path (`field`);
- FAILED_PRECONDITION / ABORTED on a stale epoch: google.rpc.PreconditionFailure and
  google.rpc.ErrorInfo (reason "STALE_EPOCH", metadata current_epoch / current_version):
  raised as StaleEpochError for both codes. A read the table changed under is answered
  ABORTED, and is still a StaleEpochError (a FailedPreconditionError), never an
  AbortedError: catch StaleEpochError, and read `code` to tell the two apart;
- RESOURCE_EXHAUSTED: google.rpc.QuotaFailure whose subject is the kvmemd flag that sets the
  limit, as the daemon's message spells it (`limit`): "--pool-bytes", "--max-sequences",
  "--max-append-streams", ... (dashed; kvmemd takes its flags with dashes or with the
  underscores absl defines them with, --pool_bytes);
- NOT_FOUND of a sequence: google.rpc.ResourceInfo ("sequence/<id>").
Details that do not parse leave `details` empty; the code and message are kept.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

_log = logging.getLogger("kvmem")

# The trailing metadata key under which gRPC carries a serialized google.rpc.Status.
_DETAILS_KEY = "grpc-status-details-bin"

_DETAIL_TYPES = (error_details_pb2.BadRequest, error_details_pb2.ErrorInfo,
                 error_details_pb2.PreconditionFailure, error_details_pb2.QuotaFailure,
                 error_details_pb2.ResourceInfo, error_details_pb2.RetryInfo,
                 error_details_pb2.DebugInfo, error_details_pb2.Help,
                 error_details_pb2.LocalizedMessage, error_details_pb2.RequestInfo)


class KvmemError(Exception):
    """A failed kvmemd call (or a check this client makes before or after one).

    code: the gRPC status code. message: the daemon's message, unchanged ("field: what is
    wrong"). details: the google.rpc detail messages, unpacked where the type is known.
    field, current_epoch, current_version, limit, reason: what the details say, else None.
    """

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, code: Optional[grpc.StatusCode] = None,
                 details: Sequence[Any] = ()) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.details = list(details)
        self.field: Optional[str] = None
        self.current_epoch: Optional[int] = None
        self.current_version: Optional[int] = None
        self.limit: Optional[str] = None
        self.reason: Optional[str] = None
        self.metadata: dict[str, str] = {}
        self._read_details()

    def _read_details(self) -> None:
        # The first value of each kind (the daemon sends one detail of each).
        for detail in self.details:
            if isinstance(detail, error_details_pb2.BadRequest):
                if self.field is None and detail.field_violations and \
                        detail.field_violations[0].field:
                    self.field = detail.field_violations[0].field
            elif isinstance(detail, error_details_pb2.ErrorInfo):
                # A later ErrorInfo adds what the first lacks, and overwrites nothing.
                if self.reason is None:
                    self.reason = detail.reason
                for key, value in detail.metadata.items():
                    self.metadata.setdefault(key, value)
                if self.current_epoch is None:
                    self.current_epoch = _decimal(detail.metadata.get("current_epoch"))
                if self.current_version is None:
                    self.current_version = _decimal(detail.metadata.get("current_version"))
            elif isinstance(detail, error_details_pb2.QuotaFailure):
                if self.limit is None and detail.violations:
                    self.limit = detail.violations[0].subject

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidArgumentError(KvmemError):
    """The request is malformed; `field` names the offending field path."""
    code = grpc.StatusCode.INVALID_ARGUMENT


class OutOfRangeError(InvalidArgumentError):
    code = grpc.StatusCode.OUT_OF_RANGE


class NotFoundError(KvmemError):
    """The sequence is unknown: released, lapsed, never created, or another tenant's."""
    code = grpc.StatusCode.NOT_FOUND


class FailedPreconditionError(KvmemError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class StaleEpochError(FailedPreconditionError):
    """The block table moved on (FAILED_PRECONDITION), or changed during a read (ABORTED:
    still this class, a FailedPreconditionError, not an AbortedError; `code` tells which):
    fetch the table again. current_epoch / current_version say where it is now, when
    known."""


class AbortedError(KvmemError):
    code = grpc.StatusCode.ABORTED


class ResourceExhaustedError(KvmemError):
    """A limit was reached (the pool, the sequence slots, a tenant's quota); `limit` names the
    kvmemd flag that sets it as the daemon's message spells it ("--pool-bytes",
    "--max-sequences"; absl defines them as --pool_bytes, --max_sequences)."""
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(KvmemError):
    """The daemon is down, unreachable or draining (after the client's retries)."""
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(KvmemError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class DataLossError(KvmemError):
    """The sequence was poisoned by a failure past a mutation's point of no return."""
    code = grpc.StatusCode.DATA_LOSS


class PermissionDeniedError(KvmemError):
    code = grpc.StatusCode.PERMISSION_DENIED


class UnauthenticatedError(KvmemError):
    code = grpc.StatusCode.UNAUTHENTICATED


class CancelledError(KvmemError):
    code = grpc.StatusCode.CANCELLED


class InternalError(KvmemError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[KvmemError]] = {
    cls.code: cls for cls in (
        InvalidArgumentError, OutOfRangeError, NotFoundError, FailedPreconditionError,
        AbortedError, ResourceExhaustedError, UnavailableError, DeadlineExceededError,
        DataLossError, PermissionDeniedError, UnauthenticatedError, CancelledError,
        InternalError)
}
_CODE_BY_NUMBER: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def _decimal(text: Optional[str]) -> Optional[int]:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _unpack(detail: any_pb2.Any) -> Any:
    for cls in _DETAIL_TYPES:
        if detail.Is(cls.DESCRIPTOR):
            message = cls()
            try:
                detail.Unpack(message)
            except DecodeError:
                return detail  # malformed: left packed, as an unknown type is
            return message
    return detail  # a type this client does not know: left packed


def _is_stale_epoch(details: Sequence[Any]) -> bool:
    for d in details:
        if isinstance(d, error_details_pb2.ErrorInfo) and d.reason == "STALE_EPOCH":
            return True
        if isinstance(d, error_details_pb2.PreconditionFailure) and any(
                v.type == "EPOCH" for v in d.violations):
            return True
    return False


def error_of(code: grpc.StatusCode, message: str, details: Sequence[Any] = ()) -> KvmemError:
    """The exception for a status: its class by code, StaleEpochError for a stale epoch."""
    if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED) and \
            _is_stale_epoch(details):
        return StaleEpochError(message, code=code, details=details)
    return _BY_CODE.get(code, KvmemError)(message, code=code, details=details)


def from_rpc_status(status: status_pb2.Status) -> Optional[KvmemError]:
    """A google.rpc.Status (a StepBatch entry's, a KeepAlive result's) as an exception; None
    when it is OK."""
    if status.code == 0:
        return None
    code = _CODE_BY_NUMBER.get(status.code, grpc.StatusCode.UNKNOWN)
    return error_of(code, status.message, [_unpack(d) for d in status.details])


def from_grpc(error: grpc.RpcError) -> KvmemError:
    """A failed call's exception, with the daemon's google.rpc details parsed."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = error.details() if hasattr(error, "details") else str(error)
    details: list[Any] = []
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == _DETAILS_KEY:
            try:
                rich = status_pb2.Status.FromString(value)
            except (DecodeError, TypeError) as e:  # not a google.rpc.Status: no details
                _log.warning("kvmem: %s of a %s answer does not parse: %s", _DETAILS_KEY,
                             code, e)
                continue
            details = [_unpack(d) for d in rich.details]
    result = error_of(code or grpc.StatusCode.UNKNOWN, message or "", details)
    if code == grpc.StatusCode.UNAVAILABLE and not details:
        # gRPC's own UNAVAILABLE (nothing listens) says "failed to connect to all addresses";
        # say what that means here.
        result.message = f"kvmemd unreachable: {result.message}"
        result.args = (result.message,)
    return result
