"""kvmemd's KV events (--kv-events-endpoint) as a router would consume them: a subscriber that
decodes every batch kvmemd publishes (pyzmq and msgpack, written here from vLLM's schema,
not kvmemd's code) rebuilds the set of cached block hashes; after every step of a workload
(publishes, reclaims under pool pressure, a salt, both wire forms) it equals kvmemd's own
index, and every block's token ids hash (sha256_cbor, as vLLM's prefix caching) to the
hash announced. Batches missed before the subscriber joined come back through the replay
socket, the first one being AllBlocksCleared."""
import hashlib
import os

import numpy as np
import pytest

from kvmem_testing import kvmem, layout, running_daemon

zmq = pytest.importorskip("zmq")
msgpack = pytest.importorskip("msgpack")
cbor2 = pytest.importorskip("cbor2")


def sha256_cbor(value):
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


ROOT = sha256_cbor("0")  # kvmemd's default --prefix-hash-seed


def events_of(payload):
    """A batch's events as (kind, fields) in either wire form."""
    batch = msgpack.unpackb(payload, raw=False)
    if isinstance(batch, dict):  # vLLM's map form: each event a map, its "type" the tag
        assert set(batch) <= {"ts", "events", "data_parallel_rank"}
        assert isinstance(batch["ts"], float)
        return [(e["type"], e) for e in batch["events"]]
    ts, events = batch[0], batch[1]  # the positional form: [ts, events, dp rank]
    assert isinstance(ts, float) and (len(batch) == 2 or batch[2] is None)
    out = []
    for e in events:
        names = {"BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size",
                                 "lora_id", "medium", "lora_name", "extra_keys"],
                 "BlockRemoved": ["block_hashes", "medium"],
                 "AllBlocksCleared": []}[e[0]]
        assert len(e) - 1 <= len(names)
        out.append((e[0], dict(zip(names, e[1:]))))
    return out


class Router:
    """The cached blocks as the events tell them."""

    def __init__(self):
        self.blocks = set()
        self.next_seq = 0
        self.stored = 0
        self.removed = 0

    def apply(self, seq, payload):
        if seq < self.next_seq:
            return  # already had from the replay (a subscriber's join overlaps it)
        assert seq == self.next_seq, f"batch {seq}, expected {self.next_seq}: a gap"
        self.next_seq += 1
        for kind, e in events_of(payload):
            if kind == "AllBlocksCleared":
                self.blocks.clear()
            elif kind == "BlockStored":
                assert e["medium"] == "CPU" and e["lora_id"] is None
                tokens = e["token_ids"]
                assert e["block_size"] == len(tokens) // len(e["block_hashes"])
                parent = e["parent_block_hash"]
                extra = e.get("extra_keys")
                for i, h in enumerate(e["block_hashes"]):
                    block = tuple(tokens[i * e["block_size"]:(i + 1) * e["block_size"]])
                    keys = tuple(extra[i]) if extra and extra[i] is not None else None
                    expect = sha256_cbor((parent if parent is not None else ROOT, block, keys))
                    assert h == expect, "the token ids do not hash to the announced hash"
                    parent = h
                    self.blocks.add(h)
                    self.stored += 1
            elif kind == "BlockRemoved":
                for h in e["block_hashes"]:
                    assert h in self.blocks, "a removal of a block never announced"
                    self.blocks.discard(h)
                    self.removed += 1
            else:
                raise AssertionError(f"unknown event {kind}")


def drain(sub, router, timeout_ms=300):
    """Every batch published so far (the publisher sends within about 10 ms)."""
    while sub.poll(timeout_ms):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        router.apply(int.from_bytes(seq, "big"), payload)


def replay(ctx, endpoint, start):
    """The kept batches from `start` on, asked as a REQ socket asks (an empty delimiter,
    then the start); a DEALER takes the several answers a REQ would not."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    batches = []
    while True:
        assert dealer.poll(5000), "no replay answer"
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if int.from_bytes(seq, "big", signed=True) == -1:
            assert payload == b""
            break
        batches.append((int.from_bytes(seq, "big"), payload))
    dealer.close(linger=0)
    return batches


@pytest.mark.parametrize("form", ["array", "map"])
def test_events_rebuild_the_index(form):
    tag = f"ev{form}"
    pub = f"ipc:///tmp/kvmem-events-{tag}-{os.getpid()}"
    rep = f"ipc:///tmp/kvmem-replay-{tag}-{os.getpid()}"
    lay = layout(block_tokens=8)
    with running_daemon(tag, f"--kv_events_endpoint={pub}", f"--kv_events_replay_endpoint={rep}",
                        "--kv_events_topic=kv", f"--kv_events_format={form}",
                        "--pool_bytes=2097152") as target:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub)
        client = kvmem.Client(target)
        router = Router()
        # What the subscriber missed before it joined (at least AllBlocksCleared, seq 0).
        missed = replay(ctx, rep, 0)
        assert missed and missed[0][0] == 0
        assert events_of(missed[0][1])[0][0] == "AllBlocksCleared"
        for seq, payload in missed:
            router.apply(seq, payload)

        def check():
            drain(sub, router)
            assert len(router.blocks) == client.stats().prefix_entries

        rng = np.random.default_rng(5)
        held = []
        for round_ in range(12):
            tokens = [int(t) for t in rng.integers(0, 1000, size=64)]
            salt = "s1" if round_ % 3 == 0 else ""
            prompt = kvmem.Prompt(tokens, cache_salt=salt, model="")
            k = rng.standard_normal(lay.kv_shape(64)).astype(np.float16)
            seq = client.create_sequence(lay, prompt=prompt)
            seq.append(range(64), k, k, token_ids=tokens)
            assert seq.publish() == 64
            seq.release()
            check()
            # Sequences that hold the pool: the index gives its cached blocks back.
            filler = client.create_sequence(lay)
            big = rng.standard_normal(lay.kv_shape(2048)).astype(np.float16)
            try:
                filler.append(range(2048), big, big)
                held.append(filler)
            except kvmem.KvmemError:
                filler.release()
                for h in held:
                    h.release()
                held.clear()
            check()
        assert router.removed > 0, "nothing was reclaimed: the pool was not under pressure"
        assert router.stored >= 12 * 8
        # A second subscriber that asks for everything sees the same blocks.
        late = Router()
        for seq, payload in replay(ctx, rep, 0):
            late.apply(seq, payload)
        assert late.blocks == router.blocks
        for h in held:
            h.release()
        sub.close(linger=0)
        ctx.term()


def test_a_tcp_endpoint_beyond_loopback_is_refused():
    from kvmem_testing import start_daemon
    with pytest.raises(AssertionError, match="did not start"):
        start_daemon("evtcp", "--kv_events_endpoint=tcp://*:0")
