"""Same-host, zero-copy reads of a CPU-backend daemon's pool, as client/cpp/kvmem/shared_pool.h.

The pool segment and the epoch board are mapped read-only; they have no names: GetInfo's
attach ticket is redeemed at kvmemd's attach socket for their descriptors. Blocks named by a BlockTable are
numpy views into the mapping; what a view shows is trustworthy only if the sequence's epoch
word equals 2 * epoch both before and after the read (a seqlock: the daemon holds the word
odd while it rewrites the sequence's blocks, and frees no block while a table naming it can
still validate). The table can change while it is read (another thread's call applies its
update), so begin_read takes one snapshot of it (slot, epoch, streams): the views are built
from that snapshot and end_read checks against it. Protocol:

    with pool.reading(seq.table) as blocks:     # StaleEpochError: refresh the table first
        k = blocks.stream(layer, kv_head)[0].k  # views: copy what you keep
    # leaving the block checks the epoch again: StaleEpochError means discard what was read;
    # blocks.stream() raises from then on

or pool.read_stream(table, layer, kv_head), which copies out under the protocol.

Memory ordering: the epoch word is read as one aligned 8-byte load, and the reads of the
data and of the epoch words are plain loads with no fence between them (numpy has none to
offer). That is correct only where the CPU keeps loads in order with other loads: x86-64
(TSO). Elsewhere (ARM, POWER) the data could be read after the second epoch check has
passed, so attach() refuses with FailedPreconditionError there; ReadKv (Client.read_kv) is
the way to read on such a host.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import mmap
import os
import platform
import socket
import struct
from typing import Iterator, Optional, Union

import grpc
import numpy as np

from kvmem.block_table import BlockTable, StreamTable, TableSnapshot
from kvmem.errors import (FailedPreconditionError, InvalidArgumentError, KvmemError,
                          OutOfRangeError, StaleEpochError, UnavailableError, error_of)
from kvmem.layout import Precision
from kvmem.messages import Info, StreamKv
from kvmem.quantize import QuantGeometry, dequantize_block

# Where loads are not reordered with other loads, so a seqlock needs no reader fence.
_ORDERED_LOADS = ("x86_64", "amd64")


def _require_ordered_loads() -> None:
    machine = platform.machine()
    if machine.lower() not in _ORDERED_LOADS:
        raise FailedPreconditionError(
            f"shared_pool: zero-copy reads need x86-64; on {machine or 'this CPU'} loads may "
            "be reordered and numpy offers no acquire fence, so a read could pass its epoch "
            "check on data the daemon was rewriting: use Client.read_kv")


# kvmemd's attach socket (proto/kvmem/v1/attach.h): a ticket from GetInfo redeemed for the
# segments' descriptors.
_ATTACH_MAGIC = 0x4B564154
_ATTACH_VERSION = 1
_ATTACH_REQUEST = struct.Struct("<II32s")
_ATTACH_REPLY = struct.Struct("<IIII" + "IIQ" * 4 + "256s")
_SEGMENT_POOL, _SEGMENT_EPOCH_BOARD = 1, 2


def _map_read_only(info: Info, kind: int, size: int, what: str) -> mmap.mmap:
    """Redeems info's attach ticket at the daemon's attach socket and maps the segment of
    `kind` (at least `size` bytes) read-only (mmap(PROT_READ, MAP_SHARED))."""
    if len(info.attach_ticket) != 32 or len(info.attach_socket) < 2:
        raise FailedPreconditionError(f"{what}: the daemon gave no attach ticket (same-host "
                                      "attach is not offered to this caller)")
    address = info.attach_socket
    if address.startswith("@"):
        address = "\0" + address[1:]
    fds: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(5)
            s.connect(address)
            if info.attach_daemon_uid is not None:
                _, uid, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
                if uid != info.attach_daemon_uid:
                    raise UnavailableError(
                        f"{what}: the attach socket {info.attach_socket} is held by uid {uid}, "
                        f"not the daemon's {info.attach_daemon_uid} (the daemon is gone?)",
                        code=grpc.StatusCode.UNAVAILABLE)
            s.send(_ATTACH_REQUEST.pack(_ATTACH_MAGIC, _ATTACH_VERSION, info.attach_ticket))
            # Close-on-exec from the start: a fork in another thread inherits none.
            data, fds, _, _ = socket.recv_fds(s, _ATTACH_REPLY.size, 4, socket.MSG_CMSG_CLOEXEC)
    except OSError as e:
        raise UnavailableError(f"{what}: the daemon's attach socket {info.attach_socket}: {e} "
                               "(is the daemon on this host?)",
                               code=grpc.StatusCode.UNAVAILABLE) from None
    try:
        if len(data) != _ATTACH_REPLY.size:
            raise UnavailableError(f"{what}: no answer from the daemon's attach socket",
                                   code=grpc.StatusCode.UNAVAILABLE)
        fields = _ATTACH_REPLY.unpack(data)
        magic, version, code, count = fields[:4]
        if magic != _ATTACH_MAGIC or version != _ATTACH_VERSION:
            raise UnavailableError(f"{what}: no answer from the daemon's attach socket",
                                   code=grpc.StatusCode.UNAVAILABLE)
        if code != 0:
            message = fields[-1].split(b"\0", 1)[0].decode(errors="replace")
            raise error_of(grpc.StatusCode(_STATUS_CODES[code]) if code in _STATUS_CODES
                           else grpc.StatusCode.UNKNOWN,
                           f"{what}: kvmemd refused the attach: {message}")
        if count != len(fds):
            raise UnavailableError(f"{what}: the daemon's descriptors did not arrive",
                                   code=grpc.StatusCode.UNAVAILABLE)
        for i in range(count):
            granted_kind, _, granted_bytes = fields[4 + 3 * i:7 + 3 * i]
            if granted_kind != kind:
                continue
            if granted_bytes < size or os.fstat(fds[i]).st_size < size:
                raise FailedPreconditionError(f"{what}: smaller than the {size} bytes announced")
            # One that could shrink later would fault (SIGBUS) under a read: kvmemd seals
            # every segment's size.
            try:
                seals = fcntl.fcntl(fds[i], fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            if not seals & fcntl.F_SEAL_SHRINK:
                raise FailedPreconditionError(
                    f"{what}: its size is not sealed (it could shrink under a read)")
            try:
                return mmap.mmap(fds[i], size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            except (OSError, ValueError) as e:
                raise UnavailableError(f"{what}: mmap: {e}",
                                       code=grpc.StatusCode.UNAVAILABLE) from None
        raise FailedPreconditionError(f"{what}: the ticket grants no such segment")
    finally:
        for fd in fds:
            os.close(fd)


# google.rpc.Code -> grpc.StatusCode
_STATUS_CODES = {c.value[0]: c for c in grpc.StatusCode}


class EpochReader:
    """The daemon's per-sequence epoch words, mapped read-only."""

    def __init__(self, info: Info) -> None:
        if info.epoch_stride == 0 or info.epoch_slots == 0:
            raise FailedPreconditionError("epoch_board: the daemon advertises none")
        if info.epoch_stride % 8:
            raise FailedPreconditionError(
                f"epoch_board.stride: {info.epoch_stride} is not a multiple of 8")
        self._map = _map_read_only(info, _SEGMENT_EPOCH_BOARD,
                                   info.epoch_stride * info.epoch_slots, "epoch_board")
        self._words = np.frombuffer(self._map, dtype="<u8")
        self._step = info.epoch_stride // 8
        self.slots = info.epoch_slots

    def word(self, slot: int) -> int:
        return int(self._words[slot * self._step])

    def begin_read(self, table: Union[BlockTable, TableSnapshot]) -> TableSnapshot:
        """The table's snapshot, when the sequence is at its epoch; StaleEpochError when it
        is not (fetch the table again)."""
        snap = table.snapshot() if isinstance(table, BlockTable) else table
        if snap.epoch == 0:
            raise StaleEpochError("epoch: the table holds no epoch (none fetched, or its last "
                                  "update was lost); fetch the block table again",
                                  code=grpc.StatusCode.FAILED_PRECONDITION)
        if not 0 <= snap.epoch_slot < self.slots:
            raise InvalidArgumentError(
                f"table.epoch_slot: {snap.epoch_slot} is outside [0, {self.slots})")
        word = self.word(snap.epoch_slot)
        if word != 2 * snap.epoch:
            where = "being rewritten or released" if word & 1 else f"at epoch {word // 2}"
            raise _stale(f"epoch: the table is at epoch {snap.epoch} but the sequence is "
                         f"{where}; fetch the block table again", word)
        return snap

    def end_read(self, snap: TableSnapshot) -> None:
        """StaleEpochError when the sequence left the snapshot's epoch since begin_read."""
        word = self.word(snap.epoch_slot)
        if word != 2 * snap.epoch:
            raise _stale(f"epoch: the sequence left epoch {snap.epoch} during the read; "
                         "discard it", word)

    def close(self) -> None:
        self._words = np.zeros(0, dtype="<u8")
        _close_map(self._map)


def _stale(message: str, word: int) -> StaleEpochError:
    e = StaleEpochError(message, code=grpc.StatusCode.FAILED_PRECONDITION)
    if not word & 1:
        e.current_epoch = word // 2
    return e


def _close_map(m: mmap.mmap) -> None:
    try:
        m.close()
    except BufferError:
        pass  # numpy views of it are still alive: the mapping goes when the last one does


@dataclasses.dataclass(frozen=True)
class BlockView:
    """One block of a stream as mapped. Layout precision: k and v are [count][D] views of the
    live slots in the layout dtype (bf16 as uint16). Quantized: `block` is the whole block's
    bytes (kvmem.quantize layout) and k, v are None."""
    k: Optional[np.ndarray]
    v: Optional[np.ndarray]
    block: np.ndarray
    start: int
    count: int
    precision: Precision


class _Reading:
    """What `SharedPool.reading` yields: stream views of one snapshot, under one epoch check.
    Once the block has exited (its check made or skipped), stream() raises."""

    def __init__(self, pool: SharedPool, snap: TableSnapshot) -> None:
        self._pool = pool
        self._snap = snap
        self._open = True

    @property
    def table(self) -> TableSnapshot:
        """The snapshot the views come from (its epoch and streams)."""
        return self._snap

    def stream(self, layer: int, kv_head: int) -> list[BlockView]:
        if not self._open:
            raise FailedPreconditionError(
                "reading: the block has exited, so its views are no longer checked; read "
                "inside the block (and copy what is kept) or begin a new read")
        return self._pool.stream_blocks(self._snap, layer, kv_head)

    def _close(self) -> None:
        self._open = False


class SharedPool:
    """A CPU-backend daemon's pool and epoch board, mapped read-only."""

    def __init__(self, info: Info, pool: mmap.mmap, epochs: EpochReader) -> None:
        self._map = pool
        self._bytes = np.frombuffer(pool, dtype=np.uint8)
        # The mapping holds pool bytes [_lo, _lo + size): the whole pool, or with tenant
        # arenas the piece this caller was given; offsets are taken back by _lo.
        self._lo = info.shm_piece_offset
        self.size = info.shm_piece_bytes or info.shm_bytes
        self.epochs = epochs

    @staticmethod
    def attach(info: Info) -> SharedPool:
        """FailedPreconditionError off x86-64 (see the module's docstring on memory
        ordering) or when the daemon exports no pool."""
        _require_ordered_loads()
        if not info.shm_bytes:
            raise FailedPreconditionError(
                f"shared_memory: the daemon's {info.backend} backend does not export its pool")
        piece = info.shm_piece_bytes or info.shm_bytes
        if info.shm_piece_offset < 0 or info.shm_piece_offset + piece > info.shm_bytes:
            raise FailedPreconditionError(
                f"shared_memory: the daemon's piece [{info.shm_piece_offset}, +{piece}) lies "
                f"outside its pool of {info.shm_bytes} bytes")
        epochs = EpochReader(info)
        try:
            pool = _map_read_only(info, _SEGMENT_POOL, piece, "shared_memory")
        except KvmemError:
            epochs.close()
            raise
        return SharedPool(info, pool, epochs)

    def close(self) -> None:
        self._bytes = np.zeros(0, dtype=np.uint8)
        _close_map(self._map)
        self.epochs.close()

    def __enter__(self) -> SharedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def begin_read(self, table: Union[BlockTable, TableSnapshot]) -> TableSnapshot:
        """The snapshot to read through (stream_blocks) and to pass to end_read;
        StaleEpochError when the table is stale: fetch it again."""
        return self.epochs.begin_read(table)

    def end_read(self, snap: TableSnapshot) -> None:
        """StaleEpochError when the table went stale during the read: discard what was read."""
        self.epochs.end_read(snap)

    @contextlib.contextmanager
    def reading(self, table: Union[BlockTable, TableSnapshot]) -> Iterator[_Reading]:
        """begin_read, the block's reads, end_read (not run when the block raised)."""
        reading = _Reading(self, self.begin_read(table))
        try:
            yield reading
        finally:
            reading._close()
        self.end_read(reading.table)

    def stream_blocks(self, snap: TableSnapshot, layer: int, kv_head: int) -> list[BlockView]:
        """Views of one stream's blocks, in order; OutOfRangeError for a block outside the
        mapping. Valid only between begin_read and end_read of the same snapshot."""
        if not isinstance(snap, TableSnapshot):
            raise TypeError("stream_blocks: pass the snapshot begin_read returned, not a "
                            f"{type(snap).__name__}")
        layout = snap.layout
        if not (0 <= layer < layout.num_layers and 0 <= kv_head < layout.num_kv_heads):
            raise InvalidArgumentError(f"stream ({layer}, {kv_head}) is outside the layout")
        st = snap.stream(layer, kv_head)
        row = layout.head_dim * layout.dtype.itemsize
        views = []
        for b in range(st.num_blocks):
            offset, start, count = int(st.offsets[b]) - self._lo, int(st.starts[b]), \
                int(st.counts[b])
            precision = Precision(int(st.precisions[b]))
            size = snap.block_bytes if precision is Precision.LAYOUT else \
                snap.quantized_block_bytes
            if offset < 0 or offset > self.size or size > self.size - offset or \
                    start + count > snap.block_tokens:
                raise OutOfRangeError(
                    f"blocks[{b}]: offset {offset + self._lo} slots [{start}, {start + count}) "
                    "is outside the mapped pool or block", code=grpc.StatusCode.OUT_OF_RANGE)
            block = self._bytes[offset:offset + size]
            if precision is not Precision.LAYOUT:
                views.append(BlockView(None, None, block, start, count, precision))
                continue
            # [K rows: B][V rows: B] (kernels/block_layout.h), one row = D elements.
            k_plane = block[:snap.block_tokens * row].view(layout.dtype.numpy)
            v_plane = block[snap.block_tokens * row:2 * snap.block_tokens * row].view(
                layout.dtype.numpy)
            k = k_plane.reshape(snap.block_tokens, layout.head_dim)[start:start + count]
            v = v_plane.reshape(snap.block_tokens, layout.head_dim)[start:start + count]
            views.append(BlockView(k, v, block, start, count, precision))
        return views

    def read_stream(self, table: Union[BlockTable, TableSnapshot], layer: int,
                    kv_head: int) -> StreamKv:
        """One stream's retained K and V copied out ([n][D] each, quantized blocks dequantized
        to the layout dtype) under the full read protocol. positions are the table's (empty
        when it keeps none)."""
        snap = self.begin_read(table)
        layout = snap.layout
        parts_k, parts_v = [], []
        for b in self.stream_blocks(snap, layer, kv_head):
            if b.precision is Precision.LAYOUT:
                parts_k.append(np.array(b.k))
                parts_v.append(np.array(b.v))
            else:
                g = QuantGeometry(b.precision, snap.block_tokens, layout.head_dim)
                k, v = dequantize_block(np.array(b.block), g, b.start, b.count, layout.dtype)
                parts_k.append(k)
                parts_v.append(v)
        self.end_read(snap)
        empty = np.zeros((0, layout.head_dim), dtype=layout.dtype.numpy)
        st = snap.stream(layer, kv_head)
        return StreamKv(layer, kv_head, snap.epoch, st.positions.copy(),
                        np.concatenate(parts_k) if parts_k else empty,
                        np.concatenate(parts_v) if parts_v else empty)

    def read_all(self, table: Union[BlockTable, TableSnapshot], room: int = 0,
                 since: Optional[PaddedKv] = None) -> PaddedKv:
        """Every stream's retained K and V copied out at once under the full read protocol,
        padded to the longest stream plus `room` slots (for the caller's new tokens): what
        a forward pass over the whole sequence reads. Layout-precision blocks are gathered
        by one index per plane; quantized blocks are dequantized one by one.

        `since`: this sequence's previous read. Its arrays are reused (and overwritten) and,
        when the epoch has not moved, a stream whose blocks are the previous ones with only
        the last grown and new ones after it copies just the new rows: the daemon rewrites
        no retained slot without moving the epoch (the seqlock), so the rows read before are
        still the sequence's. Any other change reads the stream whole. Rows past a stream's
        count are zero on a fresh read and unspecified with `since`."""
        snap = self.begin_read(table)
        layout = snap.layout
        D, itemsize = layout.head_dim, layout.dtype.itemsize
        row = D * itemsize
        if snap.block_bytes < 2 * snap.block_tokens * row:
            raise OutOfRangeError(
                f"block_bytes {snap.block_bytes}: a block of {snap.block_tokens} slots needs "
                f"{2 * snap.block_tokens * row}", code=grpc.StatusCode.OUT_OF_RANGE)
        if room < 0:
            raise InvalidArgumentError(f"room: {room} slots")
        counts = np.array([st.num_slots for st in snap.streams], dtype=np.int64)
        longest = int(counts.max()) if counts.size else 0
        S = len(snap.streams)
        reusable = since is not None and since.table.sequence_id == snap.sequence_id and \
            since.table.layout == layout and since.table.block_tokens == snap.block_tokens \
            and len(since.table.streams) == S
        if reusable and since.store_k.shape[1] >= longest + room:
            k_all, v_all = since.store_k, since.store_v
        else:
            capacity = longest + room + (longest + room) // 4 + 16  # room to grow in
            k_all = np.zeros((S, capacity, D), dtype=layout.dtype.numpy)
            v_all = np.zeros_like(k_all)
            if reusable:  # the rows read before, into the larger arrays
                kept = since.store_k.shape[1]
                k_all[:, :kept], v_all[:, :kept] = since.store_k, since.store_v
        same_epoch = reusable and since.table.epoch == snap.epoch
        # Blocks (or tails of blocks) to copy, per stream: gathered at once below when they
        # are layout precision and their rows align with the pool's, as (stream, first slot
        # in the stream, pool row of the first K row, count).
        gathered: list[tuple[np.ndarray, ...]] = []
        for s, st in enumerate(snap.streams):
            offsets = np.asarray(st.offsets, dtype=np.int64) - self._lo
            starts = np.asarray(st.starts, dtype=np.int64)
            lengths = np.asarray(st.counts, dtype=np.int64)
            plain = np.asarray(st.precisions, dtype=np.int64) == int(Precision.LAYOUT)
            if not plain.all() and snap.quantized_block_bytes <= 0:
                raise OutOfRangeError(f"stream {s}: quantized blocks of no size",
                                      code=grpc.StatusCode.OUT_OF_RANGE)
            sizes = np.where(plain, snap.block_bytes, snap.quantized_block_bytes)
            bad = (offsets < 0) | (offsets > self.size) | (sizes > self.size - offsets) | \
                (starts < 0) | (lengths < 0) | (starts + lengths > snap.block_tokens)
            if bad.any():
                b = int(np.argmax(bad))
                raise OutOfRangeError(
                    f"stream {s} blocks[{b}]: offset {offsets[b] + self._lo} slots [{starts[b]}, "
                    f"{starts[b] + lengths[b]}) is outside the mapped pool or block",
                    code=grpc.StatusCode.OUT_OF_RANGE)
            at = np.cumsum(lengths) - lengths  # each block's first slot in the stream
            grown = _grown_from(since.table.streams[s], st) if same_epoch else None
            if grown is not None:  # copy only the rows after the ones read before
                first, had = grown
                starts, lengths = starts.copy(), lengths.copy()
                starts[first] += had
                lengths[first] -= had
                at[first] += had
                offsets, starts, lengths, at, plain, sizes = (
                    x[first:] for x in (offsets, starts, lengths, at, plain, sizes))
            fast = plain & (offsets % row == 0)
            if fast.any():
                gathered.append((np.full(int(fast.sum()), s), at[fast],
                                 offsets[fast] // row + starts[fast], lengths[fast]))
            for b in np.nonzero(~fast)[0]:
                offset, start, count = int(offsets[b]), int(starts[b]), int(lengths[b])
                first_slot = int(at[b])
                block = self._bytes[offset:offset + int(sizes[b])]
                if plain[b]:  # rows not aligned to the pool's start
                    planes = block[:2 * snap.block_tokens * row].view(layout.dtype.numpy)
                    planes = planes.reshape(2, snap.block_tokens, D)
                    k_all[s, first_slot:first_slot + count] = planes[0, start:start + count]
                    v_all[s, first_slot:first_slot + count] = planes[1, start:start + count]
                else:
                    g = QuantGeometry(Precision(int(st.precisions[b + len(st.offsets) -
                                                                  len(offsets)])),
                                      snap.block_tokens, D)
                    bk, bv = dequantize_block(np.array(block), g, start, count, layout.dtype)
                    k_all[s, first_slot:first_slot + count] = bk
                    v_all[s, first_slot:first_slot + count] = bv
        if gathered:
            s_of, at_of, row_of, count_of = (np.concatenate(c) for c in zip(*gathered))
            total = int(count_of.sum())
            within = np.arange(total) - np.repeat(np.cumsum(count_of) - count_of, count_of)
            streams = np.repeat(s_of, count_of)
            slots = np.repeat(at_of, count_of) + within
            k_rows = np.repeat(row_of, count_of) + within
            rows = self._bytes[:self.size // row * row].view(layout.dtype.numpy).reshape(-1, D)
            k_all[streams, slots] = rows[k_rows]
            # A block is [K rows: B][V rows: B] (kernels/block_layout.h).
            v_all[streams, slots] = rows[k_rows + snap.block_tokens]
        self.end_read(snap)
        return PaddedKv(snap, k_all[:, :longest + room], v_all[:, :longest + room], counts,
                        k_all, v_all)


def _grown_from(old: StreamTable, new: StreamTable) -> Optional[tuple[int, int]]:
    """When `new` is `old` with only its last block grown and blocks added after it: (that
    block's index, the slots of it read before); else None."""
    m = len(old.offsets)
    if m == 0 or len(new.offsets) < m or new.offsets[:m] != old.offsets or \
            new.starts[:m] != old.starts or new.counts[:m - 1] != old.counts[:m - 1] or \
            new.precisions[:m] != old.precisions or new.counts[m - 1] < old.counts[m - 1]:
        return None
    return m - 1, old.counts[m - 1]


@dataclasses.dataclass(frozen=True)
class PaddedKv:
    """A sequence's retained K/V as SharedPool.read_all copies it: k and v
    [streams][longest + room][D] (stream = layer * H + kv_head; rows past a stream's count:
    see read_all), counts [streams], the snapshot read (its epoch), and the arrays k and v
    are views of (with room to grow: what a later read_all(since=...) reuses)."""
    table: TableSnapshot
    k: np.ndarray
    v: np.ndarray
    counts: np.ndarray
    store_k: np.ndarray
    store_v: np.ndarray
