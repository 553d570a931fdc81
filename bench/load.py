"""Load benchmark: time-to-ready and RSS of a worker's model load, cold and warm, beside
llama.cpp's load of the same file in the same run.

    .venv/bin/python bench/load.py [--models default,big] [--kv-tokens 4096]
                                   [--llama-bench PATH] [--dtype bfloat16] [--threads N]

For each model: a cold load (the repack cache, repack_cache.py, and the kernel forms chosen,
form_choice.py, cleared first) and a warm one (the caches the cold load wrote), each in a fresh
process, `--weights native`, started as `llmq worker` starts it (worker/startup_gc.py).
"ready" is the wall time from the process's start to the model loaded and its KV cache
(`--kv-tokens` tokens) allocated, imports included: what a worker KEDA has just started waits
for; its parts: "imports" (the interpreter's start and every import, torch's included),
`load_model`, and the KV cache's allocation. RSS is the process's after that ("rss"), and its
peak (VmHWM). "worker": a warm `llmq worker` itself (its CLI's imports, the engine beside the
model) from its start to its "engine ready" log line, stopped there, before it reaches Redis.
llama.cpp: the wall time of `llama-bench -p 0 -n 1 -r 1` on the same file (load, a warmup
token and one token: an upper bound on its load), in the same run. Prints the issue-20 bar's
ratios: warm ready / llama.cpp <= 2, rss / (1.3 x file size + KV cache) <= 1. Figures are
printed, never asserted.
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
# argv[4] the process's start (time.time() of the parent just before it started it), argv[5]
# threads.
# As `llmq worker` starts: no cyclic GC until the model is up (worker/startup_gc.py).
_CHILD = r"""
import json, sys, time
from llmq.worker.startup_gc import startup_gc

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

with startup_gc():
    import torch
    from llmq.worker.engine.model.loader import load_model
    imports = time.time() - float(sys.argv[4])
    torch.set_num_threads(int(sys.argv[5]))  # as EngineCore does before its load
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


def child_load(path: Path, dtype: str, kv_tokens: int, threads: int, env: dict[str, str]
               ) -> dict:
    start = time.time()
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), dtype, str(kv_tokens),
                          repr(start), str(threads)], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def worker_ready(path: Path, dtype: str, kv_bytes: int, threads: int, env: dict[str, str]
                 ) -> float:
    """Seconds from starting `llmq worker` to its "engine ready" log line (model loaded, KV
    cache allocated, before it first reaches Redis, which it is stopped short of)."""
    start = time.time()
    worker = subprocess.Popen(
        [sys.executable, "-m", "llmq.cli.main", "--log-level", "INFO", "worker",
         "--model", str(path), "--dtype", dtype, "--kv-cache-memory-bytes", str(kv_bytes),
         "--threads", str(threads), "--redis-url", "redis://127.0.0.1:1"],
        env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        assert worker.stderr is not None
        for line in worker.stderr:
            if "engine ready" in line:
                return time.time() - start
        raise RuntimeError(f"llmq worker exited ({worker.wait()}) before its engine was ready")
    finally:
        worker.kill()
        worker.wait()


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
    # NOTE: one count for both loads: the kernel forms chosen (form_choice.py) are cached per
    # thread count, and another count would measure them again
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
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
    # NOTE: this run's own forms file, beside its repack cache: the shared one is rewritten by
    # any other process that loads the model on another thread count, and a warm load that
    # finds it so measures the forms again (~1 s)
    env["LLMQ_FORMS_DIR"] = str(repack_root / "forms")
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
            cold = child_load(path, args.dtype, args.kv_tokens, args.threads, env)
            warm = child_load(path, args.dtype, args.kv_tokens, args.threads, env)
            worker = worker_ready(path, args.dtype, warm["kv_bytes"], args.threads, env)
            llama = llama_cpp_load(path, args.llama_bench)
            for label, r in (("cold", cold), ("warm", warm)):
                bar = 1.3 * size + r["kv_bytes"]
                print(f"  {label}: ready {r['ready_s']:.2f} s (imports {r['imports_s']:.2f} s, "
                      f"load_model {r['load_s']:.2f} s, KV {r['kv_s']:.2f} s), "
                      f"rss {mib(r['rss'])} (peak {mib(r['peak'])}), KV {mib(r['kv_bytes'])}, "
                      f"rss / (1.3 x file + KV) = {r['rss'] / bar:.2f}")
            print(f"  worker (warm, `llmq worker` to its \"engine ready\" line): {worker:.2f} s")
            if llama is not None:
                print(f"  llama.cpp (llama-bench -p 0 -n 1 -r 1, wall): {llama:.2f} s; "
                      f"warm ready / llama.cpp = {warm['ready_s'] / llama:.2f}, "
                      f"cold ready / llama.cpp = {cold['ready_s'] / llama:.2f}, "
                      f"worker / llama.cpp = {worker / llama:.2f}")
            else:
                print(f"  llama.cpp: {args.llama_bench} missing")
    finally:
        shutil.rmtree(repack_root, ignore_errors=True)


if __name__ == "__main__":
    main()
