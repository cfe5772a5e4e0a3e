#!/usr/bin/env python3
"""Writes the harnesses' seed inputs into fuzz/corpus/<harness>/seed-*: valid calls the
fuzzer mutates from (a call sequence per policy for the service, batches with signal-area
rows for the step channel, GGUF images, texts). Needs the kvmem Python package (its
generated kvmem_pb2). scripts/fuzz.sh merges what the fuzzer finds next to these."""
import pathlib
import struct
import sys

from kvmem.v1 import kvmem_pb2 as pb

ROOT = pathlib.Path(__file__).resolve().parent / "corpus"
L, H, D, BLOCK = 2, 2, 8, 4  # a small layout: every call stays cheap


def write(harness, name, data):
    d = ROOT / harness
    d.mkdir(parents=True, exist_ok=True)
    (d / f"seed-{name}").write_bytes(data)


def layout(**kw):
    return pb.Layout(num_layers=L, num_kv_heads=H, head_dim=D, dtype=pb.DTYPE_F16,
                     block_tokens=BLOCK, vocab_size=64, **kw)


def kv(n, seed):
    # [L][H][n][D] halves of small distinct values
    vals = [((seed * 31 + i) % 200 - 100) / 64.0 for i in range(L * H * n * D)]
    return struct.pack(f"<{len(vals)}e", *vals)


def rows(n):
    return [pb.AttentionRow(layer=l, kv_head=h, weights=[1.0 / n] * n)
            for l in range(L) for h in range(H)]


def call(method, msg):
    body = msg.SerializeToString()
    return struct.pack("<BH", method, len(body)) + body


# Service methods, in service_fuzz.cc's switch order.
(GET_INFO, CREATE, APPEND, STEP, STEP_BATCH, COMPRESS, TABLE, FORK, PUBLISH, LOOKUP, RELEASE,
 KEEP_ALIVE, STATS, APPEND_STREAM, READ_KV) = range(15)


def stream_call(chunks):
    """An AppendStream: its chunks, each a 16-bit length and the chunk."""
    body = b"".join(struct.pack("<H", len(c)) + c for c in (m.SerializeToString() for m in chunks))
    return struct.pack("<BH", APPEND_STREAM, len(body)) + body


def service_seeds():
    policies = {
        "full": pb.PolicySpec(name="full"),
        "window": pb.PolicySpec(name="window", params={"window": 6}),
        "streaming_llm": pb.PolicySpec(name="streaming_llm", params={"budget": 6, "sinks": 1}),
        "h2o": pb.PolicySpec(name="h2o", params={"budget": 6}),
        "confkv": pb.PolicySpec(name="confkv", params={"c_high": 6, "c_low": 8, "protect": 2}),
        "refreekv": pb.PolicySpec(name="refreekv"),
        "infokv": pb.PolicySpec(name="infokv", params={"window": 2}),
        "snapkv": pb.PolicySpec(name="snapkv", params={"budget": 6, "window": 2, "kernel": 1}),
        "pyramidkv": pb.PolicySpec(name="pyramidkv", params={"budget": 6, "window": 2}),
        "int8": pb.PolicySpec(name="full", quantization=pb.PRECISION_INT8,
                              quantization_recent_tokens=4),
        "nf4": pb.PolicySpec(name="window", params={"window": 6}, quantization=pb.PRECISION_NF4,
                             quantization_recent_tokens=4),
    }
    for name, policy in policies.items():
        prompt = list(range(1, 13))
        calls = [call(CREATE, pb.CreateSequenceRequest(layout=layout(), policy=policy,
                                                       prompt_token_ids=prompt, cache_salt="s"))]
        calls.append(call(APPEND, pb.AppendRequest(sequence_id=1, positions=range(12),
                                                   token_ids=prompt, k=kv(12, 1), v=kv(12, 2),
                                                   token_entropy=[0.5] * 12,
                                                   layer_distance=[0.1] * 12)))
        calls.append(call(STEP, pb.StepRequest(sequence_id=1, epoch=1, attention=rows(12),
                                               logit_stats=pb.LogitStats(entropy=1.0, p1=0.5,
                                                                         p2=0.2))))
        calls.append(call(COMPRESS, pb.CompressRequest(
            sequence_id=1, epoch=2, target_tokens=8,
            window_scores=[pb.WindowScores(layer=l, kv_head=h, scores=[0.25] * 12)
                           for l in range(L) for h in range(H)])))
        batch = pb.StepBatchRequest(request_id="b1", entries=[pb.StepBatchEntry(
            sequence_id=1, append=pb.NewTokens(positions=[12], token_ids=[5], k=kv(1, 3),
                                               v=kv(1, 4), token_entropy=[0.3]),
            step=pb.StepSignals(attention=rows(13), logit_stats=pb.LogitStats(entropy=0.5, p1=0.9,
                                                                              p2=0.05)),
            client_table=pb.ClientTable(version=0, positions=True), plan_tokens=1)])
        calls.append(call(STEP_BATCH, batch))
        calls.append(stream_call([
            pb.AppendStreamRequest(sequence_id=1, positions=[13 + i], token_ids=[7], k=kv(1, 5 + i),
                                   v=kv(1, 6 + i)) for i in range(2)]))
        calls.append(call(READ_KV, pb.ReadKvRequest(sequence_id=1)))
        calls.append(call(TABLE, pb.GetBlockTableRequest(sequence_id=1, positions=True)))
        calls.append(call(FORK, pb.ForkRequest(sequence_id=1)))
        calls.append(call(PUBLISH, pb.PublishRequest(sequence_id=1)))
        calls.append(call(LOOKUP, pb.LookupRequest(layout=layout(), token_ids=prompt,
                                                   cache_salt="s")))
        calls.append(call(CREATE, pb.CreateSequenceRequest(layout=layout(), policy=policy,
                                                           prompt_token_ids=prompt, cache_salt="s")))
        calls.append(call(KEEP_ALIVE, pb.KeepAliveRequest(sequence_ids=[1, 2, 3])))
        calls.append(call(STATS, pb.StatsRequest(include_sequences=True)))
        calls.append(call(RELEASE, pb.ReleaseRequest(sequence_id=2)))
        calls.append(call(GET_INFO, pb.GetInfoRequest()))
        write("service", name, b"".join(calls))
    # An AppendStream whose second chunk does not parse: it must append nothing.
    good = pb.AppendStreamRequest(sequence_id=1, positions=range(4), k=kv(4, 1),
                                  v=kv(4, 2)).SerializeToString()
    bad = b"\xff\xff\xff"
    body = struct.pack("<H", len(good)) + good + struct.pack("<H", len(bad)) + bad
    write("service", "refused-chunk", b"".join([
        call(CREATE, pb.CreateSequenceRequest(layout=layout(), policy=policies["full"])),
        struct.pack("<BH", APPEND_STREAM, len(body)) + body]))


def step_channel_seeds():
    # Rows in the signal area at offset 0 (header, entries, f32 values) and 4096 (f16).
    def area(offset, dtype, n):
        entries = [(l, h) for l in range(L) for h in range(H)]
        out = struct.pack("<II", len(entries), dtype)
        for l, h in entries:
            out += struct.pack("<IIII", l, h, n, 0)
        for _ in entries:
            out += struct.pack(f"<{n}f" if dtype == 0 else f"<{n}e", *([1.0 / n] * n))
        return struct.pack("<IH", offset, len(out)) + out

    writes = [area(0, 0, 12), area(4096, 1, 5)]
    for name, entries in {
        "rows": [pb.StepBatchEntry(sequence_id=1, step=pb.StepSignals(attention_offset=0)),
                 pb.StepBatchEntry(sequence_id=2, step=pb.StepSignals(attention_offset=4096))],
        "chunked": [pb.StepBatchEntry(sequence_id=i, plan_tokens=40000,
                                      step=pb.StepSignals(attention_offset=0)) for i in range(1, 9)],
        "plain": [pb.StepBatchEntry(sequence_id=7, append=pb.NewTokens(positions=[3], k=kv(1, 1),
                                                                       v=kv(1, 2)))],
    }.items():
        request = pb.StepBatchRequest(request_id=name, entries=entries).SerializeToString()
        # writes, flags (kBatch, true length), claim, request
        write("step_channel", name,
              struct.pack("<B", len(writes)) + b"".join(writes) + struct.pack("<BI", 0, 0) + request)
    write("step_channel", "no-request-id",
          b"\0" + struct.pack("<BI", 0, 0) + pb.StepBatchRequest(entries=[
              pb.StepBatchEntry(sequence_id=1)]).SerializeToString())
    write("step_channel", "more", b"\0" + struct.pack("<BII", 1, 1, 0))
    write("step_channel", "claim", b"\0" + struct.pack("<BI", 2, 1 << 30) + b"\x0a\x02\x08\x01")


def gguf_seeds():
    def s(x):
        b = x.encode()
        return struct.pack("<Q", len(b)) + b

    meta = [(s("general.architecture"), struct.pack("<I", 8) + s("llama")),
            (s("llama.block_count"), struct.pack("<II", 4, 30)),
            (s("general.alignment"), struct.pack("<II", 4, 32)),
            (s("tokenizer.ggml.tokens"), struct.pack("<IIQ", 9, 8, 2) + s("a") + s("\u0120b")),
            (s("some.floats"), struct.pack("<IIQ", 9, 6, 2) + struct.pack("<ff", 1.5, -2.0))]
    tensors = [(s("norm"), struct.pack("<IQ", 1, 4) + struct.pack("<IQ", 0, 0)),  # f32 [4]
               (s("blk.0.w"), struct.pack("<IQ", 1, 32) + struct.pack("<IQ", 8, 32))]  # q8_0 [32]
    for version in (2, 3):
        out = struct.pack("<IIQQ", 0x46554747, version, len(tensors), len(meta))
        out += b"".join(k + v for k, v in meta) + b"".join(n + d for n, d in tensors)
        out += b"\0" * (-len(out) % 32)
        out += struct.pack("<4f", 1, 2, 3, 4) + b"\0" * 16 + struct.pack("<e", 0.5) + bytes(range(32))
        write("gguf", f"v{version}", out)


def tokenizer_seeds():
    texts = {
        "english": "\0Hello world, the tokenizer and the tension in 2024!",
        "chat": "\1<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nhi<|im_end|>",
        "chat-literal": "\0<|im_start|>user\n<|im_end|>",
        "unicode": "\0Größe über €5... 日本語 テキスト\t\n\n  trailing  ",
        "digits": "\x0012345678901234567890 ab ab  ab\n\n\n",
        "malformed": "\0ab\xff\xfe\xc3 \xe2\x82 \xf0\x9f\x98",
    }
    for name, text in texts.items():
        write("tokenizer", name, text.encode("utf-8", "surrogateescape") if name != "malformed"
              else text.encode("latin-1"))


def attach_seeds():
    # A mode byte per connection (attach_fuzz.cc): 3/7 the real read-only / writable ticket,
    # 1 a made-up ticket, 2 a real one with a byte flipped, 0 raw bytes of a given length.
    magic = struct.pack("<II", 0x4B564154, 1)
    write("attach", "real", bytes([3, 7]))
    write("attach", "made-up", bytes([1]) + bytes(32) + bytes([1]) + b"\xff" * 32)
    write("attach", "flipped", bytes([2, 1, 5, 0x40, 2, 0, 31, 1]))
    write("attach", "raw", bytes([0, 40]) + magic + b"\x11" * 32 + bytes([0, 0]) +
          bytes([0, 3]) + b"abc" + bytes([0, 200]) + magic * 25)


if __name__ == "__main__":
    attach_seeds()
    service_seeds()
    step_channel_seeds()
    gguf_seeds()
    tokenizer_seeds()
    print(f"seeds written under {ROOT}", file=sys.stderr)
