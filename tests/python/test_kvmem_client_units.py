"""The parts of the Python client (client/python, package `kvmem`) that need no daemon:
Duration and bf16 conversion, table deltas (and a property test of them), the lease renewer on
a manual clock, one table's calls from several threads against a fake stub, and errors built
from fake gRPC answers. The calls against a real kvmemd are in test_kvmem_client.py.

Needs the package installed (`python3 -m pip install ./client/python`); skips otherwise, or
with KVMEM_CI=1 fails.
"""
import copy
import hashlib
import os
import pathlib
import re
import threading
import time

import grpc
import numpy as np
import pytest

pytest.register_assert_rewrite("kvmem_testing")
from kvmem_testing import ROOT, ManualClock, kvmem, layout, same_table, wait_until  # noqa: E402
from google.rpc import error_details_pb2, status_pb2  # noqa: E402
from kvmem import convert, errors  # noqa: E402
from kvmem.block_table import (BlockTable, StreamTable, apply_table_update,  # noqa: E402
                               empty_table)
from kvmem.lease_renewer import LeaseRenewer  # noqa: E402
from kvmem.v1 import kvmem_pb2 as pb  # noqa: E402


# ---- the package itself -------------------------------------------------------------------

def test_installed_stubs_match_the_repository_proto():
    from kvmem.v1 import _proto_source
    proto = ROOT / "proto/kvmem/v1/kvmem.proto"
    assert _proto_source.PROTO_SHA256 == hashlib.sha256(proto.read_bytes()).hexdigest(), \
        "the installed kvmem was built from another kvmem.proto: pip install ./client/python again"
    # Made by the generator line pyproject.toml pins (it sets the runtime floors).
    pin = re.search(r'"grpcio-tools==([\d.]+)\.\*"',
                    (ROOT / "client/python/pyproject.toml").read_text()).group(1)
    assert _proto_source.GENERATOR.startswith(f"grpcio-tools {pin}.")


@pytest.mark.parametrize("seconds, expected", [
    (0.9999999999, (1, 0)), (1.5, (1, 500_000_000)), (2.0000000004, (2, 0)),
    (59.9999999996, (60, 0)), (0.1, (0, 100_000_000)), (3, (3, 0)),
    (-1.25, (-1, -250_000_000))])
def test_duration_of_keeps_nanos_below_a_second(seconds, expected):
    d = pb.CreateSequenceRequest().lease
    convert.duration_of(seconds, d)
    assert (d.seconds, d.nanos) == expected


def test_duration_of_is_within_half_a_nanosecond():
    rng = np.random.default_rng(1)
    for x in np.concatenate([rng.uniform(0, 86400, 500), rng.uniform(0, 1, 500)]):
        d = pb.CreateSequenceRequest().lease
        convert.duration_of(float(x), d)
        assert 0 <= d.nanos < 10**9
        # Independent of duration_of's arithmetic: the Duration converts back to x.
        assert abs(d.ToNanoseconds() - float(x) * 1e9) <= 0.5 + abs(float(x)) * 1e9 * 2**-52


def test_bf16_conversion_rounds_to_nearest_even():
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, np.inf], dtype=np.float32)
    # 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties go to the even mantissa (1.0);
    # 1 + 3 * 2^-8 is halfway between 1.0078125 and 1.015625: to the even one (1.015625).
    assert kvmem.float32_to_bf16(x).tolist() == [0x3F80, 0x3F80, 0x3F82, 0xC020, 0x7F80]
    assert kvmem.bf16_to_float32(np.array([0x3F82], np.uint16))[0] == np.float32(1.015625)


# ---- block-table updates (no daemon) ------------------------------------------------------

def held_table(blocks_per_stream, positions):
    """A table of 2 streams; stream s holds blocks with ids 10*s + i, 4 slots each."""
    streams = []
    for s, n in enumerate(blocks_per_stream):
        ids = [10 * s + i for i in range(n)]
        streams.append(StreamTable(0, s, ids, [i * 4096 for i in ids], [0] * n, [4] * n, [1] * n,
                                   np.arange(4 * n, dtype=np.int64) if positions
                                   else np.zeros(0, np.int64)))
    return BlockTable(7, 3, 5, positions, 4, 4096, layout(L=1, H=2), 0, kvmem.Precision.LAYOUT,
                      0, streams)


def test_delta_keeps_runs_and_inserts_given_entries():
    table = held_table([3, 2], positions=True)
    update = pb.TableUpdate()
    d = update.delta
    d.base_version, d.version, d.epoch = 5, 6, 4
    # Stream 1 only: new list = [given 99 (2 slots, positions 100, 101), held entries 0..1].
    d.stream.append(1)
    d.block_count.append(3)
    d.run_count.append(1)
    d.kept_at.append(1)
    d.kept_from.append(0)
    d.kept_count.append(2)
    d.block_ids.append(99)
    d.block_offsets.append(99 * 4096)
    d.block_precisions.append(pb.PRECISION_LAYOUT)
    d.block_starts.append(1)
    d.block_counts.append(2)
    d.positions.extend([100, 101])
    before0 = copy.deepcopy(table.streams[0])
    assert apply_table_update(7, update, table)
    assert (table.version, table.epoch) == (6, 4)
    s1 = table.streams[1]
    assert s1.ids == [99, 10, 11]
    assert s1.starts == [1, 0, 0] and s1.counts == [2, 4, 4]
    assert s1.positions.tolist() == [100, 101, 0, 1, 2, 3, 4, 5, 6, 7]
    assert table.streams[0].ids == before0.ids


def test_delta_that_does_not_check_out_changes_nothing():
    table = held_table([3, 2], positions=False)
    snapshot = copy.deepcopy(table)
    update = pb.TableUpdate()
    d = update.delta
    d.base_version, d.version, d.epoch = 5, 6, 3
    # Stream 1 becomes its held entry 1 alone: a delta that applies (to a copy).
    d.stream.append(1)
    d.block_count.append(1)
    d.run_count.append(1)
    d.kept_at.append(0)
    d.kept_from.append(1)
    d.kept_count.append(1)
    valid = copy.deepcopy(table)
    assert apply_table_update(7, update, valid) and valid.streams[1].ids == [11]
    # Each change below breaks exactly one rule.
    d.block_count[0], d.kept_count[0] = 2, 2  # entries [1, 3) of a 2-entry list
    assert not apply_table_update(7, update, table)
    d.block_count[0], d.kept_count[0] = 1, 1
    d.base_version = 4  # another version's delta, otherwise the valid one
    assert not apply_table_update(7, update, table)
    d.base_version = 5
    assert not apply_table_update(8, update, table)  # another sequence's
    same_table(table, snapshot)


def test_delta_whose_second_stream_does_not_check_out_changes_no_stream():
    table = held_table([3, 2], positions=True)
    snapshot = copy.deepcopy(table)
    update = pb.TableUpdate()
    d = update.delta
    d.base_version, d.version, d.epoch = 5, 6, 4
    d.stream.extend([0, 1])
    d.block_count.extend([2, 2])
    d.run_count.extend([1, 1])
    d.kept_at.extend([0, 0])
    d.kept_from.extend([1, 1])
    d.kept_count.extend([2, 1])  # stream 0 drops its first block; stream 1 is short a block
    assert not apply_table_update(7, update, table)
    same_table(table, snapshot)
    for x, y in zip(table.streams, snapshot.streams):
        assert np.array_equal(x.positions, y.positions)
    d.block_count[1] = 1  # with stream 1 fixed, both apply
    assert apply_table_update(7, update, table)
    assert table.streams[0].ids == [1, 2] and table.streams[1].ids == [11]
    assert table.streams[0].positions.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


# ---- a property test of table deltas: random tables and lists, deltas built here from ----
# ---- kvmem.proto's TableDelta comment; the new list is the oracle -------------------------

def random_held_table(rng, positions):
    """A 2 x 3 table of random streams: entries (id, offset, start, count, precision) with
    unique ids, and when `positions` unique positions per live slot."""
    ids = iter(rng.permutation(10_000).tolist())
    next_position = iter(range(0, 10**9, 7))
    streams = []
    for s in range(6):
        entries = [random_entry(rng, next(ids)) for _ in range(int(rng.integers(0, 7)))]
        slots = sum(e[3] for e in entries)
        streams.append(stream_of(s, entries, [next(next_position) for _ in range(slots)]
                                 if positions else []))
    return BlockTable(7, 3, 5, positions, 16, 4096, layout(L=2, H=3), 0,
                      kvmem.Precision.LAYOUT, 0, streams), ids, next_position


def random_entry(rng, block_id):
    start = int(rng.integers(0, 16))
    return (block_id, block_id * 4096, start, int(rng.integers(1, 17 - start)),
            int(rng.integers(1, 5)))


def stream_of(s, entries, positions):
    columns = [list(c) for c in zip(*entries)] if entries else [[] for _ in range(5)]
    return StreamTable(s // 3, s % 3, *columns, np.array(positions, dtype=np.int64))


def entries_of(st):
    return list(zip(st.ids, st.offsets, st.starts, st.counts, st.precisions))


def random_new_list(rng, held, ids, next_position, positions):
    """Held entries kept in order (some dropped, some with their run changed), new ones
    inserted: (entry, its positions) each, a kept entry's positions the held ones."""
    held_positions = np.split(held.positions, np.cumsum(held.counts)[:-1]) \
        if positions and held.ids else []
    new = []  # (entry, its positions, or None for fresh ones)

    def insert_some():
        while rng.random() < 0.3:
            new.append((random_entry(rng, next(ids)), None))

    for i, e in enumerate(entries_of(held)):
        insert_some()
        roll = rng.random()
        if roll < 0.6:
            new.append((e, held_positions[i].tolist() if positions else []))
        elif roll < 0.75:  # the same block, its run changed: a given entry
            start = (e[2] + 1) % 16
            new.append(((e[0], e[1], start, min(e[3], 16 - start), e[4]), None))
    insert_some()
    return [(e, ps if ps is not None else
             [next(next_position) for _ in range(e[3])] if positions else [])
            for e, ps in new]


def add_delta_stream(d, s, held, new):
    """Stream s's part of a delta from `held` to `new`: maximal runs of entries the two lists
    share (in order), every other entry given."""
    held_index = {e: i for i, e in enumerate(entries_of(held))}
    runs, given, last = [], [], -1
    for at, (entry, entry_positions) in enumerate(new):
        i = held_index.get(entry, -1)
        if i > last:
            if runs and runs[-1][0] + runs[-1][2] == at and runs[-1][1] + runs[-1][2] == i:
                runs[-1][2] += 1
            else:
                runs.append([at, i, 1])
            last = i
        else:
            given.append((entry, entry_positions))
    d.stream.append(s)
    d.block_count.append(len(new))
    d.run_count.append(len(runs))
    for at, i, n in runs:
        d.kept_at.append(at)
        d.kept_from.append(i)
        d.kept_count.append(n)
    for (block_id, offset, start, count, precision), entry_positions in given:
        d.block_ids.append(block_id)
        d.block_offsets.append(offset)
        d.block_starts.append(start)
        d.block_counts.append(count)
        d.block_precisions.append(precision)
        d.positions.extend(entry_positions)


def corruptions(rng, d, table):
    """Changes that each make the delta break one of its rules, so that it must not apply."""
    out = [("base_version", lambda d: setattr(d, "base_version", d.base_version + 1)),
           ("given column longer", lambda d: d.block_starts.append(0))]
    if table.positions:
        out.append(("a position too many", lambda d: d.positions.append(-1)))
    listed = len(d.stream)
    if listed:
        i = int(rng.integers(0, listed))
        out += [("block_count + 1", lambda d: d.block_count.__setitem__(i, d.block_count[i] + 1)),
                ("run_count + 1", lambda d: d.run_count.__setitem__(i, d.run_count[i] + 1)),
                ("stream past the table", lambda d: d.stream.__setitem__(listed - 1, 6))]
        if d.block_count[i]:
            out.append(("block_count - 1",
                        lambda d: d.block_count.__setitem__(i, d.block_count[i] - 1)))
        if listed > 1:
            out.append(("stream repeated", lambda d: d.stream.__setitem__(1, d.stream[0])))
    if d.kept_count:
        r = int(rng.integers(0, len(d.kept_count)))
        run_stream = [s for s, n in zip(d.stream, d.run_count) for _ in range(n)][r]
        held_blocks = table.streams[run_stream].num_blocks
        out += [("kept_count + 1", lambda d: d.kept_count.__setitem__(r, d.kept_count[r] + 1)),
                ("run past the held list", lambda d: d.kept_from.__setitem__(r, held_blocks))]
    return out


@pytest.mark.parametrize("positions", [False, True], ids=["no-positions", "positions"])
def test_random_deltas_apply_exactly_and_corrupted_ones_not_at_all(positions):
    for seed in range(150):
        rng = np.random.default_rng(seed)
        table, ids, next_position = random_held_table(rng, positions)
        update = pb.TableUpdate()
        d = update.delta
        d.base_version, d.version, d.epoch = 5, 6, 4
        expected = [(entries_of(st), st.positions.tolist()) for st in table.streams]
        for s, st in enumerate(table.streams):
            if rng.random() < 0.6:
                new = random_new_list(rng, st, ids, next_position, positions)
                add_delta_stream(d, s, st, new)
                expected[s] = ([e for e, _ in new], [p for _, ps in new for p in ps])
        for name, corrupt in corruptions(rng, d, table):
            bad = copy.deepcopy(update)
            corrupt(bad.delta)
            before = copy.deepcopy(table)
            assert not apply_table_update(7, bad, table), f"seed {seed}: {name} applied"
            same_table(table, before)
            assert all(np.array_equal(x.positions, y.positions)
                       for x, y in zip(table.streams, before.streams))
        assert apply_table_update(7, update, table), f"seed {seed}"
        assert (table.version, table.epoch) == (6, 4)
        for s, st in enumerate(table.streams):
            assert entries_of(st) == expected[s][0], f"seed {seed} stream {s}"
            assert st.positions.tolist() == (expected[s][1] if positions else []), \
                f"seed {seed} stream {s}"


# ---- the lease renewer (a fake KeepAlive, the manual clock) --------------------------------

def recording_renewer(clock, results=None):
    calls = []
    called = threading.Semaphore(0)

    def keep_alive(ids):
        calls.append((clock(), list(ids)))
        called.release()
        return [results.get(i) if results else None for i in ids]

    return LeaseRenewer(keep_alive, lambda: 1024, clock), calls, called


def test_renewer_renews_while_sequences_keep_arriving():
    clock = ManualClock()
    renewer, calls, called = recording_renewer(clock)
    try:
        renewer.register(1, 3.0)  # due a second from now
        for i in range(20):  # a new sequence every 100 ms for 2 s, each waking the thread
            clock.advance(0.1)
            renewer.register(100 + i, 3.0)
            renewer.wake()
        assert called.acquire(timeout=5), "no renewal while sequences kept arriving"
        assert 1 in calls[0][1] and calls[0][0] <= clock()
    finally:
        renewer.close()


def test_renewer_renews_sooner_for_a_shorter_lease():
    clock = ManualClock()
    renewer, calls, called = recording_renewer(clock)
    try:
        renewer.register(1, 60.0)  # due in 20 s
        clock.advance(1.0)
        renewer.register(2, 1.5)  # due in 0.5 s: the thread must not sleep on until 20 s
        clock.advance(0.5)
        renewer.wake()
        assert called.acquire(timeout=5)
        assert calls == [(1001.5, [1, 2])]
        clock.advance(0.5)  # the next one is a third of the shortest lease later
        renewer.wake()
        assert called.acquire(timeout=5)
        assert calls[1] == (1002.0, [1, 2])
    finally:
        renewer.close()


def test_renewer_forgets_a_lapsed_sequence():
    clock = ManualClock()
    gone = kvmem.NotFoundError("sequence 2: not found")
    renewer, calls, called = recording_renewer(clock, {2: gone})
    try:
        renewer.register(1, 3.0)
        renewer.register(2, 3.0)
        clock.advance(1.0)
        renewer.wake()
        assert called.acquire(timeout=5)
        assert wait_until(lambda: renewer.lapsed(2) is gone) and renewer.lapsed(1) is None
        clock.advance(1.0)
        renewer.wake()
        assert called.acquire(timeout=5)
        assert calls[1][1] == [1]  # 2 is not renewed again
    finally:
        renewer.close()


def test_renewer_close_joins_a_thread_that_is_ending():
    # The thread decides to end (nothing to renew), then lingers: close() must wait for it.
    ending = threading.Event()

    def linger_when_ending(frame, event, arg):
        if event != "call" or frame.f_code.co_name != "_due_ids":
            return None

        def on_return(frame, event, arg):
            if event == "return" and arg is None:
                ending.set()
                time.sleep(0.2)
            return on_return
        return on_return

    renewer, _, _ = recording_renewer(ManualClock())
    threading.settrace(linger_when_ending)  # for the thread register() starts
    try:
        renewer.register(1, 60.0)
    finally:
        threading.settrace(None)
    thread = renewer._thread
    renewer.unregister(1)
    assert ending.wait(5)
    renewer.close()
    assert not thread.is_alive()


def test_client_close_cuts_a_keep_alive_in_flight():
    # Nothing listens: with wait_for_ready the renewer's KeepAlive and close()'s releases
    # would each wait out the deadline.
    sock = pathlib.Path(f"/tmp/kvmem-py-nobody-{os.getpid()}.sock")
    sock.unlink(missing_ok=True)
    clock = ManualClock()
    options = kvmem.ClientOptions(deadline=10, wait_for_ready=True)
    client = kvmem.Client(f"unix:{sock}", options, clock=clock)
    calling = threading.Event()
    keep_alive = client.keep_alive

    def announcing_keep_alive(ids):
        calling.set()
        return keep_alive(ids)

    client.keep_alive = announcing_keep_alive
    client._track(5, None, "full")  # a sequence close() releases
    client._renewer.register(5, 3.0)
    clock.advance(1.0)
    client._renewer.wake()
    assert calling.wait(5)
    started = time.monotonic()
    client.close()
    assert time.monotonic() - started < 5  # not the 10 s deadline
    assert not client.renewer_running and client.live_sequences == []


# ---- one table, several threads (a fake stub) ---------------------------------------------

class OneAtATimeStub:
    """Answers Append with the whole table at the next version; the first call waits a little
    for a second one to come in beside it, which a table's lock must prevent."""

    def __init__(self):
        self.lock = threading.Lock()
        self.inside = 0
        self.most_inside = 0
        self.held_versions = []
        self.second_came = threading.Event()

    def Append(self, q, timeout=None, wait_for_ready=None):
        with self.lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
            self.held_versions.append(q.client_table.version)
            first = len(self.held_versions) == 1
        if first:
            self.second_came.wait(0.3)
        else:
            self.second_came.set()
        version = q.client_table.version + 1
        r = pb.AppendResponse(appended_tokens=1, table_version=version)
        t = r.table_update.table
        t.sequence_id, t.version, t.epoch, t.block_tokens = q.sequence_id, version, version, 16
        t.layout.num_layers, t.layout.num_kv_heads, t.layout.head_dim = 1, 1, 8
        t.streams.add(layer=0, kv_head=0, block_ids=[version])
        with self.lock:
            self.inside -= 1
        return r


def test_calls_on_one_table_run_one_at_a_time_and_apply_in_order():
    client = kvmem.Client("unix:/nonexistent/kvmem.sock")
    stub = OneAtATimeStub()
    client._stub = stub
    table = empty_table(7, positions=False)
    k = np.zeros((1, 1, 1, 8), np.float16)
    errors_seen = []

    def append():
        try:
            client.append(7, kvmem.NewTokens([0], k, k), table)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors_seen.append(e)

    threads = [threading.Thread(target=append) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.close()
    assert errors_seen == []
    assert stub.most_inside == 1
    assert stub.held_versions == [0, 1]  # the second call named what the first applied
    assert table.version == 2 and table.streams[0].ids == [2]
    assert client.table_refetches == 0


# ---- errors (no daemon) -------------------------------------------------------------------

class FakeRpcError(grpc.RpcError):
    def __init__(self, code, message, trailing):
        self._code, self._message, self._trailing = code, message, trailing

    def code(self):
        return self._code

    def details(self):
        return self._message

    def trailing_metadata(self):
        return self._trailing


def test_malformed_status_details_still_give_the_calls_error():
    e = errors.from_grpc(FakeRpcError(grpc.StatusCode.NOT_FOUND, "sequence 5: not found",
                                      (("grpc-status-details-bin", b"\xff\xff\xff"),)))
    assert isinstance(e, kvmem.NotFoundError)
    assert e.message == "sequence 5: not found" and e.details == []
    # A detail whose bytes are not its type's stays packed.
    rich = status_pb2.Status(code=9, message="epoch: stale")
    rich.details.add(type_url="type.googleapis.com/google.rpc.ErrorInfo", value=b"\xff\xff")
    e = errors.from_grpc(FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "epoch: stale",
                                      (("grpc-status-details-bin", rich.SerializeToString()),)))
    assert type(e) is kvmem.FailedPreconditionError and e.current_epoch is None


def test_the_first_error_info_is_kept():
    first = error_details_pb2.ErrorInfo(reason="STALE_EPOCH", domain="kvmem",
                                        metadata={"current_epoch": "12", "current_version": "30"})
    second = error_details_pb2.ErrorInfo(reason="OTHER", metadata={"current_epoch": "99"})
    e = errors.error_of(grpc.StatusCode.FAILED_PRECONDITION, "epoch: stale", [first, second])
    assert isinstance(e, kvmem.StaleEpochError)
    assert (e.reason, e.current_epoch, e.current_version) == ("STALE_EPOCH", 12, 30)


def test_a_stale_read_answered_aborted_is_a_stale_epoch_error():
    info = error_details_pb2.ErrorInfo(reason="STALE_EPOCH", metadata={"current_epoch": "4"})
    e = errors.error_of(grpc.StatusCode.ABORTED, "epoch: changed from 3 to 4 during the read",
                        [info])
    assert isinstance(e, kvmem.StaleEpochError) and isinstance(e, kvmem.FailedPreconditionError)
    assert not isinstance(e, kvmem.AbortedError)
    assert e.code is grpc.StatusCode.ABORTED and e.current_epoch == 4


def test_daemon_down_is_unavailable():
    sock = pathlib.Path(f"/tmp/kvmem-py-none-{os.getpid()}.sock")
    options = kvmem.ClientOptions(deadline=5, initial_backoff=0.01, max_backoff=0.05)
    with kvmem.Client(f"unix:{sock}", options) as client:
        started = time.monotonic()
        with pytest.raises(kvmem.UnavailableError, match="unreachable"):
            client.get_info()
        assert time.monotonic() - started < 5
