#!/usr/bin/env python3
"""Runs bench/grpc_path_bench once and prints kvmemd's gRPC path against raw gRPC as ratios.

Usage: python3 bench/grpc_path.py [path/to/grpc_path_bench]
"""
import json
import subprocess
import sys

binary = sys.argv[1] if len(sys.argv) > 1 else "build/bench/grpc_path_bench"
out = subprocess.run([binary, "--benchmark_format=json", "--benchmark_repetitions=3",
                      "--benchmark_report_aggregates_only=true"],
                     check=True, capture_output=True, text=True).stdout
runs = {b["run_name"].split("/")[0]: b for b in json.loads(out)["benchmarks"]
        if b.get("aggregate_name") == "median"}


def us(name):
    b = runs[name]
    scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3}[b["time_unit"]]
    return b["real_time"] * scale


def gibps(name):
    return runs[name]["bytes_per_second"] / 2**30


print(f"{'benchmark':<34}{'median':>14}")
print(f"{'Append, 1 MiB K+V (kvmemd)':<34}{gibps('BM_Append1MiB'):>9.2f} GiB/s  ({us('BM_Append1MiB'):.0f} us/call)")
print(f"{'raw gRPC, 1 MiB payload':<34}{gibps('BM_RawGrpc1MiB'):>9.2f} GiB/s  ({us('BM_RawGrpc1MiB'):.0f} us/call)")
print(f"{'ratio kvmemd / raw':<34}{gibps('BM_Append1MiB') / gibps('BM_RawGrpc1MiB'):>9.2f}")
print(f"{'Step round trip (window, evicts)':<34}{us('BM_StepRoundTrip'):>9.1f} us")
print(f"{'raw gRPC empty round trip':<34}{us('BM_RawGrpcEmpty'):>9.1f} us")
print(f"{'ratio raw / kvmemd':<34}{us('BM_RawGrpcEmpty') / us('BM_StepRoundTrip'):>9.2f}")
