"""The reference worker against an independent implementation: llama.cpp (llama-cpp-python
from PyPI) on the same GGUF file.

Tokenization must be identical, id for id, including non-ASCII text and special tokens.
Logits cannot be bit-identical: llama.cpp multiplies Q4_1 weights by activations it first
quantizes to 8 bits (Q8_1 blocks of 32), while the worker dequantizes the weights to f32 and
multiplies in f32. That rounding (about 0.4 % relative per dot product) accumulates over 30
layers; measured here it moves logits by 0.08-0.21 on average and at most 0.86 (logits span
about 30). The tolerances allow that and no more: at least 4 of the same top-5, a mean
absolute difference under 0.3, no logit off by more than 1.5, and the same top-1 token unless
llama.cpp's own top-2 are closer than 0.3 (then ours must be one of its top two). A broken
RoPE, norm, head split or tokenizer moves logits by several units, so the test fails when
the two drift. test_forward_matches_numpy_reference checks the forward pass exactly against
a plain numpy implementation on the same dequantized weights (gguf package).
"""
import json
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "build" / "kvmem_worker"

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog 12345 times.",
    "Größe über 5€ — naïve café, Straße",
    "日本語のテキストと中文文本",
    "emoji 🙂🚀 and tabs\tand\nnew lines\n\n  indented",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x**2  # comment\n",
    "I'm sure they'll say it's fine, we've done what we'd planned.",
]

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):\n    ",
]


@pytest.fixture(scope="module")
def model_path():
    path = os.environ.get("KVMEM_MODEL")
    if not path:
        path = subprocess.run(["bash", str(ROOT / "scripts" / "fetch_model.sh")], check=True,
                              capture_output=True, text=True).stdout.strip()
    return path


def worker_dump(model_path, text, ids_only):
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt", delete=False) as f:
        f.write(text)
    try:
        out = subprocess.run(
            [str(WORKER), "dump", f"--model={model_path}", "--cache=local", f"--prompt_file={f.name}",
             f"--ids_only={'true' if ids_only else 'false'}"],
            check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    return json.loads(out)


@pytest.fixture(scope="module")
def llama(model_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(model_path=model_path, n_ctx=512, n_threads=2, logits_all=True,
                           verbose=False)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenization_matches_llama_cpp(llama, model_path, text):
    ours = worker_dump(model_path, text, ids_only=True)["ids"]
    theirs = llama.tokenize(text.encode("utf-8"), add_bos=False, special=True)
    assert ours == theirs


@pytest.mark.parametrize("prompt", PROMPTS)
def test_full_cache_logits_match_llama_cpp(llama, model_path, prompt):
    ours = worker_dump(model_path, prompt, ids_only=False)
    ids, logits = ours["ids"], np.array(ours["logits"], dtype=np.float64)
    llama.reset()
    llama.eval(ids)
    theirs = np.array(llama.scores[len(ids) - 1], dtype=np.float64)
    diff = np.abs(logits - theirs)
    top5_ours = set(np.argsort(-logits)[:5])
    top5_theirs = set(np.argsort(-theirs)[:5])
    print(f"max |diff| {diff.max():.4f}, mean {diff.mean():.4f}, top-5 overlap "
          f"{len(top5_ours & top5_theirs)}")
    ours_top1 = int(np.argmax(logits))
    their_top2 = np.argsort(-theirs)[:2]
    if ours_top1 != int(their_top2[0]):
        assert theirs[their_top2[0]] - theirs[their_top2[1]] < 0.3
        assert ours_top1 == int(their_top2[1])
    assert len(top5_ours & top5_theirs) >= 4
    assert diff.mean() < 0.3
    assert diff.max() < 1.5


def numpy_forward(path, ids):
    """The Llama forward pass written plainly in numpy (f64) on weights dequantized by the
    gguf package: an independent check of the worker's arithmetic."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    r = GGUFReader(path)
    t = {x.name: x for x in r.tensors}

    def w(name):
        x = t[name]
        return dequantize(x.data, x.tensor_type).reshape([int(d) for d in reversed(x.shape)]).astype(np.float64)

    def field(k):
        f = r.fields[k]
        return f.parts[f.data[0]][0]

    L, H, HKV = int(field("llama.block_count")), int(field("llama.attention.head_count")), int(field("llama.attention.head_count_kv"))
    eps, base = float(field("llama.attention.layer_norm_rms_epsilon")), float(field("llama.rope.freq_base"))
    emb = w("token_embd.weight")
    E = emb.shape[1]
    D = E // H
    x = emb[ids]
    T = len(ids)

    def norm(v, g):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * g

    def rope(v, heads):
        v = v.reshape(T, heads, D // 2, 2)
        theta = np.arange(T)[:, None] * base ** (-2.0 * np.arange(D // 2) / D)
        c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        a, b = v[..., 0], v[..., 1]
        return np.stack([a * c - b * s, a * s + b * c], -1).reshape(T, heads * D)

    mask = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(L):
        p = f"blk.{l}."
        h = norm(x, w(p + "attn_norm.weight"))
        q = rope(h @ w(p + "attn_q.weight").T, H)
        k = rope(h @ w(p + "attn_k.weight").T, HKV)
        v = h @ w(p + "attn_v.weight").T
        out = np.zeros((T, E))
        for hd in range(H):
            g = hd // (H // HKV)
            s = q[:, hd * D:(hd + 1) * D] @ k[:, g * D:(g + 1) * D].T / np.sqrt(D) + mask
            a = np.exp(s - s.max(-1, keepdims=True))
            a /= a.sum(-1, keepdims=True)
            out[:, hd * D:(hd + 1) * D] = a @ v[:, g * D:(g + 1) * D]
        x = x + out @ w(p + "attn_output.weight").T
        h = norm(x, w(p + "ffn_norm.weight"))
        gate = h @ w(p + "ffn_gate.weight").T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ w(p + "ffn_up.weight").T)) @ w(p + "ffn_down.weight").T
    return norm(x[-1], w("output_norm.weight")) @ emb.T


def test_forward_matches_numpy_reference(model_path):
    pytest.importorskip("gguf")
    prompt = PROMPTS[0]
    ours = worker_dump(model_path, prompt, ids_only=False)
    ref = numpy_forward(model_path, ours["ids"])
    diff = np.abs(np.array(ours["logits"]) - ref)
    print(f"numpy reference: max |diff| {diff.max():.2e}")
    # f32 accumulation against f64: measured 8e-5; 1e-3 leaves room for summation order.
    assert diff.max() < 1e-3
