#!/usr/bin/env python3
"""Runs bench/grpc_path_bench once and prints kvmemd's gRPC path against raw gRPC as ratios.

Every figure is the median of 3 repetitions, the repetitions of all benchmarks interleaved
in random order, so that the load of a shared machine falls on kvmemd and raw rows alike.
Wall = real time per call; CPU = the whole process's CPU time per call (client, daemon and
raw service threads), which excludes waiting for a core.

Usage: python3 bench/grpc_path.py [path/to/grpc_path_bench] [extra benchmark flags...]
"""
import json
import os
import subprocess
import sys

binary = sys.argv[1] if len(sys.argv) > 1 else "build/bench/grpc_path_bench"
command = [binary, "--benchmark_format=json", "--benchmark_repetitions=3",
           "--benchmark_enable_random_interleaving=true",
           "--benchmark_report_aggregates_only=true"] + sys.argv[2:]
load_before = os.getloadavg()
out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
load_after = os.getloadavg()


def short(run_name):  # "BM_Decode/window_batch1/min_time:2.000/process_time/real_time"
    return "/".join(p for p in run_name.split("/")
                    if not p.startswith(("min_time:", "iterations:", "process_time", "real_time")))


runs = {short(b["run_name"]): b for b in json.loads(out)["benchmarks"]
        if b.get("aggregate_name") == "median"}


def us(name, field="real_time"):
    b = runs[name]
    return b[field] * {"ns": 1e-3, "us": 1.0, "ms": 1e3}[b["time_unit"]]


def cpu(name):
    return us(name, "cpu_time")


def have(*names):
    return all(n in runs for n in names)


def kib(name, counter):
    return runs[name][counter] / 1024


print("command:", " ".join(command))
print(f"load average before / after: {load_before[0]:.2f} / {load_after[0]:.2f}")
print()

if have("BM_Append1MiB", "BM_RawGrpc1MiB"):
    a, r = "BM_Append1MiB", "BM_RawGrpc1MiB"
    print("| Append, 1 MiB K+V | kvmemd | raw gRPC, same payload | kvmemd / raw |")
    print("|---|---|---|---|")
    print(f"| wall µs/call | {us(a):.0f} | {us(r):.0f} | {us(a) / us(r):.2f} |")
    print(f"| process CPU µs/call | {cpu(a):.0f} | {cpu(r):.0f} | {cpu(a) / cpu(r):.2f} |")
    print()

# Target 1: decode batches.
batch_rows = [
    ("window, 1 entry", "window_batch1", "window_batch1"),
    ("window, 64 entries, parallel off", "window_batch64_serial", "window_batch64"),
    ("window, 64 entries, parallel on", "window_batch64_parallel", "window_batch64"),
    ("confkv, 1 entry", "confkv_batch1", "confkv_batch1"),
    ("confkv, 64 entries, parallel off", "confkv_batch64_serial", "confkv_batch64"),
    ("confkv, 64 entries, parallel on", "confkv_batch64_parallel", "confkv_batch64"),
    ("window, 1 entry, no table", "window_batch1_notable", "window_batch1_notable"),
    ("window, 64 entries, parallel on, no table", "window_batch64_notable",
     "window_batch64_notable"),
]
print("| StepBatch | request / response KiB | wall µs | µs per sequence-step | process CPU µs "
      "| raw gRPC same bytes: wall µs (CPU µs) | kvmemd / raw, wall (CPU) |")
print("|---|---|---|---|---|---|---|")
for label, case, raw in batch_rows:
    k, r = "BM_Decode/" + case, "BM_RawLike/" + raw
    if not have(k, r):
        continue
    n = runs[k]["seqs"]
    print(f"| {label} | {kib(k, 'req_bytes'):.1f} / {kib(k, 'resp_bytes'):.1f} "
          f"| {us(k):.0f} | {us(k) / n:.1f} | {cpu(k):.0f} | {us(r):.0f} ({cpu(r):.0f}) "
          f"| {us(k) / us(r):.2f} ({cpu(k) / cpu(r):.2f}) |")
print()
print("| target 1: 64-entry batch / 1-entry batch (≤ 4) | wall | process CPU |")
print("|---|---|---|")
for policy in ("window", "confkv"):
    one = f"BM_Decode/{policy}_batch1"
    for mode in ("serial", "parallel"):
        many = f"BM_Decode/{policy}_batch64_{mode}"
        if have(one, many):
            print(f"| {policy}, parallel {'off' if mode == 'serial' else 'on'} "
                  f"| {us(many) / us(one):.1f} | {cpu(many) / cpu(one):.1f} |")
    on, off = f"BM_Decode/{policy}_batch64_parallel", f"BM_Decode/{policy}_batch64_serial"
    if have(on, off):
        print(f"| {policy}, parallel on / off | {us(on) / us(off):.2f} "
              f"| {cpu(on) / cpu(off):.2f} |")
print()

# Target 2: the single-sequence Step round trip.
print("| Step round trip | request / response bytes | TCP wall µs | raw TCP | kvmemd / raw "
      "| unix wall µs | raw unix | kvmemd / raw | CPU ratio TCP / unix |")
print("|---|---|---|---|---|---|---|---|---|")
for label, case in (("window", "window_step"), ("window, no table", "window_step_notable"),
                    ("confkv", "confkv_step")):
    base = case.replace("_notable", "")
    suffix = "_notable" if case.endswith("_notable") else ""
    kt, ku = f"BM_Decode/{base}_tcp{suffix}", f"BM_Decode/{base}_unix{suffix}"
    rt, ru = f"BM_RawLike/{base}_tcp{suffix}", f"BM_RawLike/{base}_unix{suffix}"
    if not have(kt, ku, rt, ru):
        continue
    print(f"| {label} | {runs[kt]['req_bytes']:.0f} / {runs[kt]['resp_bytes']:.0f} "
          f"| {us(kt):.0f} | {us(rt):.0f} | {us(kt) / us(rt):.2f} "
          f"| {us(ku):.0f} | {us(ru):.0f} | {us(ku) / us(ru):.2f} "
          f"| {cpu(kt) / cpu(rt):.2f} / {cpu(ku) / cpu(ru):.2f} |")

# The same-host step channel: StepBatch through shared memory, against StepBatch over
# gRPC on a unix socket and a raw unix-socket gRPC call of the same bytes.
print()
print("| StepBatch over a unix socket | gRPC wall µs (CPU) | step channel wall µs (CPU) "
      "| raw gRPC, same bytes, wall µs (CPU) | channel / gRPC, wall | channel / raw, wall (CPU) |")
print("|---|---|---|---|---|---|")
for label, case in (("window, 1 entry", "window_batch1"), ("confkv, 1 entry", "confkv_batch1"),
                    ("window, 64 entries", "window_batch64")):
    g, c, r = f"BM_Decode/{case}_unix", f"BM_Decode/{case}_channel", f"BM_RawLike/{case}_unix"
    if not have(g, c):
        continue
    raw = (f"{us(r):.0f} ({cpu(r):.0f})", f"{us(c) / us(r):.2f} ({cpu(c) / cpu(r):.2f})") \
        if have(r) else ("", "")
    print(f"| {label} | {us(g):.0f} ({cpu(g):.0f}) | {us(c):.0f} ({cpu(c):.0f}) | {raw[0]} "
          f"| {us(c) / us(g):.2f} | {raw[1]} |")
if have("BM_Decode/window_batch1_channel_notable"):
    print(f"| window, 1 entry, no table | | "
          f"{us('BM_Decode/window_batch1_channel_notable'):.0f} "
          f"({cpu('BM_Decode/window_batch1_channel_notable'):.0f}) | | | |")

# The daemon's share of a decode step at 8k context (the eval speed study's target of
# 0.5 ms, without the model): one sequence through the step channel, 256 steps.
long_rows = [(p, f"BM_Decode/{p}_8k_channel") for p in ("full", "window", "confkv")]
if any(have(k) for _, k in long_rows):
    print()
    print("| 8k context, 1 sequence, step channel | wall µs per step | process CPU µs per step "
          "| caches cold first: wall µs (cold / warm) |")
    print("|---|---|---|---|")
    for policy, k in long_rows:
        if have(k):
            cold = f"{us(k + '_cold'):.0f} ({us(k + '_cold') / us(k):.1f})" if have(k + "_cold") else ""
            print(f"| {policy} | {us(k):.0f} | {cpu(k):.0f} | {cold} |")
