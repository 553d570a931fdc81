"""Load benchmark: time-to-ready and RSS of a worker's model load, cold and warm, beside
llama.cpp's load of the same file in the same run.

    .venv/bin/python bench/load.py [--models default,big] [--kv-tokens 4096]
                                   [--llama-bench PATH] [--dtype bfloat16]

For each model: a cold load (the repack cache, repack_cache.py, cleared first) and a warm one
(the cache the cold load wrote), each in a fresh process, `--weights native`. "ready" is the
wall time from the process's start to the model loaded and its KV cache (`--kv-tokens` tokens)
allocated, imports included: what a worker KEDA has just started waits for; its parts:
"imports" (the interpreter's start and every import, torch's included), `load_model`, and the
KV cache's allocation. RSS is the process's after that ("rss"), and its peak (VmHWM). llama.cpp:
the wall time of `llama-bench -p 0 -n 1 -r 1` on the same file (load, a warmup token and one
token: an upper bound on its load), in the same run. Prints the issue-20 bar's ratios:
warm ready / llama.cpp <= 2, rss / (1.3 x file size + KV cache) <= 1. Figures are printed,
never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "llmq-peers"))
BIG_MODEL = PEERS_DIR / "big" / "model.Q4_K_M.gguf"
LLAMA_BENCH = PEERS_DIR / "llama-build" / "bin" / "llama-bench"

# Run in a fresh interpreter: argv[1] model path, argv[2] dtype, argv[3] KV tokens,
# argv[4] the process's start (time.time() of the parent just before it started it).
_CHILD = r"""
import json, sys, time
from llmq.worker.engine.model.loader import load_model
imports = time.time() - float(sys.argv[4])

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

t0 = time.perf_counter()
loaded = load_model(sys.argv[1], sys.argv[2])
load_s = time.perf_counter() - t0
model = loaded.model
block = 16
blocks = -(-int(sys.argv[3]) // block)
t1 = time.perf_counter()
kv = model.make_kv_caches(blocks, block)
kv_s = time.perf_counter() - t1
ready = time.time() - float(sys.argv[4])
print(json.dumps({"ready_s": ready, "imports_s": imports, "load_s": load_s, "kv_s": kv_s,
                  "rss": status("VmRSS:"),
                  "peak": status("VmHWM:"),
                  "kv_bytes": blocks * model.kv_cache_bytes_per_block(block)}))
"""


def child_load(path: Path, dtype: str, kv_tokens: int, env: dict[str, str]) -> dict:
    start = time.time()
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), dtype, str(kv_tokens),
                          repr(start)], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_cpp_load(path: Path, llama_bench: Path) -> float | None:
    if not llama_bench.is_file():
        return None
    start = time.perf_counter()
    subprocess.run([str(llama_bench), "-m", str(path), "-p", "0", "-n", "1", "-r", "1"],
                   capture_output=True, check=True)
    return time.perf_counter() - start


def mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="default,big",
                        help="comma-separated: default, big, or .gguf paths")
    parser.add_argument("--kv-tokens", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16", help="the KV cache's dtype")
    parser.add_argument("--llama-bench", type=Path, default=LLAMA_BENCH)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from llmq.worker.engine.model.default_model import default_model_path

    paths = {"default": default_model_path(), "big": BIG_MODEL}
    repack_root = Path(tempfile.mkdtemp(prefix="llmq-bench-repack-"))
    # NOTE: bytecode is written (the cold run compiles llmq's modules, the warm one reads
    # them), as an installed llmq has it: PYTHONDONTWRITEBYTECODE would add their compiling
    # to every start.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    env["LLMQ_REPACK_DIR"] = str(repack_root)
    try:
        for name in args.models.split(","):
            path = paths.get(name, Path(name))
            if not path.is_file():
                print(f"{name}: {path} missing, skipped")
                continue
            size = path.stat().st_size
            print(f"== {name}: {path} ({mib(size)}), KV cache {args.kv_tokens} tokens "
                  f"{args.dtype}")
            shutil.rmtree(repack_root, ignore_errors=True)
            cold = child_load(path, args.dtype, args.kv_tokens, env)
            warm = child_load(path, args.dtype, args.kv_tokens, env)
            llama = llama_cpp_load(path, args.llama_bench)
            for label, r in (("cold", cold), ("warm", warm)):
                bar = 1.3 * size + r["kv_bytes"]
                print(f"  {label}: ready {r['ready_s']:.2f} s (imports {r['imports_s']:.2f} s, "
                      f"load_model {r['load_s']:.2f} s, KV {r['kv_s']:.2f} s), "
                      f"rss {mib(r['rss'])} (peak {mib(r['peak'])}), KV {mib(r['kv_bytes'])}, "
                      f"rss / (1.3 x file + KV) = {r['rss'] / bar:.2f}")
            if llama is not None:
                print(f"  llama.cpp (llama-bench -p 0 -n 1 -r 1, wall): {llama:.2f} s; "
                      f"warm ready / llama.cpp = {warm['ready_s'] / llama:.2f}, "
                      f"cold ready / llama.cpp = {cold['ready_s'] / llama:.2f}")
            else:
                print(f"  llama.cpp: {args.llama_bench} missing")
    finally:
        shutil.rmtree(repack_root, ignore_errors=True)


if __name__ == "__main__":
    main()
