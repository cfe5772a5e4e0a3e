"""kvmemd with bearer tokens (--auth-tokens), as a process, through the Python client: calls
without a known token are refused, a tenant's sequences are invisible to another, SIGHUP
reads the token file again, and a daemon without tokens will not listen beyond loopback.

Needs what test_kvmem_client.py needs (the installed `kvmem` package and build/kvmemd).
"""
import os
import signal
import subprocess

import numpy as np
import pytest

pytest.register_assert_rewrite("kvmem_testing")
from kvmem_testing import (KVMEMD, kvmem, layout, make_certificates, require_daemon,  # noqa: E402
                           running_daemon)

ALICE = "alice-token-0123456789"
BOB = "bob-token-0123456789ab"


@pytest.fixture
def tokens(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"alice {ALICE}\nbob {BOB}\n")
    return path


def connect(target, token):
    return kvmem.Client(target, kvmem.ClientOptions(auth_token=token, max_attempts=1))


def filled(client, n=8):
    lay = layout()
    seq = client.create_sequence(lay)
    k = np.ones(lay.kv_shape(n), dtype=np.float16)
    seq.append(range(n), k, k)
    return seq


def test_tokens_tenants_and_sighup(tokens):
    with running_daemon("auth", f"--auth_tokens={tokens}") as target:
        with connect(target, ALICE) as alice, connect(target, BOB) as bob, \
                connect(target, "") as stranger, connect(target, "wrong-token-0123456789") as wrong:
            for who in (stranger, wrong):
                with pytest.raises(kvmem.UnauthenticatedError, match="bearer token"):
                    who.get_info()
            seq = filled(alice)
            # Bob cannot name it: the answer of an id never created.
            with pytest.raises(kvmem.NotFoundError) as foreign:
                bob.read_kv(seq.id)
            with pytest.raises(kvmem.NotFoundError) as never:
                bob.read_kv(seq.id + 1000)
            assert str(foreign.value).replace(str(seq.id), "N") == \
                str(never.value).replace(str(seq.id + 1000), "N")
            assert [s.sequence_id for s in bob.stats(include_sequences=True).sequences] == []
            assert [s.sequence_id for s in alice.stats(include_sequences=True).sequences] == \
                [seq.id]
            # SIGHUP: Bob's token goes, Carol's comes; the daemon keeps serving.
            carol = "carol-token-0123456789"
            tokens.write_text(f"alice {ALICE}\ncarol {carol}\n")
            proc = next(p for p in _children() if f"--auth_tokens={tokens}" in p[1])
            os.kill(proc[0], signal.SIGHUP)
            with connect(target, carol) as c:
                _eventually(lambda: c.get_info())
            with pytest.raises(kvmem.UnauthenticatedError):
                bob.get_info()
            assert len(alice.read_kv(seq.id)) == 4
            seq.release()


def test_a_unix_peers_uid_is_its_tenant(tmp_path):
    """A token file line `<tenant> uid:<n>`: this process's uid (taken by kvmemd from the
    socket, SO_PEERCRED) is alice without a token, and another tenant's token from it is
    refused."""
    path = tmp_path / "tokens"
    path.write_text(f"alice uid:{os.getuid()}\nbob {BOB}\n")
    with running_daemon("auth-uid", f"--auth_tokens={path}") as target:
        with connect(target, "") as me, connect(target, BOB) as bob:
            seq = filled(me)
            assert [s.sequence_id for s in me.stats(include_sequences=True).sequences] == \
                [seq.id]
            with pytest.raises(kvmem.UnauthenticatedError, match="unix-socket peer's uid"):
                bob.get_info()
            seq.release()


def test_a_tenants_arena_is_all_its_mapping_reads(tokens):
    """--tenant-arena: alice's blocks lie in her arena, her client maps that arena alone
    (offsets taken back by the piece's start) and reads them in place as read_kv gives
    them; bob's blocks are outside her mapping, refused."""
    arena = 4 << 20
    tokens.write_text(f"alice {ALICE}\nbob {BOB}\nops admin-token-0123456789 admin\n")
    with running_daemon("arena", f"--auth_tokens={tokens}", "--pool_bytes=16777216",
                        f"--tenant_arena=alice:{arena}") as target:
        with connect(target, ALICE) as alice, connect(target, BOB) as bob, \
                connect(target, "admin-token-0123456789") as ops:
            info = alice.get_info()
            assert (info.shm_bytes, info.shm_piece_offset, info.shm_piece_bytes) == \
                (16 << 20, (16 << 20) - arena, arena)
            assert bob.get_info().shm_bytes == 0  # no arena, no admin: nothing to map
            # Rows of 80 bytes over several 64 KiB pages: some blocks' rows line up with the
            # piece's start and some do not (read_all's two ways of copying).
            n = 400
            lay = layout(D=40)
            rng = np.random.default_rng(3)
            k = rng.standard_normal(lay.kv_shape(n)).astype(np.float16)
            v = rng.standard_normal(lay.kv_shape(n)).astype(np.float16)
            hers, his = alice.create_sequence(lay), bob.create_sequence(lay)
            hers.append(range(n), k, v)
            his.append(range(n), k, v)
            with alice.attach_shared_pool() as pool:
                assert all(o >= (16 << 20) - arena for st in hers.table.streams
                           for o in st.offsets)
                row = lay.head_dim * 2
                rows_at = [(o - info.shm_piece_offset) % row for st in hers.table.streams
                           for o in st.offsets]
                assert 0 in rows_at and any(rows_at), "both ways of copying should be taken"
                read = pool.read_all(hers.table)
                for s in hers.read_kv():
                    i = s.layer * lay.num_kv_heads + s.kv_head
                    assert read.k[i, :n].tobytes() == s.k.tobytes()
                    assert read.v[i, :n].tobytes() == s.v.tobytes()
                    mapped = pool.read_stream(hers.table, s.layer, s.kv_head)
                    assert mapped.v.tobytes() == s.v.tobytes()
                his_table = ops.get_block_table(his.id)
                with pytest.raises(kvmem.OutOfRangeError):
                    pool.read_all(his_table)
                with pytest.raises(kvmem.OutOfRangeError):
                    pool.read_stream(his_table, 0, 0)
            hers.release()
            his.release()


def _children():
    """(pid, command line) of this process's children."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != os.getpid():
                continue
            with open(f"/proc/{entry}/cmdline") as f:
                out.append((int(entry), f.read().replace("\0", " ")))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _eventually(call, tries=100):
    import time
    for _ in range(tries - 1):
        try:
            return call()
        except kvmem.UnauthenticatedError:
            time.sleep(0.05)
    return call()


def test_no_tokens_means_loopback_or_a_unix_socket_only():
    require_daemon()
    refused = subprocess.run([str(KVMEMD), "--listen=0.0.0.0:0", "--metrics_listen=",
                              "--pool_bytes=4194304", "--pool_prefault=false"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "--auth-tokens" in refused.stderr and "--allow-unauthenticated-remote" in refused.stderr


def test_tls_client_certificates_name_the_tenant(tmp_path):
    require_daemon()
    make_certificates(tmp_path)
    proc = subprocess.Popen(
        [str(KVMEMD), "--listen=127.0.0.1:0", "--metrics_listen=", "--pool_prefault=false",
         "--pool_bytes=8388608", f"--tls_cert={tmp_path}/server.pem",
         f"--tls_key={tmp_path}/server.key", f"--tls_client_ca={tmp_path}/ca.pem"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), line
        port = int(line.split()[1].split("=")[1])

        def client(who):
            return kvmem.Client(f"127.0.0.1:{port}", kvmem.ClientOptions(
                max_attempts=1, deadline=10, tls_server_name="localhost",
                tls_root_certs=(tmp_path / "ca.pem").read_bytes(),
                tls_cert_chain=(tmp_path / f"{who}.pem").read_bytes(),
                tls_private_key=(tmp_path / f"{who}.key").read_bytes()))

        with client("alice") as alice, client("bob") as bob:
            seq = filled(alice)
            with pytest.raises(kvmem.NotFoundError):
                bob.read_kv(seq.id)
            assert len(alice.read_kv(seq.id)) == 4
        with kvmem.Client(f"127.0.0.1:{port}",
                          kvmem.ClientOptions(max_attempts=1, deadline=5)) as plain:
            with pytest.raises(kvmem.KvmemError):
                plain.get_info()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
