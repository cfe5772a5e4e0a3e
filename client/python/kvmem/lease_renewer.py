"""Keeps the leases of a client's live sequences from lapsing while the program holds them.

Every call on a sequence renews its lease, but a sequence may sit idle longer than its lease
(a worker waiting on a slow request); the daemon then releases it. LeaseRenewer sends
KeepAlive for every registered sequence each third of the shortest lease among them, from
one daemon thread per client. The thread exists only while some sequence is registered: a
client with no live sequence runs no thread (so counting threads finds leaks).

Schedule: the next renewal is an absolute time on the injected clock. Registering a sequence
moves it earlier only when the new lease needs it sooner; nothing else moves it, so
sequences created faster than a third of a lease never postpone a renewal.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Sequence

from kvmem.errors import KvmemError

_log = logging.getLogger("kvmem")

# KeepAlive(ids) -> one exception (or None when renewed) per id, in order.
KeepAliveFn = Callable[[Sequence[int]], list[Optional[KvmemError]]]
# Seconds on a monotonic clock (time.monotonic unless a test injects its own).
Clock = Callable[[], float]


class LeaseRenewer:
    """The renewal thread of one client. Lock order: a caller's locks, then `_cond`; the
    KeepAlive call runs with `_cond` released."""

    def __init__(self, keep_alive: KeepAliveFn, max_ids_per_call: Callable[[], int],
                 clock: Clock = time.monotonic) -> None:
        self._keep_alive = keep_alive
        self._max_ids_per_call = max_ids_per_call
        self._clock = clock
        self._cond = threading.Condition()
        self._leases: dict[int, float] = {}  # sequence id -> lease seconds
        self._lapsed: dict[int, KvmemError] = {}  # ids the daemon no longer renews, and why
        self._next_renewal = 0.0  # clock time of the next KeepAlive; kept across wake-ups
        # The thread object lives here until close() joins it, even after the thread decided
        # to end (`_active` false), so that close() never misses one that is still ending.
        self._thread: Optional[threading.Thread] = None
        self._active = False  # the thread is running its loop, not ending
        self._closed = False

    def register(self, sequence_id: int, lease_seconds: float) -> None:
        ending: Optional[threading.Thread] = None
        with self._cond:
            if self._closed:
                return
            self._leases[sequence_id] = max(lease_seconds, 1.0)
            self._lapsed.pop(sequence_id, None)
            due = self._clock() + self._leases[sequence_id] / 3
            if self._active:
                if due < self._next_renewal:  # a shorter lease: renew sooner
                    self._next_renewal = due
                    self._cond.notify_all()
                return
            self._next_renewal = due
            ending, self._thread = self._thread, threading.Thread(
                target=self._run, name="kvmem-lease-renewer", daemon=True)
            self._active = True
            self._thread.start()
        if ending is not None:
            ending.join()  # it decided to end before this register: it holds no lock now

    def unregister(self, sequence_id: int) -> None:
        with self._cond:
            self._leases.pop(sequence_id, None)
            self._lapsed.pop(sequence_id, None)
            if not self._leases:
                self._cond.notify_all()  # the thread sees nothing to renew and ends

    def lapsed(self, sequence_id: int) -> Optional[KvmemError]:
        """Why the daemon refused to renew the sequence (NOT_FOUND, DATA_LOSS), if it did."""
        with self._cond:
            return self._lapsed.get(sequence_id)

    @property
    def running(self) -> bool:
        with self._cond:
            return self._active

    def wake(self) -> None:
        """Makes the thread read the clock again now: for an injected clock that moved."""
        with self._cond:
            self._cond.notify_all()

    def stop(self) -> None:
        """Stops renewing: the thread ends after the KeepAlive it may be in (close the
        channel to cut that short), and join() waits for it."""
        with self._cond:
            self._closed = True
            self._leases.clear()
            self._cond.notify_all()

    def join(self, timeout: Optional[float] = None) -> None:
        """Waits for the thread (after stop()); forgets it once it has ended."""
        with self._cond:
            thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout)
        with self._cond:
            if self._thread is thread and not thread.is_alive():
                self._thread = None

    def close(self, timeout: Optional[float] = None) -> None:
        """stop() and join()."""
        self.stop()
        self.join(timeout)

    def _due_ids(self) -> Optional[list[int]]:
        """Waits until the next renewal is due; the ids to renew then, or None when the
        thread must end (nothing registered, or closed)."""
        with self._cond:
            while True:
                if self._closed or not self._leases:
                    self._active = False
                    return None
                now = self._clock()
                if now >= self._next_renewal:
                    # Counted from this renewal's start; a register() while it runs can
                    # only move it earlier.
                    self._next_renewal = now + min(self._leases.values()) / 3
                    return sorted(self._leases)
                self._cond.wait(self._next_renewal - now)

    def _run(self) -> None:
        while True:
            ids = self._due_ids()
            if ids is None:
                return
            self._renew(ids)

    def _renew(self, ids: list[int]) -> None:
        limit = max(1, self._max_ids_per_call())
        for begin in range(0, len(ids), limit):
            chunk = ids[begin:begin + limit]
            try:
                results = self._keep_alive(chunk)
            except KvmemError as e:  # the daemon is down or draining: try again next time
                _log.warning("kvmem: renewing %d leases failed: %s", len(chunk), e)
                return
            except Exception:  # never let the thread die silently
                _log.exception("kvmem: renewing leases failed")
                return
            with self._cond:
                for sequence_id, error in zip(chunk, results):
                    if error is not None and sequence_id in self._leases:
                        # Gone or poisoned: renewing it again cannot help.
                        del self._leases[sequence_id]
                        self._lapsed[sequence_id] = error
