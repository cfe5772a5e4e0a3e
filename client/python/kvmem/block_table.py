"""A sequence's block table, kept current from the daemon's table updates.

A mutating call that names the client's table version (ClientTable) answers with a
TableUpdate: the whole table, or a TableDelta from exactly that version, in columns (see
kvmem.proto's TableDelta). apply_table_update checks a delta whole against the table before
anything changes, as client/cpp/kvmem/table_update.cc does; an update that does not check
out leaves the table as it was and the caller fetches the table again.

A stream's blocks are columns (lists: ids, offsets, starts, counts, precisions):
block i holds the stream's live slots [starts[i], starts[i] + counts[i]) of the block at
byte offset offsets[i] in the pool; the stream's token order is block order, then slot
order.

Concurrency: a BlockTable is changed only under its locks. `update_lock` (reentrant) is
held by a call from building its request until its update is applied or the table fetched
again, so that calls on one table apply in order; a short state lock is held while fields
change and while snapshot() copies them, so that a reader never sees half an update.
Streams are replaced by updates, never changed in place: a snapshot shares them safely.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Optional, Sequence

import numpy as np

from kvmem.layout import DType, Layout, Precision
from kvmem.v1 import kvmem_pb2 as pb

_COLUMN_NAMES = ("ids", "offsets", "starts", "counts", "precisions")
_NO_POSITIONS = np.zeros(0, np.int64)
_NO_POSITIONS.flags.writeable = False  # shared by every table that keeps no positions


def _column(values: Sequence[int], dtype: type) -> np.ndarray:
    return np.fromiter(values, dtype=dtype, count=len(values))


@dataclasses.dataclass
class StreamTable:
    """One stream's blocks, in order (columns), and its retained positions when kept."""
    layer: int
    kv_head: int
    ids: list[int]
    offsets: list[int]     # bytes into the pool
    starts: list[int]      # first live slot
    counts: list[int]      # live slots
    precisions: list[int]  # Precision values
    positions: np.ndarray  # int64 [retained slots]; empty unless the table keeps positions

    @property
    def num_blocks(self) -> int:
        return len(self.ids)

    @property
    def num_slots(self) -> int:
        return sum(self.counts)


@dataclasses.dataclass
class BlockTable:
    """A sequence's block table at one version and epoch. version 0: none held yet (the
    next update is the whole table); epoch 0: not valid for same-host reads. update_lock:
    held by a call from request to update (the module's docstring)."""
    sequence_id: int
    epoch: int
    version: int
    positions: bool  # StreamTable.positions are kept
    block_tokens: int
    block_bytes: int
    layout: Layout
    epoch_slot: int
    quantization: Precision
    quantized_block_bytes: int
    streams: list[StreamTable]  # index = layer * H + kv_head

    def __post_init__(self) -> None:
        # Not fields: a copy, dataclasses.replace or asdict never shares or copies them.
        self.update_lock = threading.RLock()
        self._state_lock = threading.Lock()

    def stream(self, layer: int, kv_head: int) -> StreamTable:
        return self.streams[_stream_index(self.layout, layer, kv_head)]

    def snapshot(self) -> TableSnapshot:
        """The table as it is now, taken whole (never half of an update being applied)."""
        with self._state_lock:
            return TableSnapshot(self.sequence_id, self.epoch, self.version, self.epoch_slot,
                                 self.block_tokens, self.block_bytes, self.quantization,
                                 self.quantized_block_bytes, self.layout, tuple(self.streams))

    def assign(self, other: BlockTable) -> None:
        """Becomes `other` (a table fetched whole), keeping its own locks."""
        values = {f.name: getattr(other, f.name) for f in dataclasses.fields(other)}
        with self._state_lock:
            self.__dict__.update(values)

    def forget(self) -> None:
        """Marks the table as none held (the next call gets it whole) and of no epoch (a
        same-host read through it fails its check)."""
        with self._state_lock:
            self.version = 0
            self.epoch = 0

    # Copies and pickles get locks of their own.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["update_lock"], state["_state_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__post_init__()


@dataclasses.dataclass(frozen=True)
class TableSnapshot:
    """A BlockTable's fields at one instant (BlockTable.snapshot), what a same-host read is
    checked and addressed against."""
    sequence_id: int
    epoch: int
    version: int
    epoch_slot: int
    block_tokens: int
    block_bytes: int
    quantization: Precision
    quantized_block_bytes: int
    layout: Layout
    streams: tuple[StreamTable, ...]

    def stream(self, layer: int, kv_head: int) -> StreamTable:
        return self.streams[_stream_index(self.layout, layer, kv_head)]


def _stream_index(layout: Layout, layer: int, kv_head: int) -> int:
    if not (0 <= layer < layout.num_layers and 0 <= kv_head < layout.num_kv_heads):
        raise IndexError(f"stream ({layer}, {kv_head}) is outside the layout "
                         f"({layout.num_layers} x {layout.num_kv_heads})")
    return layer * layout.num_kv_heads + kv_head


def empty_table(sequence_id: int, positions: bool) -> BlockTable:
    """A table holding nothing: the next update a call brings is the whole table."""
    return BlockTable(sequence_id, 0, 0, positions, 0, 0, Layout(0, 0, 0), 0, Precision.LAYOUT,
                      0, [])


def layout_from_proto(layout: pb.Layout) -> Layout:
    return Layout(layout.num_layers, layout.num_kv_heads, layout.head_dim,
                  DType(layout.dtype) if layout.dtype else DType.F16,
                  layout.block_tokens if layout.HasField("block_tokens") else None,
                  layout.vocab_size)


def table_from_proto(t: pb.BlockTable) -> BlockTable:
    streams = []
    for st in t.streams:
        streams.append(StreamTable(
            st.layer, st.kv_head, list(st.block_ids), list(st.block_offsets),
            list(st.block_starts), list(st.block_counts), list(st.block_precisions),
            _column(st.positions, np.int64) if st.positions else _NO_POSITIONS))
    quantization = Precision(t.quantization) if t.quantization else Precision.LAYOUT
    return BlockTable(t.sequence_id, t.epoch, t.version, t.positions, t.block_tokens,
                      t.block_bytes, layout_from_proto(t.layout), t.epoch_slot, quantization,
                      t.quantized_block_bytes, streams)


@dataclasses.dataclass
class _Delta:
    """A TableDelta's columns as Python lists (parsed once): a decode step's delta is a few
    entries per stream, where list slices cost a fraction of numpy's per-call overhead."""
    stream: list[int]
    block_count: list[int]
    run_count: list[int]
    kept_at: list[int]
    kept_from: list[int]
    kept_count: list[int]
    given: dict[str, list[int]]  # the block_* columns by StreamTable field
    positions: np.ndarray

    @staticmethod
    def of(d: pb.TableDelta) -> Optional[_Delta]:
        given = dict(zip(_COLUMN_NAMES, (list(c) for c in (
            d.block_ids, d.block_offsets, d.block_starts, d.block_counts, d.block_precisions))))
        out = _Delta(list(d.stream), list(d.block_count), list(d.run_count), list(d.kept_at),
                     list(d.kept_from), list(d.kept_count), given,
                     _column(d.positions, np.int64))
        listed, runs, entries = len(out.stream), len(out.kept_at), len(given["ids"])
        if len(out.block_count) != listed or len(out.run_count) != listed or \
                len(out.kept_from) != runs or len(out.kept_count) != runs or \
                any(len(c) != entries for c in given.values()):
            return None
        return out


# One piece of a new block list: entries [begin, end) of the held list ("held") or of the
# delta's given columns ("given"), with the positions [pos_begin, pos_end) of that source.
_Piece = tuple[bool, int, int, int, int]  # (from the held list, begin, end, pos_begin, pos_end)


def _plan_stream(d: _Delta, i: int, run: int, entry: int, position: int, held: StreamTable,
                 keep_positions: bool) -> Optional[tuple[list[_Piece], int, int, int]]:
    """Checks listed stream i of the delta against the held stream and plans its new list;
    returns the pieces and where the next stream's runs, entries and positions start, or None
    when the delta does not check out."""
    run_end = run + d.run_count[i]
    if run_end > len(d.kept_at):
        return None
    held_blocks = len(held.ids)
    first_slot: list[int] = []
    if keep_positions:  # where each held block's positions start
        first_slot = [0, *itertools.accumulate(held.counts)]
        if first_slot[-1] != held.positions.size:
            return None
    block_count = d.block_count[i]
    given_counts = d.given["counts"]
    pieces: list[_Piece] = []
    at = 0     # entries of the new list planned so far
    floor = 0  # the held list's entries before this are used
    for r in range(run, run_end):
        kept_at, kept_from, count = d.kept_at[r], d.kept_from[r], d.kept_count[r]
        if kept_at < at or kept_from < floor or kept_from + count > held_blocks:
            return None
        if kept_at > at:  # given entries fill the new list up to the run
            entry, position = _give(given_counts, pieces, entry, position, kept_at - at)
            if entry < 0:
                return None
        if keep_positions:
            pieces.append((True, kept_from, kept_from + count, first_slot[kept_from],
                           first_slot[kept_from + count]))
        else:
            pieces.append((True, kept_from, kept_from + count, 0, 0))
        at, floor = kept_at + count, kept_from + count
    if at > block_count:
        return None
    entry, position = _give(given_counts, pieces, entry, position, block_count - at)
    if entry < 0 or (keep_positions and position > d.positions.size):
        return None
    return pieces, run_end, entry, position


def _give(given_counts: list[int], pieces: list[_Piece], entry: int, position: int,
          n: int) -> tuple[int, int]:
    """Plans the next n given entries; (-1, -1) when the columns hold fewer."""
    if entry + n > len(given_counts):
        return -1, -1
    if n == 0:
        return entry, position
    slots = sum(given_counts[entry:entry + n])
    pieces.append((False, entry, entry + n, position, position + slots))
    return entry + n, position + slots


def _build(d: _Delta, held: StreamTable, pieces: list[_Piece],
           keep_positions: bool) -> StreamTable:
    columns: dict[str, list[int]] = {}
    for name in _COLUMN_NAMES:
        old, new = getattr(held, name), d.given[name]
        out: list[int] = []
        for from_held, b, e, _, _ in pieces:
            out += (old if from_held else new)[b:e]
        columns[name] = out
    positions = _NO_POSITIONS
    if keep_positions:
        parts = [(held.positions if from_held else d.positions)[pb_:pe]
                 for from_held, _, _, pb_, pe in pieces]
        positions = np.concatenate(parts) if parts else _NO_POSITIONS
    return StreamTable(held.layer, held.kv_head, positions=positions, **columns)


def apply_table_update(sequence_id: int, update: pb.TableUpdate, table: BlockTable) -> bool:
    """Brings `table` to the update's version; False, with `table` unchanged, when the update
    cannot apply: none came, it is another sequence's, or a delta from another version or
    that does not check out against the table. Holds table.update_lock (see the module's
    docstring)."""
    with table.update_lock:
        return _apply(sequence_id, update, table)


def _apply(sequence_id: int, update: pb.TableUpdate, table: BlockTable) -> bool:
    kind = update.WhichOneof("update")
    if kind == "table":
        if update.table.sequence_id != sequence_id:
            return False
        table.assign(table_from_proto(update.table))
        return True
    if kind != "delta":
        return False
    if table.sequence_id != sequence_id or update.delta.base_version != table.version:
        return False
    d = _Delta.of(update.delta)
    if d is None:
        return False
    # Everything is checked and planned before any stream changes.
    plans: list[tuple[int, list[_Piece]]] = []
    run = entry = position = 0
    previous = -1
    for i, s in enumerate(d.stream):
        if s >= len(table.streams) or s <= previous:
            return False
        previous = s
        planned = _plan_stream(d, i, run, entry, position, table.streams[s], table.positions)
        if planned is None:
            return False
        pieces, run, entry, position = planned
        plans.append((s, pieces))
    if run != len(d.kept_at) or entry != len(d.given["ids"]) or \
            (table.positions and position != d.positions.size):
        return False
    built = [(s, _build(d, table.streams[s], pieces, table.positions)) for s, pieces in plans]
    with table._state_lock:
        for s, stream in built:
            table.streams[s] = stream
        table.version = update.delta.version
        table.epoch = update.delta.epoch
    return True
