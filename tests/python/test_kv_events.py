"""kvmemd's KV events (--kv-events-endpoint) as a router would consume them: a subscriber that
decodes every batch kvmemd publishes (pyzmq and msgpack, written here from vLLM's schema,
not kvmemd's code) rebuilds the set of cached block hashes; after every step of a workload
(publishes, reclaims under pool pressure, a salt, both wire forms) it equals kvmemd's own
index, and every block's token ids hash (sha256_cbor, as vLLM's prefix caching) to the
hash announced. Batches missed before the subscriber joined come back through the replay
socket, the first one being AllBlocksCleared."""
import hashlib
import os
import subprocess

import numpy as np
import pytest

from kvmem_testing import CI, kvmem, layout, running_daemon

if CI:  # scripts/python_deps.sh installs them: missing, the run fails
    import cbor2
    import msgpack
    import zmq
else:
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


def external(digest, form):
    """A hash as the events carry it: vLLM's default int (the digest's last 8 bytes,
    big-endian), or the digest."""
    return int.from_bytes(digest, "big") & (2**64 - 1) if form == "int" else digest


def chain(tokens, salt, block_tokens, form):
    """A prompt's block hashes as a router computes them (vLLM's hash_block_tokens)."""
    parent, out = ROOT, []
    for i in range(len(tokens) // block_tokens):
        extra = (salt,) if i == 0 and salt else None
        parent = sha256_cbor((parent, tuple(tokens[i * block_tokens:(i + 1) * block_tokens]),
                              extra))
        out.append(external(parent, form))
    return out


class Router:
    """The cached blocks as the events tell them."""

    def __init__(self, hash_form, block_tokens):
        self.hash_form = hash_form
        self.block_tokens = block_tokens
        self.digests = {}  # announced hash -> its full digest (a child's hash covers it)
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
                assert e["block_size"] == self.block_tokens
                assert len(tokens) == self.block_tokens * len(e["block_hashes"])
                parent = e["parent_block_hash"]
                digest = ROOT if parent is None else self.digests[parent]
                extra = e.get("extra_keys")
                for i, h in enumerate(e["block_hashes"]):
                    block = tuple(tokens[i * self.block_tokens:(i + 1) * self.block_tokens])
                    keys = tuple(extra[i]) if extra and extra[i] is not None else None
                    digest = sha256_cbor((digest, block, keys))
                    assert h == external(digest, self.hash_form), \
                        "the token ids do not hash to the announced hash"
                    self.digests[h] = digest
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


@pytest.mark.parametrize("form,hash_form", [("array", "int"), ("map", "bytes")])
def test_events_rebuild_the_index(form, hash_form):
    tag = f"ev{form}"
    pub = f"ipc:///tmp/kvmem-events-{tag}-{os.getpid()}"
    rep = f"ipc:///tmp/kvmem-replay-{tag}-{os.getpid()}"
    lay = layout(block_tokens=8)
    with running_daemon(tag, f"--kv_events_endpoint={pub}", f"--kv_events_replay_endpoint={rep}",
                        "--kv_events_topic=kv", f"--kv_events_format={form}",
                        f"--kv_events_hash={hash_form}",
                        "--pool_bytes=2097152") as target:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub)
        client = kvmem.Client(target)
        router = Router(hash_form, 8)
        # What the subscriber missed before it joined (at least AllBlocksCleared, seq 0).
        missed = replay(ctx, rep, 0)
        assert missed and missed[0][0] == 0
        assert events_of(missed[0][1])[0][0] == "AllBlocksCleared"
        for seq, payload in missed:
            router.apply(seq, payload)

        published = []  # (tokens, salt) of every prompt published

        def check():
            """The router's blocks are kvmemd's: as many, and each published prompt's
            longest cached prefix (Lookup) is the one the router would route by."""
            drain(sub, router)
            assert len(router.blocks) == client.stats().prefix_entries
            for tokens, salt in published:
                held = 0
                for h in chain(tokens, salt, 8, hash_form):
                    if h not in router.blocks:
                        break
                    held += 1
                prompt = kvmem.Prompt(tokens, cache_salt=salt, model="")
                assert client.lookup(lay, prompt) == min(held, 7) * 8  # never the last token

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
            published.append((tokens, salt))
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
        late = Router(hash_form, 8)
        for seq, payload in replay(ctx, rep, 0):
            late.apply(seq, payload)
        assert late.blocks == router.blocks
        for h in held:
            h.release()
        sub.close(linger=0)
        ctx.term()


def refusal(*flags):
    """kvmemd's stderr when it refuses to start with `flags`."""
    from kvmem_testing import KVMEMD, require_daemon
    require_daemon()
    done = subprocess.run([str(KVMEMD), "--listen=127.0.0.1:0", "--metrics_listen=",
                           "--pool_prefault=false", *flags],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode != 0, "kvmemd started"
    return done.stderr


def test_endpoints_anyone_could_reach_are_refused(tmp_path):
    assert "reachable beyond this host" in refusal("--kv_events_endpoint=tcp://*:5557")
    assert "abstract socket" in refusal("--kv_events_endpoint=ipc://@kvmem-events")
    tokens = tmp_path / "tokens"
    tokens.write_text("alice alice-token-0123456789\n")
    # With tenants, even a local endpoint: every tenant's token ids would reach it.
    message = refusal(f"--auth_tokens={tokens}",
                      f"--kv_events_endpoint=ipc://{tmp_path}/events")
    assert "--kv-events-trusted-network" in message
    # Loopback without tenants starts, its ipc socket is kvmemd's user's only.
    path = tmp_path / "events"
    with running_daemon("evok", f"--kv_events_endpoint=ipc://{path}"):
        assert (path.stat().st_mode & 0o777) == 0o600
