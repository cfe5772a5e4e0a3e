#!/usr/bin/env bash
# Installs the Debian 12 packages kvmem builds and tests with (as root, or through sudo).
# Skips apt entirely when everything is already present. golang-github-gogo-googleapis-dev
# is there for its plain google/rpc/{status,error_details}.proto (the API's error details),
# compiled to C++ by CMakeLists.txt; nothing of Go is used. prometheus brings promtool and
# the server the metrics tests scrape kvmemd with (tests/python).
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  golang-github-gogo-googleapis-dev
  libabsl-dev libucx-dev prometheus-cpp-dev libspdlog-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  clang-format clang-tidy python3 python3-pip libopenblas-dev libicu-dev unzip
  libcbor-dev libssl-dev openssl nlohmann-json3-dev
  libzmq3-dev cppzmq-dev libmsgpack-cxx-dev libhiredis-dev redis-server
  prometheus
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "deps: installing ${missing[*]}"
sudo_cmd=""
[ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo_cmd apt-get update -qq
$sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
