"""What the kvmem client tests share: the `kvmem` package (imported here, so that both test
files skip, or with KVMEM_CI=1 fail, the same way when it is missing), the repository root, a
small layout, a table comparison, the manual clock, and a kvmemd started on a unix socket.
"""
import contextlib
import os
import pathlib
import signal
import subprocess
import time

import numpy as np
import pytest

CI = os.environ.get("KVMEM_CI") == "1"
if CI:
    import kvmem  # in CI a missing package fails the run
else:
    kvmem = pytest.importorskip(
        "kvmem",
        reason="the kvmem package is not installed: python3 -m pip install ./client/python")

ROOT = pathlib.Path(__file__).resolve().parents[2]

BIN = pathlib.Path(os.environ.get("KVMEM_BIN", ROOT / "build"))
KVMEMD = BIN / "kvmemd"


def require_daemon():
    if not KVMEMD.exists():
        message = f"{KVMEMD} not built (scripts/build.sh; or set KVMEM_BIN)"
        if CI:
            pytest.fail(message)
        pytest.skip(message)


def ucx_built():
    """Whether kvmemd was built with UCX (WITH_UCX: on, but in the sanitizer builds and where
    libucx is missing)."""
    require_daemon()
    out = subprocess.run(["ldd", str(KVMEMD)], capture_output=True, text=True)
    return "libucp" in out.stdout


def start_daemon(tag, *flags):
    require_daemon()
    sock = pathlib.Path(f"/tmp/kvmem-py-{tag}-{os.getpid()}.sock")
    sock.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [str(KVMEMD), f"--listen=unix:{sock}", "--metrics_listen=", "--pool_prefault=false",
         "--page_bytes=65536", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    assert line.startswith("READY"), f"kvmemd did not start: {line!r}"
    return proc, f"unix:{sock}", sock


def stop_daemon(proc, sock):
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    sock.unlink(missing_ok=True)


@contextlib.contextmanager
def running_daemon(tag, *flags):
    """A kvmemd for the block (its target), stopped after it."""
    proc, target, sock = start_daemon(tag, *flags)
    try:
        yield target
    finally:
        stop_daemon(proc, sock)


def make_certificates(directory):
    """TLS certificates made in `directory` by tests/testing/make_certificates.sh (a CA
    "ca", a server certificate for localhost and 127.0.0.1 "server", clients "alice" and
    "bob"...; each NAME as NAME.pem and NAME.key)."""
    script = pathlib.Path(__file__).resolve().parent.parent / "testing" / "make_certificates.sh"
    subprocess.run(["/bin/sh", str(script), str(directory)], check=True, timeout=60,
                   stdout=subprocess.DEVNULL)


def layout(dtype=kvmem.DType.F16, L=2, H=2, D=8, block_tokens=None):
    return kvmem.Layout(L, H, D, dtype, block_tokens, vocab_size=1000)


def same_table(a, b):
    assert (a.sequence_id, a.epoch, a.version) == (b.sequence_id, b.epoch, b.version)
    assert len(a.streams) == len(b.streams)
    for x, y in zip(a.streams, b.streams):
        for column in ("ids", "offsets", "starts", "counts", "precisions"):
            assert getattr(x, column) == getattr(y, column), column
        if a.positions and b.positions:
            assert np.array_equal(x.positions, y.positions)


def pause(proc):
    """Stops `proc` (SIGSTOP) and waits until every thread of it has stopped: the signal is
    delivered asynchronously, and right after it a thread may still answer a request."""
    proc.send_signal(signal.SIGSTOP)

    def stopped():
        for task in pathlib.Path(f"/proc/{proc.pid}/task").iterdir():
            try:
                stat = (task / "stat").read_text()
            except FileNotFoundError:  # a thread that ended meanwhile
                continue
            # The state follows the command's parentheses (a name may hold spaces).
            if stat.rsplit(")", 1)[1].split()[0] != "T":
                return False
        return True

    assert wait_until(stopped, 5), f"process {proc.pid} did not stop"


def wait_until(condition, timeout=5.0):
    """Whether `condition()` became true within `timeout` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


class ManualClock:
    """A clock that moves only when told (the lease renewer's injected clock)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds
