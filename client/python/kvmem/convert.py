"""Between the client's types (kvmem.messages, kvmem.layout) and the wire (kvmem_pb2): requests
filled from arguments, responses read into results. Pure functions; internal."""
from __future__ import annotations

import fractions
import math
from typing import Optional, Sequence, Union

import numpy as np
from google.protobuf import duration_pb2

from kvmem.layout import DType, Layout, PolicySpec, Precision, kv_bytes_of
from kvmem.messages import (AppendResult, CompressResult, Info, LayerKept, LogitStats,
                            NewTokens, ParamInfo, PolicyCounters, PolicyInfo, QuantizerInfo,
                            SequenceStats, Stats, StepArgs, StepResult, StreamSignal)
from kvmem.v1 import kvmem_pb2 as pb


def seconds_of(d: duration_pb2.Duration) -> float:
    return d.seconds + d.nanos / 1e9


_NANOS_PER_SECOND = 1_000_000_000


def duration_of(seconds: float, out: duration_pb2.Duration) -> None:
    """`seconds` rounded to the nanosecond: nanos in [0, 1e9) and of the seconds' sign, as
    google.protobuf.Duration requires (0.9999999999 s is 1 s, never 0 s and 1e9 ns)."""
    if not math.isfinite(seconds):
        raise ValueError(f"lease: {seconds} is not a finite number of seconds")
    # The float's exact value, in integer nanoseconds: no rounding but this one.
    total = round(fractions.Fraction(seconds) * _NANOS_PER_SECOND)
    whole, nanos = divmod(abs(total), _NANOS_PER_SECOND)
    sign = -1 if total < 0 else 1
    out.seconds = sign * whole
    out.nanos = sign * nanos


def fill_layout(layout: Layout, out: pb.Layout) -> None:
    out.num_layers = layout.num_layers
    out.num_kv_heads = layout.num_kv_heads
    out.head_dim = layout.head_dim
    out.dtype = pb.DType.ValueType(layout.dtype.value)
    if layout.block_tokens is not None:
        out.block_tokens = layout.block_tokens
    out.vocab_size = layout.vocab_size


def layout_of(m: pb.Layout) -> Layout:
    return Layout(m.num_layers, m.num_kv_heads, m.head_dim, DType(int(m.dtype)),
                  m.block_tokens if m.HasField("block_tokens") else None, m.vocab_size)


def fill_policy(policy: PolicySpec, out: pb.PolicySpec) -> None:
    if policy.name is not None:
        out.name = policy.name
    out.quantization = pb.Precision.ValueType(policy.quantization.value)
    if policy.quantization_recent_tokens is not None:
        out.quantization_recent_tokens = policy.quantization_recent_tokens
    for name, value in policy.params.items():
        out.params[name] = float(value)


# An AppendRequest, an AppendStreamRequest chunk or a StepBatchEntry's NewTokens.
TokensMessage = Union[pb.AppendRequest, pb.AppendStreamRequest, pb.NewTokens]


def fill_tokens(tokens: NewTokens, layout: Optional[Layout], out: TokensMessage) -> None:
    """The tokens' fields; K/V checked against `layout` ([L][H][n][D] in its dtype) when the
    client knows it, else sent as they are (the daemon checks them)."""
    n = len(tokens.positions)
    out.positions.extend(int(p) for p in tokens.positions)
    if tokens.token_ids is not None:
        out.token_ids.extend(int(t) for t in tokens.token_ids)
    if layout is not None:
        shape = layout.kv_shape(n)
        out.k = kv_bytes_of(tokens.k, layout.dtype, shape, "k")
        out.v = kv_bytes_of(tokens.v, layout.dtype, shape, "v")
    else:
        out.k = np.ascontiguousarray(tokens.k).tobytes()
        out.v = np.ascontiguousarray(tokens.v).tobytes()
    if tokens.token_entropy is not None:
        out.token_entropy.extend(float(x) for x in tokens.token_entropy)
    if tokens.layer_distance is not None:
        out.layer_distance.extend(float(x) for x in tokens.layer_distance)


def add_rows(rows: Sequence[StreamSignal], out: object, f16: bool = False) -> None:
    """Attention rows (AttentionRow) or window scores (WindowScores)."""
    for s in rows:
        row = out.add()  # type: ignore[attr-defined]
        row.layer = s.layer
        row.kv_head = s.kv_head
        values = np.asarray(s.values, dtype=np.float32)
        if isinstance(row, pb.WindowScores):
            row.scores.extend(values.tolist())
        elif f16:
            row.weights_f16 = values.astype("<f2").tobytes()
        else:
            row.weights.extend(values.tolist())


def fill_logit_stats(stats: LogitStats, out: pb.LogitStats) -> None:
    out.entropy = stats.entropy
    out.p1 = stats.p1
    out.p2 = stats.p2
    out.top_logprobs.extend(float(x) for x in stats.top_logprobs)


def fill_step_signals(args: StepArgs, logit_stats: bool, attention_rows: bool,
                      out: Union[pb.StepRequest, pb.StepSignals]) -> None:
    """A step's signals, without those the policy does not use."""
    out.epoch = args.epoch
    if args.logit_stats is not None and logit_stats:
        fill_logit_stats(args.logit_stats, out.logit_stats)
    if attention_rows:
        add_rows(args.attention, out.attention, f16=args.attention_f16)


def append_result_of(r: Union[pb.AppendResponse, pb.AppendStreamResponse]) -> AppendResult:
    return AppendResult(r.appended_tokens, r.max_stream_tokens, r.epoch, r.kv_bytes,
                        r.table_version)


def step_result_of(r: pb.StepResponse) -> StepResult:
    return StepResult(r.confidence, r.budget_tokens if r.HasField("budget_tokens") else None,
                      r.evicted_tokens, r.quantized_tokens, r.kv_bytes_before, r.kv_bytes_after,
                      r.epoch, r.step, r.table_version)


def compress_result_of(r: pb.CompressResponse) -> CompressResult:
    return CompressResult([LayerKept(l.layer, l.kept_tokens, l.before_tokens) for l in r.layers],
                          r.evicted_tokens, r.quantized_tokens, r.kv_bytes_before,
                          r.kv_bytes_after, r.epoch, r.table_version)


def info_of(r: pb.GetInfoResponse) -> Info:
    policies = [PolicyInfo(p.name, p.description,
                           [ParamInfo(q.name, q.default_value, q.min_value, q.max_value,
                                      q.description) for q in p.params],
                           list(p.step_signals), list(p.compress_signals),
                           list(p.append_signals)) for p in r.policies]
    quantizers = [QuantizerInfo(Precision(q.precision) if q.precision else Precision.LAYOUT,
                                q.name, q.description) for q in r.quantizers]
    export = r.WhichOneof("pool_export")
    shm = r.shared_memory if export == "shared_memory" else pb.SharedMemoryPool()
    cuda = r.cuda_ipc if export == "cuda_ipc" else pb.CudaIpcPool()
    return Info(r.version, r.backend, r.device_name, r.pool_bytes, r.pool_free_bytes,
                r.page_bytes, r.default_block_tokens, r.max_sequences,
                seconds_of(r.default_lease), seconds_of(r.max_lease), r.max_message_bytes,
                r.device_step, r.in_place_writes, policies, quantizers,
                r.default_quantization_recent_tokens, shm.segment_bytes,
                cuda.handle, cuda.device_uuid, cuda.pool_bytes,
                r.epoch_board.stride, r.epoch_board.slots, r.attach.socket, r.attach.ticket,
                r.attach.daemon_uid if r.HasField("attach") else None, r.instance_id,
                shm.piece_offset, shm.piece_bytes or shm.segment_bytes)


def sequence_stats_of(s: pb.SequenceStats) -> SequenceStats:
    return SequenceStats(s.sequence_id, s.policy, s.appended_tokens, s.max_stream_tokens,
                         s.kv_bytes, s.blocks, s.epoch, s.steps, seconds_of(s.lease_remaining),
                         s.parent_id if s.HasField("parent_id") else None, s.pool_bytes_held,
                         s.quantization, s.slot_state_bytes)


def stats_of(r: pb.StatsResponse, sequences: list[SequenceStats]) -> Stats:
    """A Stats response's counters (the first page's) with the sequences of every page."""
    policies = [PolicyCounters(p.policy, p.tokens_appended, p.tokens_evicted, p.tokens_quantized,
                               p.stream_slots_evicted, p.stream_slots_quantized, p.steps)
                for p in r.policies]
    return Stats(r.pool_bytes, r.pool_used_bytes, r.pool_free_bytes, r.pages_total, r.pages_used,
                 r.blocks_used, r.sequences_active, r.sequences_created, r.tokens_appended,
                 r.tokens_evicted, r.tokens_quantized, r.stream_slots_evicted,
                 r.stream_slots_quantized, policies, r.kv_bytes, r.full_cache_bytes, r.steps,
                 r.leases_expired, r.slot_state_bytes, r.host_metadata_bytes,
                 r.host_metadata_budget_bytes, r.sequences_poisoned, r.prefix.queries_total,
                 r.prefix.hits_total, r.prefix.reused_tokens_total,
                 r.prefix.reclaimed_bytes_total, r.prefix.entries, r.prefix.indexed_blocks,
                 r.prefix.cached_blocks, sequences, r.blocks_forsaken, r.bytes_forsaken)


def kv_array(data: bytes, dtype: DType, head_dim: int) -> np.ndarray:
    """[n][D] in the layout dtype over `data` (no copy; read-only)."""
    return np.frombuffer(data, dtype=dtype.numpy).reshape(-1, head_dim)
