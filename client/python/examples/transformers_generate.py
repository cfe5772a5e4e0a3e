"""Generates with a transformers model whose KV cache lives in kvmemd (kvmem.transformers),
then prints the answer, the memory kvmemd held against a full cache of the same tokens, and
the time per generated token next to transformers' own DynamicCache on the same prompt.

    python3 client/python/examples/transformers_generate.py --target unix:/tmp/kvmem.sock \\
        --model ~/.cache/kvmem/models/SmolLM2-135M-Instruct.Q4_1.gguf --policy confkv

--model is a GGUF file (transformers dequantizes it through the gguf package) or a
directory transformers can load. --param name=value overrides a policy parameter.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import time

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import kvmem  # noqa: E402
from kvmem.transformers import CACHE_ARGUMENT as CACHE_ARG  # noqa: E402
from kvmem.transformers import KvmemCache  # noqa: E402



def load(model: str) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    path = pathlib.Path(model).expanduser()
    where, gguf = (path.parent, {"gguf_file": path.name}) if path.is_file() else (path, {})
    lm = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **gguf)
    return lm.eval(), transformers.AutoTokenizer.from_pretrained(where, **gguf)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="kvmemd address (unix:/path or host:port)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--policy", default="confkv")
    ap.add_argument("--param", action="append", default=[], help="name=value")
    ap.add_argument("--prompt", default="Write a short story about a lighthouse keeper who "
                    "finds a message in a bottle.")
    ap.add_argument("--max-new-tokens", type=int, default=300)
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()
    params = {k: float(v) for k, v in (p.split("=", 1) for p in args.param)}

    model, tokenizer = load(args.model)
    chat = [{"role": "user", "content": args.prompt}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    settings = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    print(f"== transformers {transformers.__version__}, {pathlib.Path(args.model).name}; "
          f"kvmemd policy {args.policy} {params or ''}", flush=True)

    with kvmem.Client(args.target) as client, \
            KvmemCache(model, client, kvmem.PolicySpec(args.policy, params)) as cache:
        start = time.perf_counter()
        out = model.generate(ids, **settings, **{CACHE_ARG: cache})
        kvmem_s = time.perf_counter() - start
        memory = cache.memory()
        evicted = cache.evicted_tokens / cache.layout.streams
    generated = out.shape[1] - ids.shape[1]
    print(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    print("---")
    print(f"kvmemd ({args.policy}): {memory.kv_bytes} KV bytes held for {memory.tokens} tokens; "
          f"full cache {memory.full_bytes} ({100 * memory.saved_fraction:.1f}% saved); "
          f"{evicted:.1f} tokens evicted per stream")
    start = time.perf_counter()
    reference = model.generate(ids, **settings)
    dynamic_s = time.perf_counter() - start
    print(f"time per generated token (prompt included): kvmem cache {1e3 * kvmem_s / generated:.1f} "
          f"ms, DynamicCache {1e3 * dynamic_s / (reference.shape[1] - ids.shape[1]):.1f} ms")


if __name__ == "__main__":
    main()
