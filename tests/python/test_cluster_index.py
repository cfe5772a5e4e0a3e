"""The fleet's shared prefix index (kvmemd --cluster-index) on a real redis-server: two
kvmemd share it; a prompt one node published is found by the other's Lookup (which node,
how many tokens), under the announced keys the token ids hash to; tenants' chains stay
apart; a node stopped withdraws its claims, a node killed leaves claims that lapse within
the TTL; Redis killed mid-workload never blocks a request and, restarted empty, gets every
claim back by the next renewal; the metrics count what happened."""
import hashlib
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time
import urllib.request

import numpy as np
import pytest

from kvmem_testing import (CI, kvmem, layout, make_certificates, pause, start_daemon,
                           stop_daemon, ucx_built, wait_until)

if CI:  # scripts/python_deps.sh and scripts/deps.sh install them: missing, the run fails
    import cbor2
else:
    cbor2 = pytest.importorskip("cbor2")

REDIS = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
if not (REDIS and REDIS_CLI):
    if CI:
        raise RuntimeError("redis-server or redis-cli missing (scripts/deps.sh installs them)")
    pytest.skip("redis-server is not installed", allow_module_level=True)

TTL = 3  # seconds: claims renewed every second, a dead node's gone within 3


def sha256_cbor(value):
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def chain(tokens, salt, block_tokens):
    """A prompt's block hashes (vLLM's hash_block_tokens, kvmemd's default seed), for the
    blocks a Lookup counts: never the one holding the last token."""
    parent, out = sha256_cbor("0"), []
    for i in range((len(tokens) - 1) // block_tokens):
        extra = (salt,) if i == 0 and salt else None
        parent = sha256_cbor((parent, tuple(tokens[i * block_tokens:(i + 1) * block_tokens]),
                              extra))
        out.append(parent)
    return out


class Redis:
    """A redis-server on a unix socket of its own, without persistence."""

    def __init__(self, directory):
        self.socket = pathlib.Path(directory) / "redis.sock"
        self.proc = None

    def start(self):
        self.socket.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [REDIS, "--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700",
             "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert wait_until(lambda: self.socket.exists() and self.cli("PING") == "PONG", 10)

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def cli(self, *args):
        done = subprocess.run([REDIS_CLI, "-s", str(self.socket), *args], capture_output=True,
                              text=True, timeout=10)
        return done.stdout.strip()

    def url(self):
        return f"unix://{self.socket}"


@pytest.fixture
def redis(tmp_path):
    r = Redis(tmp_path)
    r.start()
    yield r
    if r.proc.poll() is None:
        r.kill()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def address(tag):
    """The address peers reach a node at: its own unix socket (start_daemon's path)."""
    return f"unix:/tmp/kvmem-py-fleet{tag}-{os.getpid()}.sock"


class Node:
    def __init__(self, tag, redis, *flags, peers=(), options=None):
        self.name = address(tag)
        if peers:
            flags = (*flags, "--cluster_peers=" + ",".join(address(p) for p in peers))
        self.metrics_port = free_port()
        self.proc, self.target, self.sock = start_daemon(
            f"fleet{tag}", f"--cluster_index={redis.url()}",
            f"--cluster_node_address={self.name}", f"--cluster_index_ttl_seconds={TTL}",
            f"--metrics_listen=127.0.0.1:{self.metrics_port}", "--pool_bytes=4194304",
            "--cluster_index_timeout_ms=1000", *flags)
        self.client = kvmem.Client(self.target, options or kvmem.ClientOptions())

    def stop(self):
        self.client.close()
        stop_daemon(self.proc, self.sock)

    def metrics(self):
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                      timeout=5).read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith(("kvmem_cluster_index", "kvmem_prefix_pull",
                                "kvmem_sequence_move")) and " " in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


LAY = layout(block_tokens=8)


def publish(node, tokens, salt="", seed=None):
    prompt = kvmem.Prompt(tokens, cache_salt=salt, model="m")
    rng = np.random.default_rng(len(tokens) if seed is None else seed)
    k = rng.standard_normal(LAY.kv_shape(len(tokens)))
    k = k.astype(np.float16)
    seq = node.client.create_sequence(LAY, prompt=prompt)
    seq.append(range(len(tokens)), k, k, token_ids=tokens)
    assert seq.publish() == len(tokens)
    return seq


def fleet(client, p):
    """The fleet's holders of prompt `p`, asked until the index answers (its connections
    open a moment after kvmemd starts, and a sanitizer build may pass the timeout once)."""
    answer = None
    for _ in range(100):
        answer = client.fleet_lookup(LAY, p)
        if answer.available:
            return answer.holders
        time.sleep(0.02)
    raise AssertionError(answer.unavailable)


def holders(node, tokens, salt=""):
    return fleet(node.client, kvmem.Prompt(tokens, cache_salt=salt, model="m"))


def prompt(seed, n=64):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 1000, size=n)]


def test_a_prompt_one_node_published_is_found_from_the_other(redis):
    a, b = Node("a", redis), Node("b", redis)
    try:
        tokens = prompt(1)
        seq = publish(a, tokens)
        # 64 tokens of 8: the 7 blocks before the last token's.
        assert wait_until(lambda: holders(b, tokens) == [(a.name, 56)], 5)
        assert b.client.lookup(LAY, kvmem.Prompt(tokens, model="m")) == 0  # B holds none
        # A longer prompt with the same start: A published all 8 blocks of its 64 tokens.
        assert holders(b, tokens + prompt(2, 40)) == [(a.name, 64)]
        # The keys are the blocks' sha256_cbor chain, as a router computes it.
        keys = redis.cli("--scan", "--pattern", "kvmem:*").split()
        hexes = {k.rsplit(":", 1)[1] for k in keys}
        assert hexes == {h.hex() for h in chain(tokens + [0], "", 8)}
        assert all(redis.cli("ZRANGE", k, "0", "-1") == a.name for k in keys)
        # Another prompt: nobody; another salt (another tenant's chain): nobody.
        assert holders(b, prompt(3)) == []
        assert holders(b, tokens, salt="s1") == []
        salted = publish(a, prompt(4), salt="s1")
        assert wait_until(lambda: holders(b, prompt(4), salt="s1") == [(a.name, 56)], 5)
        assert holders(b, prompt(4)) == []
        # Both nodes hold it: both named, longest first.
        mine = publish(b, tokens[:40] + [5] * 24)
        assert wait_until(lambda: holders(a, tokens) == [(a.name, 56), (b.name, 40)], 5)
        m = a.metrics()
        assert m['kvmem_cluster_index_updates_total{outcome="added"}'] == 16
        assert m["kvmem_cluster_index_entries"] == 16
        assert m["kvmem_cluster_index_connected"] == 1
        assert m['kvmem_cluster_index_lookups_total{result="answered"}'] >= 1
        assert m['kvmem_cluster_index_seconds_count{op="write"}'] >= 1
        for s in (seq, salted, mine):
            s.release()
        # The pool under pressure: A's index gives cached blocks back, and its claims go
        # with them (what Redis names of A is what A's index holds).
        fillers = []
        big = np.zeros(LAY.kv_shape(2048), np.float16)
        for _ in range(64):
            f = a.client.create_sequence(LAY)
            try:
                f.append(range(2048), big, big)
            except kvmem.KvmemError:
                f.release()
                break
            fillers.append(f)
        entries = a.client.stats().prefix_entries
        assert entries < 16, "nothing was reclaimed: the pool was not under pressure"

        def claims_of_a():
            keys = redis.cli("--scan", "--pattern", "kvmem:*").split()
            return sum(a.name in redis.cli("ZRANGE", k, "0", "-1").split() for k in keys)

        assert wait_until(lambda: claims_of_a() == entries, 5)
        assert a.metrics()['kvmem_cluster_index_updates_total{outcome="removed"}'] == 16 - entries
        for f in fillers:
            f.release()
        # A stopped node withdraws its claims at once.
        a.stop()
        assert holders(b, tokens) == [(b.name, 40)]
        assert claims_of_a() == 0
        a = None
    finally:
        if a is not None:
            a.stop()
        b.stop()


def test_tenants_never_see_each_others_prefixes_across_nodes(redis, tmp_path):
    tokens = tmp_path / "tokens"
    alice_token, bob_token = "alice-token-0123456789abcdef", "bob-token-0123456789abcdef"
    tokens.write_text(f"alice {alice_token}\nbob {bob_token}\n")
    auth = f"--auth_tokens={tokens}"
    a, b = Node("ta", redis, auth), Node("tb", redis, auth, peers=["ta"])

    def as_(node, token):
        return kvmem.Client(node.target, kvmem.ClientOptions(auth_token=token, max_attempts=1))

    try:
        with as_(a, alice_token) as alice_a, as_(b, alice_token) as alice_b, \
                as_(b, bob_token) as bob_b:
            tokens_ = prompt(11)
            for salt in ("", "shared-salt"):  # a client salt subdivides a tenant, never crosses
                k = np.zeros(LAY.kv_shape(64), np.float16)
                seq = alice_a.create_sequence(LAY, prompt=kvmem.Prompt(tokens_, cache_salt=salt,
                                                                       model="m"))
                seq.append(range(64), k, k, token_ids=tokens_)
                assert seq.publish() == 64
                p = kvmem.Prompt(tokens_, cache_salt=salt, model="m")
                assert wait_until(lambda: fleet(alice_b, p) == [(a.name, 56)], 5)
                # Bob asks for the same tokens (and the same client salt) on either node:
                # nobody holds them, as if they were never published.
                assert fleet(bob_b, p) == []
                assert bob_b.lookup(LAY, p) == 0
                # Nor can Bob pull them: for his chain the index names no holder, even when he
                # names Alice's node (and his token would go with the pull).
                assert bob_b.pull_prefix(LAY, p).pulled_tokens == 0
                with pytest.raises(kvmem.FailedPreconditionError, match="names no peer"):
                    bob_b.pull_prefix(LAY, p, from_node=a.name)
                # Alice can: her token goes with it, and B then holds her prefix for her.
                assert alice_b.pull_prefix(LAY, p).pulled_tokens == 56
                assert alice_b.lookup(LAY, p) == 56
                assert bob_b.lookup(LAY, p) == 0
    finally:
        a.stop()
        b.stop()


def read_all(seq):
    """A sequence's K and V as {(layer, head): (positions, k, v)}."""
    return {(s.layer, s.kv_head): (list(s.positions), bytes(s.k), bytes(s.v))
            for s in seq.read_kv()}


def peer_token(directory):
    """The flag that gives a node a peer token (its peers' pools mapped or read by UCX)."""
    token = directory / "peer-token"
    token.write_text("fleet-peer-token-0123456789\n")
    return f"--cluster_peer_token_file={token}"


def assert_same_prefix(a, b, p, tokens=None):
    """A sequence of prompt `p` on node B maps what one on A does (`tokens` of it, when
    given), byte for byte."""
    seq_b = b.client.create_sequence(LAY, prompt=p)
    seq_a = a.client.create_sequence(LAY, prompt=p)
    try:
        if tokens is not None:
            assert (seq_b.reused_prefix_tokens, seq_a.reused_prefix_tokens) == (tokens, tokens)
        assert read_all(seq_b) == read_all(seq_a)
    finally:
        seq_a.release()
        seq_b.release()


def test_a_prefix_one_node_holds_is_pulled_byte_for_byte(redis):
    # B appends at most 2 KiB of K/V a chunk: a pull of 56 tokens (7 KiB) goes in several.
    a, c, d = Node("pa", redis), Node("pc", redis), Node("pd", redis)
    b = Node("pb", redis, "--max_message_bytes=2048", peers=["pa", "pd"])
    try:
        tokens = prompt(21)
        publish(a, tokens)  # 64 tokens: 8 blocks published
        p = kvmem.Prompt(tokens, model="m")
        assert wait_until(lambda: holders(b, tokens) == [(a.name, 56)], 5)
        # B pulls what A holds of the prompt (the blocks a CreateSequence maps: 7).
        pulled = b.client.pull_prefix(LAY, p)
        assert (pulled.local_tokens, pulled.pulled_tokens, pulled.from_node) == (0, 56, a.name)
        assert pulled.bytes == 56 * 2 * LAY.num_layers * LAY.num_kv_heads * LAY.head_dim * 2
        # Now B holds it: a request there maps it, and its K/V are A's, byte for byte.
        assert_same_prefix(a, b, p, tokens=56)
        # The fleet sees both; a second pull finds nothing more to pull.
        assert wait_until(lambda: holders(a, tokens) == [(a.name, 56), (b.name, 56)], 5)
        again = b.client.pull_prefix(LAY, p)
        assert (again.local_tokens, again.pulled_tokens) == (56, 0)
        # A holder that is not one of B's peers is never asked, named or not.
        only_c = prompt(24)
        publish(c, only_c)
        assert wait_until(lambda: holders(b, only_c) == [(c.name, 56)], 5)
        assert b.client.pull_prefix(LAY, kvmem.Prompt(only_c, model="m")).pulled_tokens == 0
        with pytest.raises(kvmem.FailedPreconditionError, match="cluster-peers"):
            b.client.pull_prefix(LAY, kvmem.Prompt(only_c, model="m"), from_node=c.name)
        # Without peers, no pulls at all.
        with pytest.raises(kvmem.FailedPreconditionError, match="cluster-peers"):
            c.client.pull_prefix(LAY, p)
        # From an address the index does not name as a holder: refused, nothing asked of it.
        before = b.client.stats().prefix_entries
        with pytest.raises(kvmem.FailedPreconditionError, match="names no peer"):
            b.client.pull_prefix(LAY, kvmem.Prompt(prompt(22), model="m"),
                                 from_node="127.0.0.1:1")
        # A holder gone (killed: its claims still in the index): the next peer holding it
        # serves the pull; with none, the error names the holder, and B is unchanged.
        publish(a, prompt(23))
        publish(a, prompt(25))
        publish(d, prompt(25))
        assert wait_until(lambda: holders(b, prompt(23)) == [(a.name, 56)], 5)
        assert wait_until(lambda: len(holders(b, prompt(25))) == 2, 5)
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait()
        a.proc = None
        with pytest.raises(kvmem.KvmemError, match="holder"):
            b.client.pull_prefix(LAY, kvmem.Prompt(prompt(23), model="m"))
        assert b.client.stats().prefix_entries == before
        fallback = b.client.pull_prefix(LAY, kvmem.Prompt(prompt(25), model="m"))
        assert (fallback.pulled_tokens, fallback.from_node) == (56, d.name)
        m = b.metrics()
        assert m['kvmem_prefix_pulls_total{result="pulled"}'] == 2
        # Three refused or failed (the client retries the UNAVAILABLE one: more calls).
        assert m['kvmem_prefix_pulls_total{result="failed"}'] >= 3
        assert m['kvmem_prefix_pulls_total{result="nothing"}'] == 2
        assert m["kvmem_prefix_pulled_tokens_total"] == 112
        assert m['kvmem_prefix_pulled_bytes_total{transport="grpc"}'] == 2 * pulled.bytes
        assert m['kvmem_prefix_pulled_bytes_total{transport="attach"}'] == 0
    finally:
        if a.proc is not None:
            a.stop()
        for node in (b, c, d):
            node.stop()


def test_a_prefix_is_pulled_by_ucx_as_by_grpc_when_worth_it(redis, tmp_path, monkeypatch):
    # A runs --ucx (no tokens: every caller may read its pool); B has A as a peer and a
    # peer token, so B maps A's pool (the same host) or, asked for UCX, reads A's blocks by
    # RMA gets (over TCP, as between hosts); C has A as a peer but no token: gRPC only.
    if not ucx_built():
        pytest.skip("kvmemd was built without UCX")
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_WARN_UNUSED_ENV_VARS", "n")
    a = Node("ua", redis, "--ucx", "--ucx_trusted_network")
    b = Node("ub", redis, peer_token(tmp_path), peers=["ua"])
    c = Node("uc", redis, peers=["ua"])
    try:
        first, second = prompt(31), prompt(32)
        publish(a, first)
        publish(a, second)
        assert wait_until(lambda: holders(b, first) == [(a.name, 56)], 5)
        assert wait_until(lambda: holders(b, second) == [(a.name, 56)], 5)
        p = kvmem.Prompt(first, model="m")
        # Not worth it: the holder has 56 tokens more, fewer than asked; nothing is read.
        skipped = b.client.pull_prefix(LAY, p, min_tokens=57)
        assert (skipped.pulled_tokens, skipped.holder_tokens, skipped.from_node,
                skipped.transport, skipped.bytes) == (0, 56, a.name, "", 0)
        assert b.client.lookup(LAY, p) == 0
        # Worth it: by UCX, byte for byte A's.
        pulled = b.client.pull_prefix(LAY, p, transport="ucx", min_tokens=56)
        assert (pulled.pulled_tokens, pulled.transport) == (56, "ucx"), pulled
        assert pulled.bytes == 56 * 2 * LAY.num_layers * LAY.num_kv_heads * LAY.head_dim * 2
        assert_same_prefix(a, b, p, tokens=56)
        # Asked for gRPC: the same bytes by ReadKv.
        q = kvmem.Prompt(second, model="m")
        by_grpc = b.client.pull_prefix(LAY, q, transport="grpc")
        assert (by_grpc.pulled_tokens, by_grpc.transport) == (56, "grpc")
        assert_same_prefix(a, b, q)
        # C cannot read A's pool: gRPC when any will do, refused when UCX or a mapping is
        # asked for.
        assert c.client.pull_prefix(LAY, p).transport == "grpc"
        with pytest.raises(kvmem.FailedPreconditionError, match="cluster-peer-token-file"):
            c.client.pull_prefix(LAY, q, transport="ucx")
        with pytest.raises(kvmem.FailedPreconditionError, match="cluster-peer-token-file"):
            c.client.pull_prefix(LAY, q, transport="attach")
        # B, asked for nothing in particular, maps A's pool (the same host).
        fourth = prompt(34)
        publish(a, fourth, seed=34)
        assert wait_until(lambda: holders(b, fourth) == [(a.name, 56)], 5)
        r = kvmem.Prompt(fourth, model="m")
        mapped = b.client.pull_prefix(LAY, r)
        assert (mapped.pulled_tokens, mapped.transport, mapped.bytes) == (56, "attach",
                                                                          pulled.bytes)
        assert_same_prefix(a, b, r)
        # B's bytes by how they came.
        m = b.metrics()
        assert [m[f'kvmem_prefix_pulled_bytes_total{{transport="{t}"}}']
                for t in ("attach", "ucx", "grpc")] == [mapped.bytes, pulled.bytes, by_grpc.bytes]
        with pytest.raises(kvmem.InvalidArgumentError, match="transport"):
            b.client.pull_prefix(LAY, q, transport="rdma")
        # A gone: B's kept connection to its pool fails the pull in bounded time, naming the
        # holder, and changes nothing on B.
        third = prompt(33)
        publish(a, third)
        assert wait_until(lambda: holders(b, third) == [(a.name, 56)], 5)
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait()
        a.proc = None
        before = b.client.stats().prefix_entries
        start = time.monotonic()
        with pytest.raises(kvmem.KvmemError, match="holder"):
            b.client.pull_prefix(LAY, kvmem.Prompt(third, model="m"))
        assert time.monotonic() - start < 30
        assert b.client.stats().prefix_entries == before
    finally:
        for node in (a, b, c):
            if node.proc is not None:
                node.stop()


def test_a_holder_restarted_on_its_address_is_mapped_again_before_a_pull_reads(redis,
                                                                              tmp_path):
    # B keeps its mapping of A's pool from one pull to the next. A restarts on its address
    # and publishes other K/V: the next pull must read the new A's pool, never the old
    # mapping (whose memory B's mapping still holds, with the old A's blocks and epochs).
    a = Node("ra", redis)
    b = Node("rb", redis, peer_token(tmp_path), peers=["ra"])
    try:
        first, second = prompt(41), prompt(42)
        publish(a, first, seed=41)
        assert wait_until(lambda: holders(b, first) == [(a.name, 56)], 5)
        p = kvmem.Prompt(first, model="m")
        assert b.client.pull_prefix(LAY, p, transport="attach").transport == "attach"
        assert_same_prefix(a, b, p)
        a.stop()
        a = Node("ra", redis)
        publish(a, second, seed=42)
        assert wait_until(lambda: holders(b, second) == [(a.name, 56)], 5)
        q = kvmem.Prompt(second, model="m")
        pulled = b.client.pull_prefix(LAY, q, transport="attach")
        assert (pulled.pulled_tokens, pulled.transport) == (56, "attach"), pulled
        assert_same_prefix(a, b, q)
    finally:
        for node in (a, b):
            if node.proc is not None:
                node.stop()


def test_a_pull_by_mapping_adds_to_what_the_node_holds_in_chunks_across_blocks(redis,
                                                                              tmp_path):
    # B holds the prompt's first 16 tokens, A 56; B appends at most 1,536 bytes of K/V a
    # chunk (12 tokens: every other block spans two chunks). Asked for no transport, B maps
    # A's pool (no UCX needed) and reads only the 40 tokens it lacks, byte for byte A's.
    a = Node("xa", redis)
    b = Node("xb", redis, peer_token(tmp_path), "--max_message_bytes=1536",
             peers=["xa"])
    try:
        tokens = prompt(51)
        k = np.random.default_rng(51).standard_normal(LAY.kv_shape(64)).astype(np.float16)
        for node, n in ((a, 64), (b, 17)):
            seq = node.client.create_sequence(LAY, prompt=kvmem.Prompt(tokens[:n], model="m"))
            part = np.ascontiguousarray(k[:, :, :n])
            for i in range(0, n, 8):  # B's own appends stay under its 1,536 bytes
                j = min(n, i + 8)
                seq.append(range(i, j), part[:, :, i:j], part[:, :, i:j], token_ids=tokens[i:j])
            assert seq.publish() == n // 8 * 8  # whole blocks
        assert wait_until(lambda: holders(b, tokens) == [(a.name, 56), (b.name, 16)], 5)
        p = kvmem.Prompt(tokens, model="m")
        assert b.client.lookup(LAY, p) == 16
        per_token = 2 * LAY.num_layers * LAY.num_kv_heads * LAY.head_dim * 2
        pulled = b.client.pull_prefix(LAY, p)
        assert (pulled.local_tokens, pulled.pulled_tokens, pulled.transport,
                pulled.bytes) == (16, 40, "attach", 40 * per_token), pulled
        assert_same_prefix(a, b, p, tokens=56)
        m = b.metrics()
        assert [m[f'kvmem_prefix_pulled_bytes_total{{transport="{t}"}}']
                for t in ("attach", "ucx", "grpc")] == [40 * per_token, 0, 0]
    finally:
        for node in (a, b):
            node.stop()


def test_a_prefix_is_pulled_over_tls_from_a_node_that_proves_its_name(redis, tmp_path):
    # A serves TLS; B trusts A's CA (--cluster-peer-tls-ca): B's pulls go over TLS, the
    # tenant's token inside. C speaks plaintext to A: its pull fails and C holds nothing.
    make_certificates(tmp_path)
    tokens = tmp_path / "tokens"
    tokens.write_text("alice alice-token-0123456789\n")
    alice = dict(max_attempts=1, deadline=20, auth_token="alice-token-0123456789")
    a = Node("ta", redis, f"--tls_cert={tmp_path}/server.pem",
             f"--tls_key={tmp_path}/server.key", f"--auth_tokens={tokens}",
             options=kvmem.ClientOptions(tls_root_certs=(tmp_path / "ca.pem").read_bytes(),
                                         tls_server_name="localhost", **alice))
    b = Node("tb", redis, f"--cluster_peer_tls_ca={tmp_path}/ca.pem", f"--auth_tokens={tokens}",
             peers=["ta"], options=kvmem.ClientOptions(**alice))
    c = Node("tc", redis, f"--auth_tokens={tokens}", peers=["ta"],
             options=kvmem.ClientOptions(**alice))
    try:
        tokens_ = prompt(31)
        held = publish(a, tokens_)
        p = kvmem.Prompt(tokens_, model="m")
        assert wait_until(lambda: holders(b, tokens_) == [(a.name, 56)], 5)
        with pytest.raises(kvmem.KvmemError, match="holder"):
            c.client.pull_prefix(LAY, p)
        assert c.client.stats().prefix_entries == 0
        pulled = b.client.pull_prefix(LAY, p)
        assert (pulled.pulled_tokens, pulled.from_node) == (56, a.name)
        assert_same_prefix(a, b, p, tokens=56)
        held.release()
    finally:
        for node in (a, b, c):
            node.stop()


def test_a_sequence_moves_whole_to_another_node(redis):
    # MoveSequence: B takes A's sequence (quantized and evicted blocks, its window's state)
    # and A lets it go; B's copy reads as A's did and steps on.
    a = Node("ma", redis)
    b = Node("mb", redis, peers=["ma"])
    try:
        policy = kvmem.PolicySpec("window", {"window": 40}, kvmem.Precision.INT8, 8)
        seq = a.client.create_sequence(LAY, policy)
        k = np.random.default_rng(5).standard_normal(LAY.kv_shape(64)).astype(np.float16)
        seq.append(range(64), k, k, token_ids=list(range(64)))
        seq.step()
        before = read_all(seq)
        assert all(len(p) == 40 for p, _, _ in before.values())
        moved = b.client.move_sequence(a.name, seq.id)
        assert read_all(moved) == before
        # B has no peer token: the blocks came by gRPC.
        m = b.metrics()
        assert m['kvmem_sequence_moves_total{result="moved"}'] == 1
        assert m['kvmem_sequence_moved_bytes_total{transport="grpc"}'] > 0
        assert m['kvmem_sequence_moved_bytes_total{transport="attach"}'] == 0
        with pytest.raises(kvmem.NotFoundError):
            a.client.get_block_table(seq.id)
        k1 = np.random.default_rng(6).standard_normal(LAY.kv_shape(1)).astype(np.float16)
        moved.append([64], k1, k1, token_ids=[64])
        moved.step()
        assert all(p == list(range(25, 65)) for p, _, _ in read_all(moved).values())
        # Nothing to move from a node that is not a peer, or the other way round.
        other = b.client.create_sequence(LAY)
        with pytest.raises(kvmem.FailedPreconditionError):
            a.client.move_sequence(b.name, other.id)
        moved.release()
        other.release()
    finally:
        b.stop()
        a.stop()


def test_without_an_index_a_fleet_lookup_is_refused(redis):
    proc, target, sock = start_daemon("nofleet")
    try:
        with kvmem.Client(target) as c:
            with pytest.raises(kvmem.FailedPreconditionError, match="--cluster-index"):
                c.fleet_lookup(LAY, kvmem.Prompt(prompt(1), model="m"))
            # Without tokens, a salt that names a tenant's chains (those of a daemon with
            # tokens sharing the index) is refused, for Lookup and CreateSequence alike.
            forged = kvmem.Prompt(prompt(1), cache_salt="tenant:alice/", model="m")
            with pytest.raises(kvmem.InvalidArgumentError, match="cache_salt"):
                c.lookup(LAY, forged)
            with pytest.raises(kvmem.InvalidArgumentError, match="cache_salt"):
                c.create_sequence(LAY, prompt=forged)
    finally:
        stop_daemon(proc, sock)


def test_a_killed_node_lapses_and_redis_down_blocks_nothing(redis):
    a, b = Node("ka", redis), Node("kb", redis)
    try:
        tokens = prompt(7)
        publish(a, tokens)
        assert wait_until(lambda: holders(b, tokens) == [(a.name, 56)], 5)
        # Killed: its claims stay until they lapse, within the TTL (and a renewal's slack).
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait()
        a.client.close()
        a = None
        assert wait_until(lambda: holders(b, tokens) == [], TTL + 2)

        # Redis stalled (stopped, its socket still accepting): a fleet lookup gives up after
        # --cluster-index-timeout-ms, publishing does not wait for the writer.
        pause(redis.proc)
        try:
            start = time.monotonic()
            stalled = b.client.fleet_lookup(LAY, kvmem.Prompt(tokens, model="m"))
            publish(b, prompt(9)).release()
            assert time.monotonic() - start < 2
            assert not stalled.available and "did not answer" in stalled.unavailable
        finally:
            redis.proc.send_signal(signal.SIGCONT)

        # Redis killed: requests go on, quickly; a fleet lookup answers "unavailable".
        redis.kill()
        start = time.monotonic()
        seq = publish(b, prompt(8))
        local = b.client.fleet_lookup(LAY, kvmem.Prompt(prompt(8), model="m"))
        assert time.monotonic() - start < 2
        assert local.matched_tokens == 56
        assert not local.available and local.unavailable
        # Restarted empty: the next renewal gives the index every claim back, this one
        # made while it was down included.
        redis.start()
        assert wait_until(lambda: b.client.fleet_lookup(
            LAY, kvmem.Prompt(prompt(8), model="m")).holders == [(b.name, 56)], TTL + 3)
        m = b.metrics()
        assert m['kvmem_cluster_index_updates_total{outcome="dropped"}'] >= 7
        assert m["kvmem_cluster_index_errors_total"] >= 1
        assert m['kvmem_cluster_index_lookups_total{result="unavailable"}'] >= 1
        seq.release()
    finally:
        if a is not None:
            a.stop()
        b.stop()


def test_bad_flags_are_refused(tmp_path):
    from kvmem_testing import KVMEMD, require_daemon
    require_daemon()

    def refusal(*flags):
        done = subprocess.run([str(KVMEMD), "--listen=127.0.0.1:0", "--metrics_listen=",
                               "--pool_prefault=false", *flags],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode != 0, "kvmemd started"
        return done.stderr

    assert "cluster_node_address" in refusal("--cluster_index=redis://127.0.0.1:1")
    assert "neither redis://" in refusal("--cluster_index=http://x", "--cluster_node_address=n:1")
    assert "port" in refusal("--cluster_index=redis://h:99999", "--cluster_node_address=n:1")
    assert "ttl" in refusal("--cluster_index=redis://h", "--cluster_node_address=n:1",
                            "--cluster_index_ttl_seconds=0")
    # Redis need not be up when kvmemd starts: it connects later.
    proc, target, sock = start_daemon("fleetlate", f"--cluster_index=unix://{tmp_path}/none",
                                      "--cluster_node_address=late:1")
    try:
        with kvmem.Client(target) as c:
            answer = c.fleet_lookup(LAY, kvmem.Prompt(prompt(1), model="m"))
            assert not answer.available and "cluster index" in answer.unavailable
    finally:
        stop_daemon(proc, sock)
    assert os.path.exists(KVMEMD)
