#!/usr/bin/env bash
# Packs what the GPU machine cannot build (it has CUDA and CMake but none of Debian's -dev
# packages): the CUDA backend's gtest programs, kvmemd and the engine step benchmark, built
# here against Debian's gRPC/abseil/protobuf, plus every shared library they load that is
# not the C/C++ runtime or the driver, into gpu-bundle/ (ignored by git); also gpu_parity
# and gpu_bench, so that the GPU machine spends its minutes running, not compiling. Carry it
# with the device run (carry: ["gpu-bundle"]); tests/gpu/run.sh then uses it.
set -euo pipefail
cd "$(dirname "$0")/../.."
targets=(cuda_backend_test cuda_attach_test kvmemd policy_step_bench in_place_bench gpu_parity gpu_bench)
cmake --build build -j "${KVMEM_JOBS:-2}" --target "${targets[@]}"
rm -rf gpu-bundle
mkdir -p gpu-bundle/bin gpu-bundle/lib
for t in "${targets[@]}"; do
  f=$(find build -name "$t" -type f -perm -u+x | head -1)
  strip -o "gpu-bundle/bin/$t" "$f"
done
# Libraries by path from ldd, without glibc, libstdc++/libgcc and the CUDA driver (the GPU
# machine has newer ones; its glibc is 2.39, these programs need 2.36).
ldd gpu-bundle/bin/* | awk '/=> \//{print $3}' | sort -u |
  grep -v -E '/(libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|libcuda|ld-linux[^/]*)\.so' |
  while read -r lib; do cp -L "$lib" gpu-bundle/lib/; done
strip --strip-unneeded gpu-bundle/lib/*.so* 2>/dev/null || true
echo "gpu-bundle: $(ls gpu-bundle/bin | wc -l) programs, $(ls gpu-bundle/lib | wc -l) libraries," \
  "$(du -sh gpu-bundle | cut -f1)"
