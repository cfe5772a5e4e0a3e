"""The reference worker against a kvmemd it reaches as another host would: UCX over TCP
(UCX_TLS=tcp on both ends), the prompt's K/V as a message and every forward's reads by RMA
gets, answers exactly as on the same-host attach path and over gRPC (the full policy keeps
every token at f32: the logits are bit-equal, so greedy answers are too). The worker says
which transport it took and why (`kv transport: ...` on stderr)."""
import os
import re
import subprocess

import pytest

from kvmem_testing import BIN, CI, running_daemon, ucx_built

WORKER = BIN / "kvmem_worker"


@pytest.fixture(scope="module")
def model():
    path = os.environ.get("KVMEM_MODEL")
    if not path or not WORKER.exists():
        message = "KVMEM_MODEL is not set or kvmem_worker is not built"
        if CI:
            pytest.fail(message)
        pytest.skip(message)
    return path


def generate(model, target, transport, env):
    run = subprocess.run(
        [str(WORKER), "generate", f"--model={model}", "--prompt=Name three colors.",
         f"--target={target}", f"--transport={transport}", "--max_tokens=12", "--policy=full"],
        capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    said = re.search(r"^kv transport: (.*)$", run.stderr, re.M)
    assert said, run.stderr[-2000:]
    answer = run.stdout.split("\n---\n")[0]
    assert answer.strip(), run.stdout
    return answer, said.group(1), run.stdout


def test_the_worker_answers_alike_over_every_transport(model):
    env = dict(os.environ, UCX_TLS="tcp", UCX_WARN_UNUSED_ENV_VARS="n")
    flags = ["--pool_bytes=268435456"]
    ucx = ucx_built()
    if ucx:
        flags += ["--ucx", "--ucx_trusted_network"]
    old = os.environ.get("UCX_TLS")
    os.environ.update(UCX_TLS="tcp", UCX_WARN_UNUSED_ENV_VARS="n")  # kvmemd's environment
    try:
        with running_daemon("transports", *flags) as target:
            answers = {}
            for transport in ["attach", "grpc"] + (["ucx"] if ucx else []):
                answer, said, out = generate(model, target, transport, env)
                assert said.startswith(f"reads: {transport} (asked for)"), said
                assert f"K/V reads by {transport}" in out, out
                answers[transport] = answer
            answer, said, _ = generate(model, target, "auto", env)
            assert said.startswith("reads: attach (same host)"), said
            answers["auto"] = answer
    finally:
        if old is None:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = old
    assert len(set(answers.values())) == 1, answers
