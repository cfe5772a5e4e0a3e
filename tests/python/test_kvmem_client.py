"""The Python client (client/python, package `kvmem`) against a real kvmemd on a unix socket.
Its parts that need no daemon (table deltas, the lease renewer, errors) are tested against
fakes in test_kvmem_client_units.py.

Needs the package installed (`python3 -m pip install ./client/python`; the stubs are
generated at build time) and build/kvmemd (or $KVMEM_BIN/kvmemd); skips, saying which is
missing, otherwise; with KVMEM_CI=1 a missing one fails instead. What is appended is the
oracle: reads (gRPC ReadKv and the same-host mapped pool) must give back exactly those bytes
at the positions the table retains.
"""
import copy
import dataclasses
import gc
import os
import pathlib
import threading

import numpy as np
import pytest

pytest.register_assert_rewrite("kvmem_testing")
from kvmem_testing import (ManualClock, kvmem, layout, require_daemon,  # noqa: E402
                           running_daemon, same_table, start_daemon, stop_daemon,
                           wait_until)
from kvmem.v1 import kvmem_pb2 as pb  # noqa: E402

@pytest.fixture(scope="module")
def daemon():
    with running_daemon("main", "--pool_bytes=67108864") as target:
        yield target


@pytest.fixture
def client(daemon):
    with kvmem.Client(daemon) as c:
        yield c


def random_kv(lay, n, seed):
    """K and V [L][H][n][D] in the layout dtype: random normals (bf16: rounded from f32)."""
    rng = np.random.default_rng(seed)
    shape = lay.kv_shape(n)
    out = []
    for _ in range(2):
        x = rng.standard_normal(shape, dtype=np.float32)
        if lay.dtype is kvmem.DType.BF16:
            out.append(kvmem.float32_to_bf16(x))
        else:
            out.append(x.astype(lay.dtype.numpy))
    return out


def expect_stream(stream, k_all, v_all, positions_all):
    """The stream's K/V are the appended rows at the positions it retains, byte for byte."""
    index = {int(p): i for i, p in enumerate(positions_all)}
    rows = [index[int(p)] for p in stream.positions]
    k = k_all[stream.layer, stream.kv_head, rows]
    v = v_all[stream.layer, stream.kv_head, rows]
    assert stream.k.dtype == k.dtype and stream.k.shape == k.shape
    assert stream.k.tobytes() == k.tobytes()
    assert stream.v.tobytes() == v.tobytes()


def sequence_ids(client):
    return {s.sequence_id for s in client.stats(include_sequences=True).sequences}


# ---- verbs against the daemon -------------------------------------------------------------

def test_wrong_kv_dtype_or_shape_is_refused_before_sending(client):
    lay = layout()
    with client.create_sequence(lay) as seq:
        k, v = random_kv(lay, 4, 0)
        with pytest.raises(TypeError, match="F16"):
            seq.append(range(4), k.astype(np.float32), v)
        with pytest.raises(ValueError, match=r"\[L\]\[H\]\[n\]\[D\]"):
            seq.append(range(3), k, v)


def test_info_lists_policies_and_the_shared_pool(client):
    info = client.get_info()
    assert info.backend == "cpu"
    assert {"full", "window", "h2o"} <= {p.name for p in info.policies}
    assert info.policy("h2o").step_signals == ["attention_rows"]
    assert info.shm_bytes and info.epoch_slots and len(info.attach_ticket) == 32
    assert info.instance_id != 0 and client.get_info().instance_id == info.instance_id


@pytest.mark.parametrize("dtype", list(kvmem.DType), ids=lambda d: d.name)
def test_append_and_read_back_exactly(client, dtype):
    lay = layout(dtype)
    k, v = random_kv(lay, 45, seed=int(dtype))
    positions = np.arange(45)
    with client.create_sequence(lay) as seq, client.attach_shared_pool() as pool:
        seq.append(positions[:20], k[:, :, :20], v[:, :, :20], token_ids=list(range(20)))
        chunks = [kvmem.NewTokens(positions[a:b], k[:, :, a:b], v[:, :, a:b])
                  for a, b in ((20, 30), (30, 45))]
        result = seq.append_stream(chunks)
        assert result.appended_tokens == 45
        assert client.table_refetches == 0  # kept current from deltas alone
        same_table(seq.table, client.get_block_table(seq.id, positions=False))
        streams = seq.read_kv()
        assert [(s.layer, s.kv_head) for s in streams] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        for s in streams:
            assert s.positions.tolist() == list(range(45))
            expect_stream(s, k, v, positions)
            mapped = pool.read_stream(seq.table, s.layer, s.kv_head)
            assert mapped.k.tobytes() == s.k.tobytes() and mapped.v.tobytes() == s.v.tobytes()
        with pool.reading(seq.table) as blocks:
            views = blocks.stream(1, 0)
            assert not views[0].k.flags.writeable  # the pool is mapped read-only
            first = np.concatenate([b.k for b in views])
        assert first.tobytes() == k[1, 0].tobytes()


def test_window_step_evicts_and_the_table_follows(client):
    lay = layout()
    k, v = random_kv(lay, 64, seed=5)
    with client.create_sequence(lay, kvmem.PolicySpec("window", {"window": 16}),
                                table_positions=True) as seq:
        seq.append(range(64), k, v)
        epoch = seq.table.epoch
        step = seq.step()
        assert step.evicted_tokens > 0 and step.epoch != epoch
        assert seq.table.epoch == step.epoch
        same_table(seq.table, client.get_block_table(seq.id, positions=True))
        for s in seq.read_kv():
            assert 16 <= len(s.positions) < 64 and s.positions[-1] == 63
            assert np.array_equal(s.positions, seq.table.stream(s.layer, s.kv_head).positions)
            expect_stream(s, k, v, np.arange(64))


def test_h2o_step_with_attention_rows_and_compress(client):
    lay = layout()
    k, v = random_kv(lay, 48, seed=6)
    with client.create_sequence(lay, kvmem.PolicySpec("h2o", {"budget": 24})) as seq:
        seq.append(range(48), k, v)
        rows = [kvmem.StreamSignal(l, h, np.full(48, 1 / 48, np.float32))
                for l in range(2) for h in range(2)]
        step = seq.step(attention=rows, attention_f16=True)
        assert step.epoch == seq.table.epoch
        # H2O keeps C = 24 of the 48 in every stream (no pyramid).
        assert [st.num_slots for st in seq.table.streams] == [24] * 4
        result = seq.compress(target_tokens=8)
        assert all(layer.kept_tokens <= 2 * 8 for layer in result.layers)
        assert seq.table.streams[0].num_slots == 8
        for s in seq.read_kv():
            expect_stream(s, k, v, np.arange(48))


def test_step_batch_answers_each_entry(client):
    lay = layout()
    k, v = random_kv(lay, 2, seed=7)
    with client.create_sequence(lay) as a, client.create_sequence(lay) as b:
        entries = [kvmem.BatchEntry(a, append=kvmem.NewTokens([0], k[:, :, :1], v[:, :, :1]),
                                    step=kvmem.StepArgs()),
                   kvmem.BatchEntry(b, append=kvmem.NewTokens([0, 1], k, v)),
                   kvmem.BatchEntry(10**12, step=kvmem.StepArgs())]
        results = client.step_batch(entries)
        assert results[0].ok and results[0].appended.appended_tokens == 1 and results[0].step
        assert results[1].ok and results[1].appended.appended_tokens == 2
        assert isinstance(results[2].error, kvmem.NotFoundError)
        assert a.table.streams[0].num_slots == 1 and b.table.streams[3].num_slots == 2
        same_table(b.table, client.get_block_table(b.id, positions=False))


def test_fork_is_copy_on_write(client):
    lay = layout()
    k, v = random_kv(lay, 24, seed=8)
    with client.create_sequence(lay) as parent:
        parent.append(range(20), k[:, :, :20], v[:, :, :20])
        with parent.fork() as child:
            assert child.parent_id == parent.id
            assert child.table.version == child.created_table_version  # carried over
            child.append(range(20, 24), k[:, :, 20:], v[:, :, 20:])
            same_table(child.table, client.get_block_table(child.id, positions=False))
            assert [len(s.positions) for s in child.read_kv()] == [24] * 4
            for s in child.read_kv():
                expect_stream(s, k, v, np.arange(24))
        assert [len(s.positions) for s in parent.read_kv()] == [20] * 4


def test_publish_lookup_and_prefix_reuse(client):
    lay = layout(block_tokens=8)
    tokens = list(range(100, 140))
    k, v = random_kv(lay, 40, seed=9)
    prompt = kvmem.Prompt(tokens, cache_salt="tenant-a", model="test")
    with client.create_sequence(lay, prompt=prompt) as first:
        assert first.reused_prefix_tokens == 0
        first.append(range(40), k, v, token_ids=tokens)
        assert first.publish() == 40
        assert client.lookup(lay, prompt) == 32  # whole blocks, never the last token
        assert client.lookup(lay, kvmem.Prompt(tokens, cache_salt="tenant-b", model="test")) == 0
        with client.create_sequence(lay, prompt=prompt) as second:
            assert second.reused_prefix_tokens == 32
            for s in second.read_kv():
                expect_stream(s, k, v, np.arange(40))


@pytest.mark.parametrize("precision", [kvmem.Precision.INT8, kvmem.Precision.INT4,
                                       kvmem.Precision.NF4], ids=lambda p: p.name)
def test_same_host_read_dequantizes_as_the_daemon(client, precision):
    lay = layout(D=80)  # nf4: two scale groups a slot, the second one partial
    k, v = random_kv(lay, 64, seed=10)
    policy = kvmem.PolicySpec("full", quantization=precision, quantization_recent_tokens=16)
    with client.create_sequence(lay, policy) as seq, client.attach_shared_pool() as pool:
        seq.append(range(64), k, v)
        seq.step()
        assert int(precision) in seq.table.streams[0].precisions, "nothing quantized"
        for s in seq.read_kv():
            mapped = pool.read_stream(seq.table, s.layer, s.kv_head)
            assert mapped.k.tobytes() == s.k.tobytes() and mapped.v.tobytes() == s.v.tobytes()
            # the recent tokens stay exact
            assert s.k[-16:].tobytes() == k[s.layer, s.kv_head, -16:].tobytes()


@pytest.mark.parametrize("dtype", [kvmem.DType.F32, kvmem.DType.F16, kvmem.DType.BF16],
                         ids=lambda d: d.name)
def test_read_all_is_every_stream_as_read_kv_gives_it(client, dtype):
    lay = layout(dtype=dtype, L=4, H=2, D=24, block_tokens=8)
    k, v = random_kv(lay, 90, seed=14)
    # pyramidkv keeps fewer tokens in deeper layers and its own top slots per stream (streams
    # of different lengths, with holes); int8 storage of all but the 8 newest mixes
    # quantized and layout-precision blocks.
    policy = kvmem.PolicySpec("pyramidkv", {"budget": 40, "window": 4, "beta": 4},
                              quantization=kvmem.Precision.INT8, quantization_recent_tokens=8)
    rng = np.random.default_rng(15)
    with client.create_sequence(lay, policy) as seq, client.attach_shared_pool() as pool:
        seq.append(range(90), k, v)
        scores = [kvmem.StreamSignal(st.layer, st.kv_head, rng.random(90).astype(np.float32))
                  for st in seq.table.streams]
        seq.compress(window_scores=scores)
        seq.step()  # quantizes what left the recent window
        read = pool.read_all(seq.table)
        assert read.table.epoch == seq.table.epoch
        assert len({int(c) for c in read.counts}) > 1, "streams should differ in length"
        quantized = {p for st in seq.table.streams for p in st.precisions}
        assert int(kvmem.Precision.INT8) in quantized and int(kvmem.Precision.LAYOUT) in quantized
        for s in seq.read_kv():
            i = s.layer * lay.num_kv_heads + s.kv_head
            n = int(read.counts[i])
            assert n == len(s.k) and n < read.k.shape[1] or n == read.k.shape[1]
            assert read.k[i, :n].tobytes() == s.k.tobytes()
            assert read.v[i, :n].tobytes() == s.v.tobytes()
            assert not read.k[i, n:].any() and not read.v[i, n:].any()  # padding is zero


@pytest.mark.parametrize("policy", [kvmem.PolicySpec("full"),
                                    kvmem.PolicySpec("window", {"window": 20}),
                                    kvmem.PolicySpec("full", quantization=kvmem.Precision.INT8,
                                                     quantization_recent_tokens=8)],
                         ids=["full", "window", "int8"])
def test_read_all_since_the_last_read_equals_a_fresh_read(client, policy):
    lay = layout(dtype=kvmem.DType.F32, L=2, H=2, D=16, block_tokens=8)
    k, v = random_kv(lay, 60, seed=16)
    with client.create_sequence(lay, policy) as seq, client.attach_shared_pool() as pool:
        seq.append(range(5), k[:, :, :5], v[:, :, :5])
        last = pool.read_all(seq.table, room=1)
        partial = 0
        for t in range(5, 60):  # one token a step: tails grow, blocks are added, and
            seq.append([t], k[:, :, t:t + 1], v[:, :, t:t + 1])  # window/int8 rewrite
            seq.step()
            fresh = pool.read_all(seq.table, room=1)
            partial += last.table.epoch == fresh.table.epoch
            again = pool.read_all(seq.table, room=1, since=last)
            assert np.array_equal(again.counts, fresh.counts)
            for i, n in enumerate(fresh.counts):
                assert again.k[i, :n].tobytes() == fresh.k[i, :n].tobytes(), (t, i)
                assert again.v[i, :n].tobytes() == fresh.v[i, :n].tobytes(), (t, i)
            last = again
        assert partial > 0, "no step kept the epoch: the incremental path never ran"


# ---- errors -------------------------------------------------------------------------------

def test_stale_epoch_carries_the_current_epoch(client):
    lay = layout()
    k, v = random_kv(lay, 64, seed=11)
    with client.create_sequence(lay, kvmem.PolicySpec("window", {"window": 16})) as seq, \
            client.attach_shared_pool() as pool:
        seq.append(range(64), k, v)
        old = copy.deepcopy(seq.table)
        pool.read_stream(old, 0, 0)
        seq.step()
        assert seq.table.epoch != old.epoch
        with pytest.raises(kvmem.StaleEpochError) as e:
            seq.read_kv(epoch=old.epoch)
        assert e.value.current_epoch == seq.table.epoch
        with pytest.raises(kvmem.StaleEpochError) as e:
            pool.read_stream(old, 0, 0)
        assert e.value.current_epoch == seq.table.epoch
        with pytest.raises(kvmem.StaleEpochError) as e:
            with pool.reading(old):
                pass

    # Attention rows name the epoch they were computed on (a window step sends none).
    with client.create_sequence(lay, kvmem.PolicySpec("h2o", {"budget": 16})) as seq:
        seq.append(range(64), k, v)
        old = copy.deepcopy(seq.table)
        rows = [kvmem.StreamSignal(l, h, np.full(64, 1 / 64)) for l in range(2) for h in range(2)]
        seq.step(attention=rows)
        assert seq.table.epoch != old.epoch
        with pytest.raises(kvmem.StaleEpochError) as e:
            client.step(seq.id, kvmem.StepArgs(old.epoch, attention=rows))
        assert e.value.code.name == "FAILED_PRECONDITION"
        assert e.value.current_epoch == seq.table.epoch
        assert e.value.current_version == seq.table.version


@pytest.mark.parametrize("params, field", [({"window": 0}, "policy.params[window]"),
                                           ({"size": 3}, "policy.params[size]")])
def test_bad_policy_parameter_names_the_field(client, params, field):
    with pytest.raises(kvmem.InvalidArgumentError) as e:
        client.create_sequence(layout(), kvmem.PolicySpec("window", params))
    assert e.value.field == field and field in str(e.value)
    assert client.live_sequences == []


def test_pool_full_names_the_limit():
    proc, target, sock = start_daemon("full", "--pool_bytes=1048576")
    try:
        with kvmem.Client(target) as client:
            lay = layout(L=4, H=4, D=128, block_tokens=16)
            k, v = random_kv(lay, 16, seed=12)
            with client.create_sequence(lay) as seq, pytest.raises(
                    kvmem.ResourceExhaustedError) as e:
                for i in range(64):  # 16 blocks of 8 KiB a call; the pool is 1 MiB
                    seq.append(range(16 * i, 16 * i + 16), k, v)
            # The flag as the daemon's message spells it ("--pool-bytes"; absl defines
            # --pool_bytes and kvmemd takes both).
            assert e.value.limit in ("--pool-bytes", "--pool_bytes")
            stats = client.stats()
            assert stats.sequences_active == 0
            assert stats.blocks_forsaken == 0 and stats.bytes_forsaken == 0
    finally:
        stop_daemon(proc, sock)


def test_wait_for_ready_waits_for_a_daemon_that_starts_late():
    require_daemon()  # here, not in the timer's thread
    sock = pathlib.Path(f"/tmp/kvmem-py-late-{os.getpid()}.sock")
    sock.unlink(missing_ok=True)
    # No retries: only wait_for_ready can carry a call over the daemon's late start.
    without = kvmem.ClientOptions(deadline=10, max_attempts=1)
    with kvmem.Client(f"unix:{sock}", without) as client:
        with pytest.raises(kvmem.UnavailableError):
            client.get_info()
    client = kvmem.Client(f"unix:{sock}", dataclasses.replace(without, wait_for_ready=True))
    holder = {}

    def start_late():
        try:
            holder["daemon"] = start_daemon("late")
        except BaseException as e:  # noqa: BLE001 (re-raised by the test's thread)
            holder["error"] = e
            client.close()  # cancels the waiting call: no wait for the deadline

    timer = threading.Timer(0.3, start_late)
    timer.start()
    try:
        try:
            info = client.get_info()
        except kvmem.KvmemError:
            if "error" in holder:
                raise holder["error"] from None
            raise
        assert info.backend == "cpu" and "daemon" in holder
    finally:
        timer.join()
        client.close()
        if "daemon" in holder:
            stop_daemon(holder["daemon"][0], holder["daemon"][2])


def test_release_of_a_gone_sequence_is_not_found(client):
    seq = client.create_sequence(layout())
    client.release(seq.id)
    with pytest.raises(kvmem.NotFoundError):
        client.release(seq.id)
    assert seq.release() == 0  # the handle knows it is gone


# ---- lifetime -----------------------------------------------------------------------------

def test_context_manager_releases_on_keyboard_interrupt(client):
    with pytest.raises(KeyboardInterrupt):
        with client.create_sequence(layout()) as seq:
            assert seq.id in sequence_ids(client)
            raise KeyboardInterrupt
    assert seq.released and seq.id not in sequence_ids(client)
    assert client.live_sequences == []


def test_leases_are_renewed_in_the_background(daemon):
    clock = ManualClock()
    with kvmem.Client(daemon, clock=clock) as client, kvmem.Client(daemon) as other:
        answers = []
        answered = threading.Semaphore(0)
        keep_alive = client.keep_alive

        def recording_keep_alive(ids):
            results = keep_alive(ids)
            answers.append(dict(zip(ids, results)))
            answered.release()
            return results

        client.keep_alive = recording_keep_alive
        with client.create_sequence(layout(), lease=3) as seq:
            assert client.renewer_running
            clock.advance(1.0)  # a third of the lease
            client._renewer.wake()
            assert answered.acquire(timeout=5)
            assert answers == [{seq.id: None}]  # renewed by the daemon
            other.release(seq.id)  # gone behind the client's back
            clock.advance(1.0)
            client._renewer.wake()
            assert answered.acquire(timeout=5)
            assert isinstance(answers[1][seq.id], kvmem.NotFoundError)
            # Recorded once the answer is back (after the fake returned it).
            assert wait_until(lambda: isinstance(seq.lapsed(), kvmem.NotFoundError))
        assert wait_until(lambda: not client.renewer_running)  # no sequence: no thread


def test_no_thread_or_sequence_leaks_after_100_sequences(daemon):
    gc.collect()
    threads = threading.active_count()
    lay = layout()
    k, v = random_kv(lay, 4, seed=13)
    with kvmem.Client(daemon) as client:
        before = client.stats()
        for i in range(100):
            if i % 2:
                with client.create_sequence(lay) as seq:
                    seq.append(range(4), k, v)
            else:
                seq = client.create_sequence(lay, kvmem.PolicySpec("window", {"window": 4}))
                seq.append(range(4), k, v)
                seq.release()
        after = client.stats(include_sequences=True)
        assert after.sequences_created - before.sequences_created == 100
        assert after.sequences_active == before.sequences_active
        assert client.live_sequences == []
    # The renewer thread ended with the last sequence; the client's close joined it.
    assert threading.active_count() == threads


def test_close_releases_what_is_still_open(daemon):
    client = kvmem.Client(daemon)
    held = [client.create_sequence(layout()) for _ in range(3)]
    dropped = client.create_sequence(layout(), lease=60).id  # the handle is dropped at once
    gc.collect()
    assert client.live_sequences == sorted(s.id for s in held)  # dropped: no longer renewed
    client.close()
    assert all(s.release() == 0 for s in held)  # close() released them
    with kvmem.Client(daemon) as other:
        assert not {s.id for s in held} & sequence_ids(other)
        other.release(dropped)  # the daemon still holds it (until its lease lapses)


# ---- same-host reads: one snapshot per read ---------------------------------------------

def test_a_same_host_read_is_checked_against_its_snapshot(client):
    lay = layout()
    k, v = random_kv(lay, 64, seed=14)
    with client.create_sequence(lay, kvmem.PolicySpec("window", {"window": 16})) as seq, \
            client.attach_shared_pool() as pool:
        seq.append(range(64), k, v)
        before = seq.table.snapshot()
        with pytest.raises(kvmem.StaleEpochError, match="during the read"):
            with pool.reading(seq.table) as blocks:
                # The step moves the daemon's epoch and the table together: checked
                # against the table as it is now, the read would pass.
                seq.step()
                assert seq.table.epoch != before.epoch
                assert blocks.table.epoch == before.epoch
                assert sum(b.count for b in blocks.stream(0, 0)) == 64  # the snapshot's
        with pytest.raises(kvmem.FailedPreconditionError, match="exited"):
            blocks.stream(0, 0)
        with pool.reading(seq.table) as blocks:
            views = blocks.stream(1, 1)
            k_read = np.concatenate([b.k for b in views])
        assert len(k_read) == seq.table.stream(1, 1).num_slots < 64
        assert k_read.tobytes() == k[1, 1, 64 - len(k_read):].tobytes()


def test_a_table_of_no_epoch_is_never_read(client):
    with client.create_sequence(layout()) as seq, client.attach_shared_pool() as pool:
        unheld = copy.deepcopy(seq.table)
        unheld.forget()
        unheld.epoch_slot = pool.epochs.slots - 1
        assert pool.epochs.word(unheld.epoch_slot) == 0  # an unused slot: 2 * epoch 0
        with pytest.raises(kvmem.StaleEpochError, match="no epoch"):
            pool.read_stream(unheld, 0, 0)


def test_same_host_reads_are_refused_off_x86(client, monkeypatch):
    import platform
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with pytest.raises(kvmem.FailedPreconditionError, match="x86-64"):
        client.attach_shared_pool()


# ---- a daemon with a table area: this client never asks for it -------------------------

class AreaAnswers:
    """The daemon's stub, with every StepBatch result rewritten as a table-area reader would
    get it: the version in table_in_area and no update; and the requests recorded."""

    def __init__(self, stub):
        self._stub = stub
        self.requests = []

    def __getattr__(self, name):
        return getattr(self._stub, name)

    def StepBatch(self, q, **kwargs):
        self.requests.append(q)
        r = self._stub.StepBatch(q, **kwargs)
        for result in r.results:
            result.table_in_area = 1 + max(result.table_update.delta.version,
                                           result.table_update.table.version)
            result.ClearField("table_update")
        return r


def test_table_area_is_not_used_and_its_answers_refetch_the_table():
    proc, target, sock = start_daemon("area", "--pool_bytes=67108864",
                                      "--table_area_bytes=1048576")
    try:
        with kvmem.Client(target) as client:
            assert client._stub.GetInfo(pb.GetInfoRequest()).HasField("table_area")
            lay = layout()
            k, v = random_kv(lay, 40, seed=15)
            with client.create_sequence(lay, kvmem.PolicySpec("window", {"window": 16})) as seq:
                seq.append(range(32), k[:, :, :32], v[:, :, :32])
                for t in range(32, 36):  # decode steps: the daemon answers with updates
                    entry = kvmem.BatchEntry(seq, append=kvmem.NewTokens(
                        [t], k[:, :, t:t + 1], v[:, :, t:t + 1]), step=kvmem.StepArgs())
                    assert client.step_batch([entry])[0].ok
                assert client.table_refetches == 0
                same_table(seq.table, client.get_block_table(seq.id, positions=False))

                area = AreaAnswers(client._stub)
                client._stub = area
                entry = kvmem.BatchEntry(seq, append=kvmem.NewTokens(
                    [36], k[:, :, 36:37], v[:, :, 36:37]), step=kvmem.StepArgs())
                assert client.step_batch([entry])[0].ok
                assert client.table_refetches == 1
                same_table(seq.table, client.get_block_table(seq.id, positions=False))
                # An entry that failed whole but names the area is fetched too.
                refused = kvmem.BatchEntry(seq, append=kvmem.NewTokens(  # a position again
                    [36], k[:, :, 36:37], v[:, :, 36:37]))
                assert isinstance(client.step_batch([refused])[0].error,
                                  kvmem.InvalidArgumentError)
                assert client.table_refetches == 2
                assert not any(e.client_table.from_area
                               for q in area.requests for e in q.entries)
                for s in seq.read_kv():
                    expect_stream(s, k, v, np.arange(40))
    finally:
        stop_daemon(proc, sock)


def test_a_table_too_large_for_one_message_comes_in_pieces():
    # 4 layers x 2 heads x (3000 positions of 2 bytes + 188 block entries) pass a 32 KiB
    # message limit: the daemon refuses the whole table; the client joins it from pieces.
    with running_daemon("pieces", "--pool_bytes=67108864", "--max_message_bytes=32768") as target:
        with kvmem.Client(target) as c:
            lay = layout(L=4, H=2, D=8)
            with c.create_sequence(lay) as seq:
                for first in range(0, 3000, 100):
                    k, v = random_kv(lay, 100, first)
                    seq.append(range(first, first + 100), k, v)
                whole = pb.GetBlockTableRequest(sequence_id=seq.id, positions=True)
                with pytest.raises(kvmem.ResourceExhaustedError, match="layers: the table of layers"):
                    c._call(c._stub.GetBlockTable, whole)
                table = c.get_block_table(seq.id)
                assert [(s.layer, s.kv_head) for s in table.streams] == [
                    (layer, h) for layer in range(4) for h in range(2)]
                for s in table.streams:
                    assert list(s.positions) == list(range(3000))
                same_table(table, c.get_block_table(seq.id))
