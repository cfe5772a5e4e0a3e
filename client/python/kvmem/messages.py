"""The client's plain types: what the verbs take and what they answer (no protobuf type
appears in them). They mirror client/cpp/kvmem/client.h; durations are seconds (float)."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from kvmem.layout import Precision


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    name: str
    default_value: float
    min_value: float
    max_value: float
    description: str


@dataclasses.dataclass(frozen=True)
class PolicyInfo:
    name: str
    description: str
    params: list[ParamInfo]
    step_signals: list[str]
    compress_signals: list[str]
    append_signals: list[str]


@dataclasses.dataclass(frozen=True)
class QuantizerInfo:
    precision: Precision
    name: str
    description: str


@dataclasses.dataclass(frozen=True)
class Info:
    """GetInfo: the daemon's version, backend, pool, limits, policies and data-plane
    endpoints (the shared-memory pool and epoch board for same-host readers)."""
    version: str
    backend: str
    device_name: str
    pool_bytes: int
    pool_free_bytes: int
    page_bytes: int
    default_block_tokens: int
    max_sequences: int
    default_lease: float
    max_lease: float
    max_message_bytes: int
    device_step: bool
    in_place_writes: bool
    policies: list[PolicyInfo]
    quantizers: list[QuantizerInfo]
    default_quantization_recent_tokens: int
    shm_bytes: int  # 0 when the pool is not a shared-memory segment
    cuda_ipc_handle: bytes
    cuda_device_uuid: str
    cuda_pool_bytes: int
    epoch_stride: int
    epoch_slots: int  # 0: no epoch board offered
    # The key to the pool's segment and the epoch board (kvmem.shared_pool): empty when
    # same-host attach is not offered to this caller.
    attach_socket: str
    attach_ticket: bytes
    attach_daemon_uid: Optional[int]  # the socket's peer must run as it (None: unchecked)
    # Random at each start of kvmemd (0 from an older one): another means a restart, and
    # what was mapped from the one before is stale.
    instance_id: int = 0
    # What the pool's descriptor maps: pool bytes [shm_piece_offset, + shm_piece_bytes);
    # the whole pool unless kvmemd cuts it into tenant arenas (a tenant's arena, or the
    # shared part: SharedMemoryPool in kvmem.proto). 0 bytes: the whole pool.
    shm_piece_offset: int = 0
    shm_piece_bytes: int = 0

    def policy(self, name: str) -> PolicyInfo:
        for p in self.policies:
            if p.name == name:
                return p
        raise KeyError(f"policy {name!r}: the daemon lists {[p.name for p in self.policies]}")


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A new sequence's prompt, for prefix sharing: its longest published prefix in the same
    model, layout and salt is mapped in (whole blocks, never the last token)."""
    token_ids: Sequence[int]
    cache_salt: str = ""  # the tenant's: only prompts with the same salt share
    model: str = ""       # with the layout, the namespace of the block hashes
    auto_publish: bool = False
    # The first document_tokens of token_ids are a document that may have been published
    # compressed under the new sequence's policy (Sequence.publish_document).
    document_tokens: int = 0


@dataclasses.dataclass
class NewTokens:
    """n new tokens: positions (increasing, beyond every appended one), K and V as numpy
    arrays [L][H][n][D] in the layout dtype, optional token ids and per-token signals."""
    positions: Sequence[int]
    k: np.ndarray
    v: np.ndarray
    token_ids: Optional[Sequence[int]] = None
    token_entropy: Optional[Sequence[float]] = None
    layer_distance: Optional[Sequence[float]] = None


@dataclasses.dataclass(frozen=True)
class AppendResult:
    appended_tokens: int
    max_stream_tokens: int
    epoch: int
    kv_bytes: int
    table_version: int


@dataclasses.dataclass
class LogitStats:
    """Statistics of the next-token distribution: entropy (nats), top-1 and top-2
    probabilities, or instead the top-k log-probabilities (descending)."""
    entropy: float = 0.0
    p1: float = 0.0
    p2: float = 0.0
    top_logprobs: Sequence[float] = ()


@dataclasses.dataclass
class StreamSignal:
    """One stream's attention row or window scores, over its retained slots in block-table
    order."""
    layer: int
    kv_head: int
    values: Sequence[float] | np.ndarray


@dataclasses.dataclass
class StepArgs:
    """A step's signals, computed on table epoch `epoch`. Signals the sequence's policy does
    not use are not sent (for sequences this client created or forked)."""
    epoch: int = 0
    logit_stats: Optional[LogitStats] = None
    attention: Sequence[StreamSignal] = ()
    attention_f16: bool = False  # send rows as IEEE halves (half the bytes)


@dataclasses.dataclass(frozen=True)
class StepResult:
    confidence: float  # NaN when the policy computes none
    budget_tokens: Optional[int]
    evicted_tokens: int
    quantized_tokens: int
    kv_bytes_before: int
    kv_bytes_after: int
    epoch: int
    step: int
    table_version: int


@dataclasses.dataclass
class CompressArgs:
    epoch: int = 0
    target_tokens: Optional[int] = None  # per stream; None: the policy's own rule
    window_scores: Sequence[StreamSignal] = ()
    attention: Sequence[StreamSignal] = ()


@dataclasses.dataclass(frozen=True)
class LayerKept:
    layer: int
    kept_tokens: int
    before_tokens: int


@dataclasses.dataclass(frozen=True)
class CompressResult:
    layers: list[LayerKept]
    evicted_tokens: int
    quantized_tokens: int
    kv_bytes_before: int
    kv_bytes_after: int
    epoch: int
    table_version: int


@dataclasses.dataclass(frozen=True)
class WritePlan:
    """Where a sequence's next tokens go for in-place writes (kvmemd --in_place_writes)."""
    plan_id: int
    tokens: int
    block_offsets: list[int]
    first_slots: list[int]


@dataclasses.dataclass(frozen=True)
class StreamKv:
    """One stream's retained K/V as read (ReadKv or a same-host read): k and v are [n][D]
    arrays in the layout dtype (bf16 as uint16 bits)."""
    layer: int
    kv_head: int
    epoch: int
    positions: np.ndarray  # int64 [n]
    k: np.ndarray
    v: np.ndarray


@dataclasses.dataclass(frozen=True)
class SequenceStats:
    sequence_id: int
    policy: str
    appended_tokens: int
    max_stream_tokens: int
    kv_bytes: int
    blocks: int
    epoch: int
    steps: int
    lease_remaining: float
    parent_id: Optional[int]
    pool_bytes_held: int
    quantization: str
    slot_state_bytes: int


@dataclasses.dataclass(frozen=True)
class PolicyCounters:
    policy: str
    tokens_appended: int
    tokens_evicted: float
    tokens_quantized: float
    stream_slots_evicted: int
    stream_slots_quantized: int
    steps: int


@dataclasses.dataclass(frozen=True)
class Stats:
    """The daemon's counters and, when asked for, every sequence it holds (all pages)."""
    pool_bytes: int
    pool_used_bytes: int
    pool_free_bytes: int
    pages_total: int
    pages_used: int
    blocks_used: int
    sequences_active: int
    sequences_created: int
    tokens_appended: int
    tokens_evicted: float
    tokens_quantized: float
    stream_slots_evicted: int
    stream_slots_quantized: int
    policies: list[PolicyCounters]
    kv_bytes: int
    full_cache_bytes: int
    steps: int
    leases_expired: int
    slot_state_bytes: int
    host_metadata_bytes: int
    host_metadata_budget_bytes: int
    sequences_poisoned: int
    prefix_queries: int
    prefix_hits: int
    prefix_reused_tokens: int
    prefix_reclaimed_bytes: int
    prefix_entries: int
    prefix_indexed_blocks: int
    prefix_cached_blocks: int
    sequences: list[SequenceStats]
    # Blocks (and their bytes) a move kept out of use for good: a read ended with a get in
    # flight that might still write into them (0 on a healthy node).
    blocks_forsaken: int = 0
    bytes_forsaken: int = 0
