"""Client: the typed verbs of kvmemd's KvCache service, as client/cpp/kvmem/client.h has them.

Every call carries a deadline (ClientOptions.deadline) and is retried by gRPC's retry policy
(the channel's service config, exponential backoff) while the daemon answers UNAVAILABLE.
Mutating calls carry a fresh request_id per call, the same on every retry, so that a retry of
a call the daemon had applied gets its first answer instead of applying twice. A failed call
raises a kvmem.errors exception carrying the gRPC code and the daemon's google.rpc details.

The verbs here name sequences by id, as the C++ client does; Sequence (kvmem.sequence) is
the handle most code wants: it keeps its block table current, its lease renewed, and
releases itself at the end of a `with` block.

A verb given a BlockTable holds the table's update_lock from building its request until the
answer's update is applied (or the table fetched again): calls on one table from several
threads run one after another and apply in order. Tables are locked in a fixed order (by
id()), so a StepBatch naming several tables never deadlocks with another.

The daemon's ClientTable.from_area (its shared-memory table area) is not used: this client
never sets it, and a StepBatch result that names the area instead of carrying an update has
its table fetched.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
import threading
import time
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional,
                    Sequence as Seq, Tuple, TypeVar, Union)

import grpc
import numpy as np

from kvmem import convert
from kvmem.block_table import BlockTable, apply_table_update, empty_table, table_from_proto
from kvmem.errors import (AbortedError, DeadlineExceededError, KvmemError, NotFoundError,
                          ResourceExhaustedError, UnavailableError, from_grpc, from_rpc_status)
from kvmem.layout import Layout, PolicySpec
from kvmem.lease_renewer import Clock, LeaseRenewer
from kvmem.messages import (AppendResult, CompressArgs, CompressResult, Info, NewTokens, Prompt,
                            StepArgs, StepResult, Stats, StreamKv, WritePlan)
from kvmem.sequence import Sequence
from kvmem.v1 import kvmem_pb2 as pb
from kvmem.v1 import kvmem_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from kvmem.shared_pool import SharedPool

_Response = TypeVar("_Response")


def _joined(low: Optional[pb.BlockTable],
            high: Optional[pb.BlockTable]) -> Optional[pb.BlockTable]:
    """Two pieces of one table, layers in order; None unless both are of one version."""
    if low is None or high is None or low.version != high.version or low.epoch != high.epoch:
        return None
    low.streams.extend(high.streams)
    return low


@dataclasses.dataclass(frozen=True)
class ClientOptions:
    deadline: float = 30.0        # seconds per call, retries included
    max_attempts: int = 5         # on UNAVAILABLE; gRPC allows at most 5
    initial_backoff: float = 0.05
    max_backoff: float = 2.0
    # Calls made while the daemon is unreachable wait for it (up to the deadline) instead of
    # failing at once: for a sidecar that may still be starting.
    wait_for_ready: bool = False
    # Sequences keep their block tables with positions (8 bytes a retained slot per update).
    table_positions: bool = False
    # The bearer token of a kvmemd started with --auth-tokens, sent with every call
    # (metadata 'authorization: Bearer <token>'); empty: none.
    auth_token: str = ""
    # TLS (PEM bytes): tls_root_certs verifies a kvmemd started with --tls-cert; the chain and
    # key are this client's certificate (--tls-client-ca: its common name is the tenant);
    # tls_server_name: the name to verify instead of the target's host.
    tls_root_certs: bytes = b""
    tls_cert_chain: bytes = b""
    tls_private_key: bytes = b""
    tls_server_name: str = ""


@dataclasses.dataclass
class BatchEntry:
    """One sequence's decode step in a StepBatch: its new token(s), then the step. `sequence`:
    a Sequence (its table is kept current) or an id (with `table`, kept current when set)."""
    sequence: Union[Sequence, int]
    append: Optional[NewTokens] = None
    step: Optional[StepArgs] = None
    table: Optional[BlockTable] = None
    plan_tokens: int = 0  # ask for a write plan for this many next tokens (--in_place_writes)


@dataclasses.dataclass(frozen=True)
class FleetLookup:
    """Client.fleet_lookup's answer: this node's reusable tokens (as Client.lookup), and the
    nodes of the fleet's shared index holding a prefix of the prompt, longest first, as
    (node address, tokens) — this node included when it announced one."""
    matched_tokens: int
    available: bool
    unavailable: str
    holders: List[Tuple[str, int]]


@dataclasses.dataclass(frozen=True)
class PullResult:
    """Client.pull_prefix's answer: the prefix the daemon held before, the tokens it pulled
    (and published), from which node, the K+V bytes moved and how ("attach", "ucx", "grpc";
    "" when nothing was read), and the prefix the holder had (less than `min_tokens` more
    than the daemon's own: nothing pulled)."""
    local_tokens: int
    pulled_tokens: int
    from_node: str
    bytes: int
    transport: str = ""
    holder_tokens: int = 0


@dataclasses.dataclass
class BatchResult:
    """What one entry did: the append and the step are each atomic; a step that failed after
    its append applied leaves `appended` set and `error` the step's."""
    error: Optional[KvmemError]
    appended: Optional[AppendResult]
    step: Optional[StepResult]
    plan: Optional[WritePlan] = None
    plan_error: Optional[KvmemError] = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclasses.dataclass
class _Tracked:
    """What the client knows of a sequence it created or forked."""
    layout: Optional[Layout]  # None for a fork's child until its table is seen
    logit_stats: bool = True  # the step signals its policy uses
    attention_rows: bool = True


def _new_request_id() -> str:
    """128 random bits, hex: one per mutating call, repeated by its retries."""
    return secrets.token_hex(16)


@contextlib.contextmanager
def _holding(tables: Iterable[Optional[BlockTable]]) -> Iterator[None]:
    """Holds the update_lock of every distinct table given, taken in id() order."""
    with contextlib.ExitStack() as stack:
        for table in sorted({id(t): t for t in tables if t is not None}.values(), key=id):
            stack.enter_context(table.update_lock)
        yield


def _service_config(o: ClientOptions) -> str:
    # Mutating methods are safe to retry because they carry request ids.
    return json.dumps({"methodConfig": [{
        "name": [{"service": "kvmem.v1.KvCache"}],
        "retryPolicy": {
            "maxAttempts": min(o.max_attempts, 5),
            "initialBackoff": f"{o.initial_backoff}s",
            "maxBackoff": f"{o.max_backoff}s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        }}]})


class Client:
    """A connection to kvmemd. target: "host:port" or "unix:/path". Connecting is lazy: the
    first call waits for it. Thread-safe; close() it (or use it as a context manager).
    `clock`: the lease renewer's (monotonic seconds; tests inject one)."""

    def __init__(self, target: str, options: ClientOptions = ClientOptions(), *,
                 clock: Clock = time.monotonic) -> None:
        if not target:
            raise ValueError("target: empty address")
        if not 1 <= options.max_attempts <= 5:
            raise ValueError("options.max_attempts: must be in [1, 5] (gRPC's limit)")
        self.target = target
        self.options = options
        channel_options: list[tuple[str, Any]] = [("grpc.max_receive_message_length", -1),
                                                  ("grpc.max_send_message_length", -1)]
        if options.max_attempts > 1:
            channel_options += [("grpc.enable_retries", 1),
                                ("grpc.service_config", _service_config(options))]
        o = self.options
        if o.tls_root_certs:
            credentials = grpc.ssl_channel_credentials(
                o.tls_root_certs, o.tls_private_key or None, o.tls_cert_chain or None)
            if o.tls_server_name:
                channel_options = [*channel_options,
                                   ("grpc.ssl_target_name_override", o.tls_server_name)]
            self._channel = grpc.secure_channel(target, credentials, options=channel_options)
        elif o.tls_cert_chain or o.tls_private_key:
            raise ValueError("tls_cert_chain: a client certificate needs tls_root_certs (TLS) too")
        else:
            self._channel = grpc.insecure_channel(target, options=channel_options)
        self._stub = pb_grpc.KvCacheStub(self._channel)
        self._lock = threading.Lock()
        self._tracked: dict[int, _Tracked] = {}  # live sequences (released at close())
        self._policy_needs: Optional[dict[str, tuple[bool, bool]]] = None
        self._max_sequences = 0
        self._closing = False
        self._closed = False
        self.table_refetches = 0  # tables fetched whole because an update could not apply
        self._renewer = LeaseRenewer(self._keep_alive_quiet, lambda: self._max_sequences or 1024,
                                     clock)

    # ---- lifetime --------------------------------------------------------------------------

    def close(self, release_sequences: bool = True) -> None:
        """Releases the sequences still open through this client (best effort, without
        waiting for a daemon that is not there: a daemon that is gone lets their leases lapse
        instead), stops the lease renewer and closes the channel. Takes at most about one
        call's deadline (a daemon that accepts the releases but hangs); a KeepAlive in flight
        is cancelled by closing the channel. Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            still_open = sorted(self._tracked)
        self._renewer.stop()
        try:
            if release_sequences:
                for sequence_id in still_open:
                    try:
                        self._release(sequence_id, wait_for_ready=False)
                    except (UnavailableError, DeadlineExceededError):
                        break  # the daemon is gone or stuck: nothing else will get through
                    except KvmemError:
                        pass
        finally:
            with self._lock:
                self._closed = True
                self._tracked.clear()
            self._channel.close()  # cancels the renewer's KeepAlive if one is in flight
            self._renewer.join()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def live_sequences(self) -> list[int]:
        """Ids of the sequences this client created or forked and has not released."""
        with self._lock:
            return sorted(self._tracked)

    @property
    def renewer_running(self) -> bool:
        return self._renewer.running

    # ---- the call machinery ----------------------------------------------------------------

    def _call(self, method: Callable[..., _Response], request: Any,
              wait_for_ready: Optional[bool] = None) -> _Response:
        if self._closed:
            raise UnavailableError("the client is closed", code=grpc.StatusCode.UNAVAILABLE)
        kwargs: Dict[str, Any] = {
            "timeout": self.options.deadline,
            "wait_for_ready": self.options.wait_for_ready if wait_for_ready is None
            else wait_for_ready}
        if self.options.auth_token:
            kwargs["metadata"] = (("authorization", "Bearer " + self.options.auth_token),)
        try:
            return method(request, **kwargs)
        except grpc.RpcError as e:
            raise from_grpc(e) from None

    def _track(self, sequence_id: int, layout: Optional[Layout], policy: str) -> None:
        needs = (self._policy_needs or {}).get(policy, (True, True))
        with self._lock:
            self._tracked[sequence_id] = _Tracked(layout, *needs)

    def _untrack(self, sequence_id: int) -> None:
        with self._lock:
            self._tracked.pop(sequence_id, None)
        self._renewer.unregister(sequence_id)

    def tracks(self, sequence_id: int) -> bool:
        """Whether the sequence is live as far as this client knows (created or forked here,
        not released, not dropped)."""
        with self._lock:
            return sequence_id in self._tracked

    def _layout_of(self, sequence_id: int, table: Optional[BlockTable]) -> Optional[Layout]:
        if table is not None and table.version != 0:
            return table.layout
        with self._lock:
            tracked = self._tracked.get(sequence_id)
        return tracked.layout if tracked else None

    def _needs(self, sequence_id: int) -> tuple[bool, bool]:
        with self._lock:
            tracked = self._tracked.get(sequence_id)
        return (tracked.logit_stats, tracked.attention_rows) if tracked else (True, True)

    def _learn_policies(self) -> None:
        if self._policy_needs is not None:
            return
        try:
            info = self.get_info()
        except KvmemError:
            return  # every signal is sent, as for a sequence of another client
        self._policy_needs = {p.name: ("logit_stats" in p.step_signals,
                                       "attention_rows" in p.step_signals)
                              for p in info.policies}

    def _sync(self, sequence_id: int, update: pb.TableUpdate, table: BlockTable) -> None:
        """Applies a call's table update; when it cannot apply (none came, or it does not
        check out against the table), fetches the whole table instead. The caller holds
        table.update_lock."""
        if apply_table_update(sequence_id, update, table):
            return
        with self._lock:
            self.table_refetches += 1
        try:
            fresh = self.get_block_table(sequence_id, table.positions)
        except KvmemError:
            # The call itself applied: the table held is no longer the sequence's.
            table.forget()
            return
        table.assign(fresh)
        self._note_layout(sequence_id, table)

    def _note_layout(self, sequence_id: int, table: BlockTable) -> None:
        with self._lock:
            tracked = self._tracked.get(sequence_id)
            if tracked is not None and table.version != 0:
                tracked.layout = table.layout

    def _hold(self, table: Optional[BlockTable], out: pb.ClientTable) -> None:
        if table is not None:
            out.version = table.version
            out.positions = table.positions

    # ---- verbs -----------------------------------------------------------------------------

    def get_info(self) -> Info:
        info = convert.info_of(self._call(self._stub.GetInfo, pb.GetInfoRequest()))
        self._max_sequences = info.max_sequences
        return info

    def create_sequence(self, layout: Layout, policy: PolicySpec = PolicySpec(), *,
                        lease: Optional[float] = None, prompt: Optional[Prompt] = None,
                        table_positions: Optional[bool] = None) -> Sequence:
        """A new sequence (lease None: the daemon's --lease_seconds), its lease renewed in the
        background until it is released. With `prompt`, its longest published prefix is
        mapped in (Sequence.reused_prefix_tokens)."""
        self._learn_policies()
        q = pb.CreateSequenceRequest()
        convert.fill_layout(layout, q.layout)
        convert.fill_policy(policy, q.policy)
        if lease is not None:
            convert.duration_of(lease, q.lease)
        if prompt is not None:
            q.prompt_token_ids.extend(int(t) for t in prompt.token_ids)
            q.cache_salt = prompt.cache_salt
            q.model = prompt.model
            q.auto_publish = prompt.auto_publish
            q.document_tokens = prompt.document_tokens
        q.request_id = _new_request_id()
        r = self._call(self._stub.CreateSequence, q)
        layout = dataclasses.replace(layout, block_tokens=r.block_tokens)
        self._track(r.sequence_id, layout, policy.name or "full")
        positions = self.options.table_positions if table_positions is None else table_positions
        return self._open_sequence(r.sequence_id, convert.seconds_of(r.lease), r.epoch_slot,
                                   r.epoch, r.table_version, r.reused_prefix_tokens,
                                   empty_table(r.sequence_id, positions), parent=None)

    def _open_sequence(self, sequence_id: int, lease: float, epoch_slot: int, epoch: int,
                       table_version: int, reused: int, table: BlockTable,
                       parent: Optional[int]) -> Sequence:
        seq = Sequence(self, sequence_id, lease, epoch_slot, epoch, table_version, reused, table,
                       parent)
        self._renewer.register(sequence_id, lease)
        return seq

    def append(self, sequence_id: int, tokens: NewTokens,
               table: Optional[BlockTable] = None) -> AppendResult:
        """Appends n tokens; `table`, when set, is kept current."""
        with _holding([table]):
            q = pb.AppendRequest(sequence_id=sequence_id)
            convert.fill_tokens(tokens, self._layout_of(sequence_id, table), q)
            self._hold(table, q.client_table)
            q.request_id = _new_request_id()
            r = self._call(self._stub.Append, q)
            if table is not None:
                self._sync(sequence_id, r.table_update, table)
        return convert.append_result_of(r)

    def append_stream(self, sequence_id: int, chunks: Iterable[NewTokens],
                      table: Optional[BlockTable] = None) -> AppendResult:
        """One client stream of chunks (a long prefill); the daemon applies all or none."""
        request_id = _new_request_id()
        with _holding([table]):
            layout = self._layout_of(sequence_id, table)

            def requests() -> Iterable[pb.AppendStreamRequest]:
                for i, chunk in enumerate(chunks):
                    q = pb.AppendStreamRequest(sequence_id=sequence_id)
                    convert.fill_tokens(chunk, layout, q)
                    if i == 0:
                        q.request_id = request_id
                        self._hold(table, q.client_table)
                    yield q

            r = self._call(self._stub.AppendStream, requests())
            if table is not None:
                self._sync(sequence_id, r.table_update, table)
        return convert.append_result_of(r)

    def step(self, sequence_id: int, args: StepArgs,
             table: Optional[BlockTable] = None) -> StepResult:
        """One decode step's signals; those the sequence's policy does not use are not sent."""
        q = pb.StepRequest(sequence_id=sequence_id)
        convert.fill_step_signals(args, *self._needs(sequence_id), q)
        q.request_id = _new_request_id()
        with _holding([table]):
            self._hold(table, q.client_table)
            r = self._call(self._stub.Step, q)
            if table is not None:
                self._sync(sequence_id, r.table_update, table)
        return convert.step_result_of(r)

    def step_batch(self, entries: Seq[BatchEntry]) -> list[BatchResult]:
        """The decode loop's call: every entry's append and step in one round trip; one
        result per entry, in order. An entry's error fails only that entry (BatchResult.error);
        the call raises only when the batch as a whole is malformed or does not arrive."""
        resolved: list[tuple[int, Optional[BlockTable]]] = []
        for e in entries:
            table: Optional[BlockTable] = e.table
            if isinstance(e.sequence, Sequence):
                sequence_id, table = e.sequence.id, table or e.sequence.table
            else:
                sequence_id = int(e.sequence)
            resolved.append((sequence_id, table))
        with _holding(table for _, table in resolved):
            q = pb.StepBatchRequest()
            for e, (sequence_id, table) in zip(entries, resolved):
                entry = q.entries.add(sequence_id=sequence_id)
                if e.append is not None:
                    convert.fill_tokens(e.append, self._layout_of(sequence_id, table),
                                        entry.append)
                if e.step is not None:
                    convert.fill_step_signals(e.step, *self._needs(sequence_id), entry.step)
                self._hold(table, entry.client_table)  # never from_area (the module's doc)
                if e.plan_tokens:
                    entry.plan_tokens = e.plan_tokens
            q.request_id = _new_request_id()
            r = self._call(self._stub.StepBatch, q)
            if len(r.results) != len(entries):
                raise KvmemError(
                    f"StepBatch: {len(r.results)} results for {len(entries)} entries",
                    code=grpc.StatusCode.INTERNAL)
            return [self._batch_result(result, sequence_id, table)
                    for result, (sequence_id, table) in zip(r.results, resolved)]

    def _batch_result(self, result: pb.StepBatchResult, sequence_id: int,
                      table: Optional[BlockTable]) -> BatchResult:
        out = BatchResult(
            from_rpc_status(result.status),
            convert.append_result_of(result.append) if result.HasField("append") else None,
            convert.step_result_of(result.step) if result.HasField("step") else None)
        if result.HasField("plan"):
            p = result.plan
            out.plan = WritePlan(p.plan_id, p.tokens, list(p.block_offsets), list(p.first_slots))
        if result.HasField("plan_status"):
            out.plan_error = from_rpc_status(result.plan_status)
        # An entry of which something applied but that came back without an update (the
        # batch's updates passed the daemon's message limit), or that names the table area
        # instead (which this client does not read), has its table fetched: _sync finds no
        # update to apply.
        applied = result.status.code == 0 or result.HasField("append") or \
            result.table_in_area != 0
        if table is not None and (result.HasField("table_update") or applied):
            self._sync(sequence_id, result.table_update, table)
        return out

    def compress(self, sequence_id: int, args: CompressArgs,
                 table: Optional[BlockTable] = None) -> CompressResult:
        """Explicit compression (after a prefill, every N tokens) by the policy's rule or to
        args.target_tokens per stream."""
        q = pb.CompressRequest(sequence_id=sequence_id, epoch=args.epoch)
        if args.target_tokens is not None:
            q.target_tokens = args.target_tokens
        convert.add_rows(args.window_scores, q.window_scores)
        convert.add_rows(args.attention, q.attention)
        q.request_id = _new_request_id()
        with _holding([table]):
            self._hold(table, q.client_table)
            r = self._call(self._stub.Compress, q)
            if table is not None:
                self._sync(sequence_id, r.table_update, table)
        return convert.compress_result_of(r)

    def get_block_table(self, sequence_id: int, positions: bool = True) -> BlockTable:
        """The whole table: to attach to a sequence, or to recover. A table too large for one
        message (kvmemd's --max-message-bytes) is asked for in pieces of layers and joined
        here; pieces of different versions (the sequence changed meanwhile) are asked again."""
        for _ in range(3):
            table = self._table_piece(sequence_id, positions, None)
            if table is not None:
                return table_from_proto(table)
        raise AbortedError("GetBlockTable: the table changed between its pieces",
                           code=grpc.StatusCode.ABORTED)

    def _table_piece(self, sequence_id: int, positions: bool,
                     layers: Optional[tuple[int, int]]) -> Optional[pb.BlockTable]:
        """Layers [begin, end) of the table (None: all), in halves while a piece is too large;
        None when two pieces are of different versions."""
        q = pb.GetBlockTableRequest(sequence_id=sequence_id, positions=positions)
        if layers is not None:
            q.layers.begin, q.layers.end = layers
        try:
            return self._call(self._stub.GetBlockTable, q).table
        except ResourceExhaustedError as e:
            if not str(e.message).startswith("layers:") or (
                    layers is not None and layers[1] - layers[0] < 2):
                raise
        if layers is None:  # the first layer tells how many there are
            first = self._table_piece(sequence_id, positions, (0, 1))
            num_layers = first.layout.num_layers if first is not None else 0
            if first is None or num_layers == 1:
                return first
            return _joined(first, self._table_piece(sequence_id, positions, (1, num_layers)))
        middle = (layers[0] + layers[1]) // 2
        low = self._table_piece(sequence_id, positions, (layers[0], middle))
        if low is None:
            return None
        return _joined(low, self._table_piece(sequence_id, positions, (middle, layers[1])))

    def read_kv(self, sequence_id: int, epoch: Optional[int] = None,
                layers: Optional[tuple[int, int]] = None) -> list[StreamKv]:
        """Retained K/V of layers [begin, end) (None: all) if the table is at `epoch` (None: the
        current one): one StreamKv per stream, layer-major, k and v [n][D] numpy arrays in the
        layout dtype. StaleEpochError when the table is not at `epoch` (FAILED_PRECONDITION)
        or when it changed during the read (ABORTED: still a StaleEpochError, which is a
        FailedPreconditionError, never an AbortedError): read again."""
        q = pb.ReadKvRequest(sequence_id=sequence_id)
        if epoch is not None:
            q.epoch = epoch
        if layers is not None:
            q.layers.begin, q.layers.end = layers
        layout = self._layout_of(sequence_id, None)
        pieces: list[tuple[pb.ReadKvResponse, list[bytes], list[bytes], list[Any]]] = []
        try:
            for chunk in self._call(self._stub.ReadKv, q):
                if chunk.first_slot > 0:
                    # A stream comes in pieces, in order: a piece past a stream's first
                    # continues it.
                    head, ks, vs, ps = pieces[-1] if pieces else (None, [], [], [])
                    held = sum(len(p) for p in ps)
                    if head is None or (head.layer, head.kv_head) != (chunk.layer,
                                                                      chunk.kv_head) \
                            or held != chunk.first_slot:
                        raise KvmemError(
                            f"ReadKv: a piece of stream (layer {chunk.layer}, kv_head "
                            f"{chunk.kv_head}) at slot {chunk.first_slot} does not continue "
                            "the read", code=grpc.StatusCode.INTERNAL)
                    ks.append(chunk.k)
                    vs.append(chunk.v)
                    ps.append(chunk.positions)
                    continue
                pieces.append((chunk, [chunk.k], [chunk.v], [chunk.positions]))
        except grpc.RpcError as e:  # raised while iterating the stream
            raise from_grpc(e) from None
        if layout is None:
            layout = self.get_block_table(sequence_id, positions=False).layout
        out = []
        for head, ks, vs, ps in pieces:
            positions = np.concatenate([np.asarray(part, dtype="<i8") for part in ps])
            out.append(StreamKv(head.layer, head.kv_head, head.epoch, positions,
                                convert.kv_array(b"".join(ks), layout.dtype, layout.head_dim),
                                convert.kv_array(b"".join(vs), layout.dtype, layout.head_dim)))
        return out

    def fork(self, sequence_id: int, lease: Optional[float] = None,
             table_positions: Optional[bool] = None,
             parent_table: Optional[BlockTable] = None) -> Sequence:
        """A copy-on-write child (lease None: the daemon's --lease_seconds). `parent_table`:
        the parent's table as held, carried over to the child when it is the one forked."""
        q = pb.ForkRequest(sequence_id=sequence_id)
        if lease is not None:
            convert.duration_of(lease, q.lease)
        q.request_id = _new_request_id()
        positions = self.options.table_positions if table_positions is None else table_positions
        # The parent's table may not change between the fork and its copy.
        with _holding([parent_table]):
            r = self._call(self._stub.Fork, q)
            table = empty_table(r.sequence_id, positions)
            if parent_table is not None and parent_table.sequence_id == sequence_id and \
                    parent_table.version == r.table_version and \
                    parent_table.positions == positions:
                # The child's table starts as the parent's at the fork (kvmem.proto
                # ForkResponse): carried over under the child's id, epoch and slot; the
                # child's deltas follow. Updates replace streams, never change them in place:
                # sharing them is safe.
                table = dataclasses.replace(parent_table, sequence_id=r.sequence_id,
                                            epoch=r.epoch, epoch_slot=r.epoch_slot,
                                            streams=list(parent_table.streams))
        with self._lock:
            parent = self._tracked.get(sequence_id)
            self._tracked[r.sequence_id] = dataclasses.replace(parent) if parent else \
                _Tracked(None)
        return self._open_sequence(r.sequence_id, convert.seconds_of(r.lease), r.epoch_slot,
                                   r.epoch, r.table_version, 0, table, parent=sequence_id)

    def release(self, sequence_id: int) -> int:
        """Releases the sequence; returns the blocks whose last reference this dropped. A
        sequence already gone raises NotFoundError (and is forgotten all the same)."""
        return self._release(sequence_id)

    def _release(self, sequence_id: int, wait_for_ready: Optional[bool] = None) -> int:
        q = pb.ReleaseRequest(sequence_id=sequence_id, request_id=_new_request_id())
        try:
            r = self._call(self._stub.Release, q, wait_for_ready)
        except NotFoundError:
            self._untrack(sequence_id)
            raise
        self._untrack(sequence_id)
        return r.freed_blocks

    def keep_alive(self, sequence_ids: Seq[int]) -> list[Optional[KvmemError]]:
        """Renews each id's lease: per id, None when renewed, else why not (NotFoundError,
        DataLossError). At most GetInfo's max_sequences ids a call."""
        r = self._call(self._stub.KeepAlive,
                       pb.KeepAliveRequest(sequence_ids=[int(i) for i in sequence_ids]))
        return [from_rpc_status(one.status) for one in r.results]

    def _keep_alive_quiet(self, sequence_ids: Seq[int]) -> list[Optional[KvmemError]]:
        return self.keep_alive(sequence_ids) if not self._closed else [None] * len(sequence_ids)

    def lapsed(self, sequence_id: int) -> Optional[KvmemError]:
        """Why the lease renewer found the sequence gone (NOT_FOUND, DATA_LOSS), if it did."""
        return self._renewer.lapsed(sequence_id)

    def stats(self, include_sequences: bool = False) -> Stats:
        """The daemon's counters and, with include_sequences, every sequence (all pages;
        counters as of the first page)."""
        q = pb.StatsRequest(include_sequences=include_sequences)
        if include_sequences:
            q.page_size = 1000  # the largest page the daemon gives: the fewest round trips
        first: Optional[pb.StatsResponse] = None
        sequences = []
        while True:
            r = self._call(self._stub.Stats, q)
            first = first or r
            sequences += [convert.sequence_stats_of(s) for s in r.sequences]
            if not r.next_page_token:
                return convert.stats_of(first, sequences)
            if r.next_page_token == q.page_token:
                raise KvmemError("Stats: the daemon answered the same page token again",
                                 code=grpc.StatusCode.INTERNAL)
            q.page_token = r.next_page_token

    def publish(self, sequence_id: int, up_to_tokens: Optional[int] = None) -> int:
        """Publishes the sequence's leading whole blocks (up to `up_to_tokens`; None: all) for
        later sequences with the same prompt prefix; returns the tokens published so far."""
        q = pb.PublishRequest(sequence_id=sequence_id)
        if up_to_tokens is not None:
            q.up_to_tokens = up_to_tokens
        return self._call(self._stub.Publish, q).published_tokens

    def publish_document(self, sequence_id: int) -> int:
        """Publishes the sequence's whole cache, just compressed, as a shared compressed
        document (Prompt.document_tokens); returns its tokens."""
        q = pb.PublishRequest(sequence_id=sequence_id, compressed_document=True)
        return self._call(self._stub.Publish, q).published_tokens

    def lookup(self, layout: Layout, prompt: Prompt, policy: PolicySpec = PolicySpec()) -> int:
        """How many tokens of the prompt a create_sequence with `policy` would reuse now (pins
        nothing)."""
        q = pb.LookupRequest(cache_salt=prompt.cache_salt, model=prompt.model,
                             document_tokens=prompt.document_tokens)
        convert.fill_layout(layout, q.layout)
        convert.fill_policy(policy, q.policy)
        q.token_ids.extend(int(t) for t in prompt.token_ids)
        return self._call(self._stub.Lookup, q).matched_tokens

    def fleet_lookup(self, layout: Layout, prompt: Prompt,
                     policy: PolicySpec = PolicySpec()) -> "FleetLookup":
        """Lookup, and which nodes of the fleet hold the prompt's longest prefix, from the
        shared index (kvmemd --cluster-index; FailedPreconditionError without one). The
        fleet's part is `available` False, with the reason, when the index could not answer
        in time; the local part never waits for it."""
        q = pb.LookupRequest(cache_salt=prompt.cache_salt, model=prompt.model,
                             document_tokens=prompt.document_tokens, fleet=True)
        convert.fill_layout(layout, q.layout)
        convert.fill_policy(policy, q.policy)
        q.token_ids.extend(int(t) for t in prompt.token_ids)
        r = self._call(self._stub.Lookup, q)
        return FleetLookup(r.matched_tokens, r.fleet.available, r.fleet.unavailable,
                           [(h.node, h.matched_tokens) for h in r.fleet.holders])

    def pull_prefix(self, layout: Layout, prompt: Prompt, from_node: str = "",
                    transport: str = "", min_tokens: int = 0) -> "PullResult":
        """Makes the daemon hold the longest prefix of the prompt another node of the fleet
        holds (kvmemd --cluster-index), pulled from that node (`from_node`, else the one the
        fleet's index names), so that the next create_sequence maps it. `transport`:
        "attach" (the holder's pool mapped: the same host), "ucx", "grpc", or "" (the first
        of these the daemon can); `min_tokens`: pull only a gain of at least that many tokens
        (a smaller one is cheaper to compute)."""
        q = pb.PullPrefixRequest(cache_salt=prompt.cache_salt, model=prompt.model,
                                 from_node=from_node, transport=transport,
                                 min_tokens=min_tokens)
        convert.fill_layout(layout, q.layout)
        q.token_ids.extend(int(t) for t in prompt.token_ids)
        r = self._call(self._stub.PullPrefix, q)
        return PullResult(r.local_tokens, r.pulled_tokens, r.from_node, r.bytes, r.transport,
                          r.holder_tokens)

    def move_sequence(self, from_node: str, sequence_id: int, lease: Optional[float] = None,
                      transport: str = "", table_positions: Optional[bool] = None) -> Sequence:
        """Moves sequence `sequence_id` of another node of the daemon's fleet (`from_node`,
        one of its --cluster_peers) to this daemon, whole (blocks at their precision, scores,
        history), so that its next step decides what the holder's would have; the holder
        releases its copy. `transport`: "attach" (the holder's pool mapped, on the same
        host), "ucx", "grpc", or "" (the first of those the daemon can).
        Returns the sequence here: a new id and table."""
        q = pb.MoveSequenceRequest(from_node=from_node, sequence_id=sequence_id,
                                   transport=transport, request_id=_new_request_id())
        if lease is not None:
            convert.duration_of(lease, q.lease)
        r = self._call(self._stub.MoveSequence, q)
        self._track(r.sequence_id, convert.layout_of(r.layout), r.policy)
        positions = self.options.table_positions if table_positions is None else table_positions
        return self._open_sequence(r.sequence_id, convert.seconds_of(r.lease), r.epoch_slot,
                                   r.epoch, r.table_version, 0,
                                   empty_table(r.sequence_id, positions), parent=None)

    def attach_shared_pool(self) -> SharedPool:
        """The daemon's pool mapped read-only, for same-host reads (kvmem.shared_pool);
        FailedPreconditionError off x86-64 or when the daemon exports no pool."""
        from kvmem.shared_pool import SharedPool  # noqa: PLC0415 (POSIX only)

        return SharedPool.attach(self.get_info())
