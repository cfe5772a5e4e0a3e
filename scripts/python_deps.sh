#!/usr/bin/env bash
# Python packages for the parity tests and the evaluation harness, from PyPI; with
# --transformers only what the transformers cache needs (torch, transformers, the kvmem
# package). torch from PyPI is its CUDA build (about 3 GB with its CUDA libraries: about two
# minutes here); it runs on the CPU as well.
# llama-cpp-python ships no binary wheels on PyPI, so pip builds llama.cpp from source the
# first time (about 10 minutes on 2 cores); the built wheel is cached under ~/.cache/kvmem.
set -euo pipefail
# Debian's own python3 refuses system-wide pip installs (PEP 668) unless told; pyenv and
# virtualenv Pythons ignore the variable.
export PIP_BREAK_SYSTEM_PACKAGES=1
export PIP_ROOT_USER_ACTION=ignore  # root on a CI machine is expected
have() { python3 -c "import $1" 2>/dev/null; }
cache="${KVMEM_CACHE:-$HOME/.cache/kvmem}/wheels"
mkdir -p "$cache"
install_kvmem() {
  # The kvmem Python client (client/python): its gRPC stubs are generated from proto/ when
  # it is installed, so it is installed again every run (the proto may have changed).
  python3 -m pip install --quiet "$(dirname "$0")/../client/python"
}
# accelerate: transformers (5.x) loads a GGUF checkpoint only with it installed.
have torch && have transformers && have gguf && have accelerate ||
  python3 -m pip install --quiet torch transformers gguf accelerate
if [ "${1:-}" = "--transformers" ]; then
  install_kvmem
  exit 0
fi
have pytest && have gguf && have matplotlib && have cbor2 && have yaml && have zmq && have msgpack ||
  python3 -m pip install --quiet pytest numpy gguf matplotlib cbor2 pyyaml pyzmq msgpack
if ! have llama_cpp; then
  if ls "$cache"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    python3 -m pip install --quiet "$cache"/llama_cpp_python-*.whl
  else
    echo "python_deps: building llama-cpp-python from PyPI (once; about 10 minutes)" >&2
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_OPENMP=OFF" MAKEFLAGS="-j${KVMEM_JOBS:-2}" \
      python3 -m pip wheel --quiet --no-deps "llama-cpp-python==0.3.36" -w "$cache"
    python3 -m pip install --quiet "$cache"/llama_cpp_python-*.whl
  fi
fi
install_kvmem
