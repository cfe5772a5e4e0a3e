"""Sequence: the handle of one sequence a Client created or forked.

It keeps the sequence's block table current (every mutating verb names the table's version
and applies the update the daemon answers with), its lease renewed in the background, and is
a context manager: leaving the `with` block releases it, on an exception or a
KeyboardInterrupt as well. A Sequence dropped without release stops being renewed, and the
daemon releases it when its lease lapses.
"""
from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Iterable, Optional, Sequence as Seq

import numpy as np

from kvmem.block_table import BlockTable
from kvmem.errors import KvmemError, NotFoundError
from kvmem.messages import (AppendResult, CompressArgs, CompressResult, LogitStats, NewTokens,
                            StepArgs, StepResult, StreamKv, StreamSignal)

if TYPE_CHECKING:
    from kvmem.client import Client

_log = logging.getLogger("kvmem")


class Sequence:
    """One sequence: id, granted lease (seconds), epoch slot, the table kept current
    (`table`), and for a created one the prompt tokens mapped from published blocks."""

    def __init__(self, client: Client, sequence_id: int, lease: float, epoch_slot: int,
                 epoch: int, table_version: int, reused_prefix_tokens: int, table: BlockTable,
                 parent_id: Optional[int]) -> None:
        self._client = client
        self.id = sequence_id
        self.lease = lease
        self.epoch_slot = epoch_slot
        self.created_epoch = epoch
        self.created_table_version = table_version
        self.reused_prefix_tokens = reused_prefix_tokens
        self.parent_id = parent_id
        self.table = table
        self._released = False
        # Dropped without release: stop renewing it (the daemon reclaims it at lease end).
        self._forget = weakref.finalize(self, client._untrack, sequence_id)

    def __repr__(self) -> str:
        state = "released" if self._released else f"epoch {self.table.epoch}"
        return f"<kvmem.Sequence {self.id} ({state})>"

    # ---- lifetime --------------------------------------------------------------------------

    def __enter__(self) -> Sequence:
        return self

    def __exit__(self, exc_type: Optional[type], exc: Optional[BaseException],
                 tb: object) -> None:
        try:
            self.release()
        except KvmemError as e:
            if exc is None:
                raise
            # The block's own exception (a KeyboardInterrupt, say) matters more; the lease
            # lapses if the release did not get through.
            _log.warning("kvmem: releasing sequence %d while unwinding failed: %s", self.id, e)

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> int:
        """Releases the sequence (idempotent); returns the blocks whose last reference this
        dropped (0 when it was released already, here, by the client's close() or by its
        lease lapsing)."""
        if self._released:
            return 0
        if not self._client.tracks(self.id):
            self._released = True
            self._forget.detach()
            return 0
        try:
            freed = self._client.release(self.id)
        except NotFoundError:
            freed = 0  # gone already (its lease lapsed): released all the same
        self._released = True
        self._forget.detach()
        return freed

    def lapsed(self) -> Optional[KvmemError]:
        """Why the lease renewer found the sequence gone, if it did."""
        return self._client.lapsed(self.id)

    # ---- verbs -----------------------------------------------------------------------------

    def append(self, positions: Seq[int], k: np.ndarray, v: np.ndarray, *,
               token_ids: Optional[Seq[int]] = None, token_entropy: Optional[Seq[float]] = None,
               layer_distance: Optional[Seq[float]] = None) -> AppendResult:
        """Appends n tokens: positions increasing past every appended one, k and v
        [L][H][n][D] numpy arrays in the layout dtype."""
        return self._client.append(
            self.id, NewTokens(positions, k, v, token_ids, token_entropy, layer_distance),
            self.table)

    def append_stream(self, chunks: Iterable[NewTokens]) -> AppendResult:
        """A long prefill in chunks, applied all or none."""
        return self._client.append_stream(self.id, chunks, self.table)

    def step(self, logit_stats: Optional[LogitStats] = None,
             attention: Seq[StreamSignal] = (), *, epoch: Optional[int] = None,
             attention_f16: bool = False) -> StepResult:
        """One decode step's signals, computed on `epoch` (None: the held table's)."""
        args = StepArgs(self.table.epoch if epoch is None else epoch, logit_stats, attention,
                        attention_f16)
        return self._client.step(self.id, args, self.table)

    def compress(self, target_tokens: Optional[int] = None, *,
                 window_scores: Seq[StreamSignal] = (), attention: Seq[StreamSignal] = (),
                 epoch: Optional[int] = None) -> CompressResult:
        args = CompressArgs(self.table.epoch if epoch is None else epoch, target_tokens,
                            window_scores, attention)
        return self._client.compress(self.id, args, self.table)

    def refresh_table(self, positions: Optional[bool] = None) -> BlockTable:
        """Fetches the whole table again (to recover after a StaleEpochError)."""
        with self.table.update_lock:  # after any call in flight on it, never mixed with it
            fresh = self._client.get_block_table(
                self.id, self.table.positions if positions is None else positions)
            self.table.assign(fresh)
        return self.table

    def read_kv(self, epoch: Optional[int] = None,
                layers: Optional[tuple[int, int]] = None) -> list[StreamKv]:
        return self._client.read_kv(self.id, epoch, layers)

    def fork(self, lease: Optional[float] = None) -> Sequence:
        """A copy-on-write child; it starts with this sequence's table when that is current."""
        return self._client.fork(self.id, lease, self.table.positions, parent_table=self.table)

    def publish(self, up_to_tokens: Optional[int] = None) -> int:
        return self._client.publish(self.id, up_to_tokens)

    def publish_document(self) -> int:
        return self._client.publish_document(self.id)
