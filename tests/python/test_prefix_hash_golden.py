"""The prefix hash chain's golden vectors (tests/unit/prefix/golden_vectors.txt), recomputed
independently of kvmemd with cbor2 and hashlib exactly as vLLM's sha256_cbor prefix caching
does: NONE_HASH = sha256(cbor(seed)); a block's hash = sha256(cbor((parent, tuple(tokens),
extra_keys))) with extra_keys = (cache_salt,) on block 0 when there is a salt, else None.
The C++ test (prefix_hash_test.cc) checks kvmemd's hashes against the same file.

Each line: seed|salt|block_tokens|comma-separated tokens|comma-separated block hashes (hex).
Run with --regenerate to write the file from these cases."""
import hashlib
import pathlib
import sys

import pytest

cbor2 = pytest.importorskip("cbor2")

GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "unit" / "prefix" / "golden_vectors.txt"

CASES = [
    ("0", "", 4, list(range(10))),
    ("0", "tenant-a", 4, list(range(10))),
    ("1234", "", 16, [23, 24, 255, 256, 65535, 65536, 49151, 100000] * 4 + [7]),
    ("1234", "租户-b", 3, [1, 2, 3, 4, 5, 6, 7, 8, 9]),
    ("", "", 1, [0, 1, 2**31 - 1]),
    ("kvmem", "s", 2, [5]),  # no full block: no hashes
]


def sha256_cbor(value):
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def chain(seed, salt, block_tokens, tokens):
    parent = sha256_cbor(seed)
    hashes = []
    for i in range(len(tokens) // block_tokens):
        block = tuple(tokens[i * block_tokens:(i + 1) * block_tokens])
        extra = (salt,) if i == 0 and salt else None
        parent = sha256_cbor((parent, block, extra))
        hashes.append(parent.hex())
    return hashes


def line(case):
    seed, salt, block_tokens, tokens = case
    return "|".join([seed, salt, str(block_tokens), ",".join(map(str, tokens)),
                     ",".join(chain(*case))])


def test_golden_vectors_match_cbor2_and_hashlib():
    lines = GOLDEN.read_text(encoding="utf-8").splitlines()
    assert lines == [line(c) for c in CASES]


def test_the_salt_and_the_seed_change_every_block_hash():
    plain = chain("0", "", 4, list(range(12)))
    salted = chain("0", "t", 4, list(range(12)))
    seeded = chain("1", "", 4, list(range(12)))
    assert len(plain) == 3
    assert all(a != b for a, b in zip(plain, salted))
    assert all(a != b for a, b in zip(plain, seeded))


if __name__ == "__main__" and "--regenerate" in sys.argv:
    GOLDEN.write_text("".join(line(c) + "\n" for c in CASES), encoding="utf-8")
