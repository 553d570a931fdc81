"""The bars of issue 26 for `llmq run`: a Parquet dataset through a two-stage pipeline.

    .venv/bin/python bench/dataset_job.py                       # 20,000 rows, default model
    .venv/bin/python bench/dataset_job.py --rows 300 --tiny     # a quick look (test model)
    flock /tmp/bench.lock .venv/bin/python bench/dataset_job.py --summary-tokens 4 \
        --words 12-24 --save bench/results/dataset_job-DATE.txt  # the bar, short rows/outputs
    flock /tmp/bench.lock .venv/bin/python bench/dataset_job.py --tiny --only-throughput \
        --rounds 2 --fresh-pool                                  # the throughput bar alone
    flock /tmp/bench.lock .venv/bin/python bench/dataset_job.py --tiny --batch-invariant
                                          # the pool batch-invariant: a rerun is exact

Starts `llmq up --workers 2` under a private run folder, writes a Parquet file of `--rows`
synthetic articles, then in one run:

1. the pipeline (summarise, then classify into a JSON schema) uninterrupted: wall time, rows
   out, schema column valid, peak RSS of the CLI (its own rusage);
2. the same pipeline under another name, the CLI SIGKILLed twice (at a quarter and at half of
   the rows written) and rerun: rows out once each, how many equal run 1's in rows and ids (ids
   compared without the job's name; usage without prefix-cache hits), and how many of its texts
   are exactly the results the broker stored for their request ids. NOTE: two separate runs
   agree only as far as greedy decoding does across batch compositions (bf16 on the default
   model may flip a near-tie token; a flipped summary also changes the label's request id),
   unless the pool runs `--batch-invariant` (this script's flag passes it to `llmq up`: every
   row's logits the same whatever shares its step, so both runs agree row for row);
   the stored-results check is the resume's own exactness. Each row that differs is shown
   with where it first differs: a stage whose request was the same in both runs (the same id
   but for the job's name: an id ends with a hash of the request) and whose answer differs is
   the pool answering one request two ways; the same request asked a third time, alone, shows
   which way it goes then. A request that differs although every earlier stage's answer was the
   same would be the job's own fault;
3. throughput: a one-stage dataset job against the same requests prepared as JSONL through
   `llmq submit -f` (prompts tagged per run so neither finds the other's prompts cached), with
   the CPU seconds each CLI used (on a starved CPU the job's window waits for its CLI). One pool
   gets slower with every run it serves, whichever kind: `--fresh-pool` starts a pool for each
   run, and over `--rounds 2` (the order swapped) the geometric mean of the ratios cancels a
   steady drift.

Prints one line per figure (and, with `--save`, appends them to a file with the command, the
date and the commit). The machine is shared: read the ratio, not the absolute rate.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

LLMQ = [sys.executable, "-m", "llmq.cli.main"]
LABELS = ["news", "sport", "science", "culture"]
STAGES = ("summary", "label")
SCHEMA = {"type": "object", "properties": {"label": {"enum": LABELS}}, "required": ["label"],
          "additionalProperties": False}
WORDS = ("the council said a new plan for the river park would open next spring while the team "
         "won again at home and scientists found a small star near the old galaxy and the "
         "museum showed paintings of ships harbours markets storms and quiet villages").split()


def write_dataset(path: Path, rows: int, words: tuple[int, int]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(26)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))
             for _ in range(rows)]
    pq.write_table(pa.table({"id": list(range(rows)), "text": texts}), path, row_group_size=4096)


SUMMARY_TOKENS = 16  # --summary-tokens


def pipeline_job(folder: Path, name: str, output: str, stages: int, tag: str = "",
                 max_rows: int | None = None) -> Path:
    summary = {"name": "summary", "prompt": tag + "Summarise in one sentence: {{ text }}",
               "max_tokens": SUMMARY_TOKENS, "temperature": 0, "ignore_eos": True}
    label = {"name": "label", "max_tokens": 24, "temperature": 0, "schema": SCHEMA,
             "messages": [{"role": "user", "content": "Classify this summary: {{ summary }}"}]}
    source: Any = ("in.parquet" if max_rows is None
                   else {"path": "in.parquet", "max_rows": max_rows})
    job: dict[str, Any] = {"name": name, "source": source, "output": output,
           "stages": [summary, label][:stages]}
    if stages == 2:
        # NOTE: a window of twice the pool's seats keeps both workers full, and leaves work for
        # the kills to interrupt (with the default window the pool may finish a small run while
        # the CLI is down, and the rerun only collects it).
        job["max_in_flight"] = 256
    path = folder / f"{name}.yaml"
    import yaml

    path.write_text(yaml.safe_dump(job))
    return path


CPU_SECONDS: dict[str, float] = {}  # the last run's CPU seconds (user + system), by command


def run_cli(args: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    """(wall seconds, peak RSS in MB of the CLI process, stderr) of one llmq command."""
    start = time.monotonic()
    proc = subprocess.Popen([*LLMQ, *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    CPU_SECONDS[args[0]] = usage.ru_utime + usage.ru_stime
    if proc.returncode != 0:
        raise SystemExit(f"llmq {' '.join(args)} failed ({proc.returncode}):\n{stderr}")
    return time.monotonic() - start, usage.ru_maxrss // 1024, stderr


def count_lines(path: Path) -> int:
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def read_rows(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def comparable(row: dict[str, Any], name: str) -> dict[str, Any]:
    return {k: (v.removeprefix(name) if k.endswith("_id") and v else
                {**v, "cached_prompt_tokens": None} if k.endswith("_usage") and v else v)
            for k, v in row.items()}


def stored_results(rows: list[dict[str, Any]]) -> str:
    """How many of the rows' stage texts are exactly what the broker holds for their ids: a
    resumed job writes the pool's answers, never a second generation of them."""
    from llmq.broker import Client

    checked = same = 0
    with Client() as client:
        for row in rows:
            for stage in STAGES:
                if row.get(f"{stage}_id"):
                    checked += 1
                    same += client.result(row[f"{stage}_id"], timeout=30).text == row[stage]
    return f"{same}/{checked}"


def first_difference(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, bool]:
    """(the first stage at which two runs' rows differ, whether its request was the same in
    both); ("", True) when only other columns differ."""
    for stage in STAGES:
        ids = [(a.get(f"{stage}_id") or "").removeprefix("killed."),
               (b.get(f"{stage}_id") or "").removeprefix("whole.")]
        if ids[0] != ids[1] or a.get(stage) != b.get(stage):
            return stage, ids[0] == ids[1]
    return "", True


def differing_rows(killed: list[dict[str, Any]], whole: list[dict[str, Any]],
                   limit: int = 5) -> list[str]:
    """A count of the rows that differ between the two runs by where they first differ, then
    one line for each of the first `limit`: a stage whose request was the same in both runs and
    whose answers differ is the pool answering one request two ways."""
    from llmq.broker import Client

    pairs = [(a, b) for a, b in zip(killed, whole, strict=False)
             if comparable(a, "killed.") != comparable(b, "whole.")]
    where = Counter(first_difference(a, b) for a, b in pairs)
    counts = [f"{stage or 'another column'} ({'the same' if same else 'a different'} request "
              f"in both runs): {n}" for (stage, same), n in sorted(where.items())]
    lines = [f"rows that differ: {len(pairs)}" + ("; first at " if counts else "")
             + ", ".join(counts)]
    with Client() as client:
        for a, b in pairs[:limit]:
            stage, same_request = first_difference(a, b)
            if not stage:
                lines.append(f"  row {a['llmq_row']}: stage texts and requests the same")
                continue
            ids = [a.get(f"{stage}_id"), b.get(f"{stage}_id")]
            texts = [a.get(stage), b.get(stage)]
            stored = [is_stored(client, i, t) for i, t in zip(ids, texts, strict=True)]
            line = (f"  row {a['llmq_row']}: first differs at {stage}; the same request in "
                    f"both runs: {same_request}; each run's text its request's stored "
                    f"result: {stored}; texts {texts[0]!r} / {texts[1]!r}")
            if same_request and stage == "summary":
                line += f"; asked again alone: {again_alone(client, a)!r}"
            lines.append(line)
    return lines


def queued_twice(prefix: str) -> str:
    """How many of a job's requests the queue's batch lane holds more than once, of how many
    (a resubmitted id must be followed, not queued again)."""
    from llmq.broker import Client

    with Client() as client:
        key = client.keys.lane_stream(client.settings.queue, "batch")
        entries: Any = client.redis.xrange(key)  # [(entry id, {b"json": request, ...})]
        counts = Counter(i for _, fields in entries
                         if (i := json.loads(fields[b"json"]).get("id", "")).startswith(prefix))
    return f"{sum(1 for n in counts.values() if n > 1)} of {len(counts)}"


def is_stored(client: Any, request_id: str | None, text: str | None) -> bool | None:
    """Whether `text` is the broker's result for `request_id` (None: no id, or no result)."""
    from llmq.protocol.errors import LLMQError

    if request_id is None:
        return None
    try:
        return bool(client.result(request_id, timeout=30).text == text)
    except LLMQError:
        return None


def again_alone(client: Any, row: dict[str, Any]) -> str:
    """The row's summary request asked again under a fresh id, alone."""
    request_id = f"again-{row['llmq_row']}-{time.time_ns()}"
    client.submit_many([{"id": request_id, "stream": False, "max_tokens": SUMMARY_TOKENS,
                         "temperature": 0, "ignore_eos": True,
                         "prompt": f"Summarise in one sentence: {row['text']}"}])
    return str(client.result(request_id, timeout=120).text)


def killed_twice(folder: Path, rows: int, env: dict[str, str]) -> tuple[list[int], float]:
    """Run the pipeline, SIGKILL it at 1/4 and 1/2 of the rows, rerun; (rows seen at each kill,
    wall time of the final run)."""
    job = pipeline_job(folder, "killed", "killed.parquet", 2)
    journal = folder / "killed.parquet.partial.jsonl"
    seen = []
    for fraction in (0.25, 0.5):
        proc = subprocess.Popen([*LLMQ, "run", str(job)], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        while count_lines(journal) < rows * fraction and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        seen.append(count_lines(journal))
    wall, _, _ = run_cli(["run", str(job)], env)
    return seen, wall


def dataset_rate(folder: Path, env: dict[str, str], rows: int, tag: str) -> float:
    """tokens/s of a one-stage dataset job over the first `rows` rows, prompts tagged `tag`."""
    name = "onestage" + tag.strip("[] ")
    job = pipeline_job(folder, name, f"{name}.jsonl", 1, tag=tag, max_rows=rows)
    wall, _, _ = run_cli(["run", str(job)], env)
    tokens = sum(json.loads(line)["summary_usage"]["completion_tokens"]
                 for line in (folder / f"{name}.jsonl").read_text().splitlines())
    return tokens / wall


def file_rate(folder: Path, env: dict[str, str], rows: int, tag: str) -> float:
    """tokens/s of the same requests prepared as JSONL, through `llmq submit -f`."""
    import pyarrow.parquet as pq

    name = "file" + tag.strip("[] ")
    with open(folder / f"{name}.requests.jsonl", "w") as f:
        for row in pq.read_table(folder / "in.parquet").to_pylist()[:rows]:
            f.write(json.dumps({"id": f"{name}-{row['id']}", "stream": False,
                                "max_tokens": SUMMARY_TOKENS,
                                "temperature": 0, "ignore_eos": True,
                                "prompt": f"{tag}Summarise in one sentence: {row['text']}"})
                    + "\n")
    wall, _, _ = run_cli(["submit", "-f", str(folder / f"{name}.requests.jsonl"), "-o",
                          str(folder / f"{name}.jsonl"), "--no-progress"], env)
    tokens = sum(json.loads(line)["usage"]["completion_tokens"]
                 for line in (folder / f"{name}.jsonl").read_text().splitlines())
    return tokens / wall


class Pool:
    """`llmq up --workers N --detach` under a run folder of its own; `fresh()` replaces it with
    a new pool over an empty Redis (the throughput runs: a pool that has served earlier runs
    holds their result streams for a day, and each run on it was slower than the one before)."""

    def __init__(self, folder: Path, workers: int, dtype: str, model: str,
                 batch_invariant: bool = False) -> None:
        self.folder = folder
        self.up = [*LLMQ, "up", "--workers", str(workers), "--detach", "--dtype", dtype,
                   *(["--model", model] if model else []),
                   *(["--batch-invariant"] if batch_invariant else [])]
        self.count = 0
        self.env: dict[str, str] = {}

    def start(self) -> None:
        self.count += 1
        run_dir = self.folder / ("run" if self.count == 1 else f"run{self.count}")
        os.environ["LLMQ_RUN_DIR"] = str(run_dir)  # this process's Client finds the pool
        os.environ.pop("LLMQ_REDIS_URL", None)
        self.env = dict(os.environ)
        subprocess.run(self.up, env=self.env, check=True, stdout=subprocess.DEVNULL)

    def stop(self) -> None:
        subprocess.run([*LLMQ, "down"], env=self.env, check=False, stdout=subprocess.DEVNULL)

    def fresh(self) -> dict[str, str]:
        self.stop()
        self.start()
        return self.env


def throughput(folder: Path, env: dict[str, str], rows: int, rounds: int,
               pool: Pool | None = None) -> list[tuple[float, float, dict[str, float]]]:
    """(dataset job, submit -f) tokens/s per round and the CLIs' CPU seconds, the order swapped
    every other round (a shared machine's load drifts); prompts tagged per run so none finds
    another's cached."""
    def fresh() -> dict[str, str]:
        return env if pool is None else pool.fresh()

    rates = []
    for n in range(rounds):
        if n % 2 == 0:
            dataset = dataset_rate(folder, fresh(), rows, f"[A{n}] ")
            file = file_rate(folder, fresh(), rows, f"[B{n}] ")
        else:
            file = file_rate(folder, fresh(), rows, f"[B{n}] ")
            dataset = dataset_rate(folder, fresh(), rows, f"[A{n}] ")
        rates.append((dataset, file, dict(CPU_SECONDS)))
    return rates


def run_throughput(folder: Path, env: dict[str, str], args: argparse.Namespace,
                   say: Callable[[str], None], pool: Pool) -> None:
    rows = args.throughput_rows or args.rows
    rates = throughput(folder, env, rows, args.rounds, pool if args.fresh_pool else None)
    for n, (dataset, file, cpu) in enumerate(rates):
        say(f"one stage ({rows} rows), round {n + 1}{' (submit -f first)' if n % 2 else ''}: "
            f"dataset job {dataset:.0f} tok/s, submit -f {file:.0f} tok/s, ratio "
            f"{dataset / file:.3f}; CLI CPU {cpu['run']:.1f} s and {cpu['submit']:.1f} s "
            f"(load average {os.getloadavg()[0]:.1f})")
    if len(rates) > 1:
        ratios = [dataset / file for dataset, file, _ in rates]
        # NOTE: rounds alternate the order (ABBA...): over an even number of them the geometric
        # mean cancels a steady slowdown from one run to the next, the median does not.
        say(f"one stage: median ratio {statistics.median(ratios):.3f}, geometric mean "
            f"{statistics.geometric_mean(ratios):.3f} over {len(rates)} rounds"
            + (", each run on a fresh pool" if args.fresh_pool else ""))


def words_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high or low)


class Report:
    """Figures printed, and appended to `--save`'s file with how they were made."""

    def __init__(self, save: str | None) -> None:
        self.save = save
        if save:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], text=True,
                                    capture_output=True, cwd=Path(__file__).parent).stdout
            with open(save, "a") as f:
                f.write(f"$ {' '.join([Path(sys.executable).name, *sys.argv])}\n"
                        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit "
                        f"{commit.strip()}, {os.cpu_count()} vCPUs shared with other jobs, "
                        f"load average {os.getloadavg()[0]:.2f}\n")

    def __call__(self, text: str) -> None:
        print(text, flush=True)
        if self.save:
            with open(self.save, "a") as f:
                f.write(text + "\n")


def main() -> None:
    global SUMMARY_TOKENS
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="the tiny random test model")
    parser.add_argument("--model", default="", help="a .gguf or HF folder (default model)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--summary-tokens", type=int, default=SUMMARY_TOKENS,
                        help="max_tokens of the summary stage (its output length)")
    parser.add_argument("--words", type=words_range, default=(30, 60), metavar="MIN-MAX",
                        help="words per synthetic article")
    parser.add_argument("--throughput-rows", type=int, default=None,
                        help="rows of the one-stage throughput comparison (default: --rows)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of the throughput comparison (order swapped each round)")
    parser.add_argument("--fresh-pool", action="store_true",
                        help="each throughput run on a pool started for it (an empty Redis)")
    parser.add_argument("--only-throughput", action="store_true",
                        help="skip the pipeline and kill runs")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the pool's workers run --batch-invariant (docs/datasets.md)")
    parser.add_argument("--save", default=None, help="append the figures to this file")
    args = parser.parse_args()
    SUMMARY_TOKENS = args.summary_tokens
    say = Report(args.save)

    folder = Path(tempfile.mkdtemp(prefix="llmq-dataset-bench-"))
    model = args.model
    if args.tiny:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.fixtures.tiny_gguf import write_tiny_llama

        model = str(folder / "tiny.gguf")
        write_tiny_llama(model)
    pool = Pool(folder, args.workers, args.dtype, model, args.batch_invariant)
    pool.start()
    env = pool.env
    try:
        write_dataset(folder / "in.parquet", args.rows, args.words)
        say(f"rows: {args.rows} ({args.words[0]}-{args.words[1]} words), workers: "
            f"{args.workers}{' (batch-invariant)' if args.batch_invariant else ''}, model: "
            f"{model or 'default'} ({args.dtype}), summary "
            f"{SUMMARY_TOKENS} tokens, folder: {folder}")
        if args.only_throughput:
            run_throughput(folder, env, args, say, pool)
            return
        job = pipeline_job(folder, "whole", "whole.parquet", 2)
        wall, rss, stderr = run_cli(["run", str(job)], env)
        whole = read_rows(folder / "whole.parquet")
        errors = count_lines(folder / "whole.errors.jsonl")
        valid = sum(1 for row in whole if isinstance(row.get("label_parsed"), dict)
                    and row["label_parsed"].get("label") in LABELS)
        say(f"pipeline uninterrupted: {wall:.1f} s, {len(whole)} rows out + {errors} errors, "
            f"{len(set(r['llmq_row'] for r in whole))} distinct rows, "
            f"{valid} schema-valid labels, CLI peak RSS {rss} MB")
        say("  " + stderr.strip().splitlines()[-3 if len(stderr.strip().splitlines()) > 2
                                                else 0])
        seen, wall_rerun = killed_twice(folder, args.rows, env)
        killed = read_rows(folder / "killed.parquet")
        num_same = sum(comparable(a, "killed.") == comparable(b, "whole.")
                       for a, b in zip(killed, whole, strict=False))
        rows_once = [r["llmq_row"] for r in killed] == list(range(args.rows))
        same_ids = sum(comparable({k: v for k, v in a.items() if k == "llmq_row"
                                   or k.endswith("_id")}, "killed.")
                       == comparable({k: v for k, v in b.items() if k == "llmq_row"
                                      or k.endswith("_id")}, "whole.")
                       for a, b in zip(killed, whole, strict=False))
        say(f"killed at {seen[0]} and {seen[1]} rows written, rerun {wall_rerun:.1f} s: "
            f"{len(killed)} rows, each once in order: {rows_once}, identical to the "
            f"uninterrupted run's: {num_same}/{len(whole)} rows, {same_ids}/{len(whole)} in "
            f"row and ids; texts equal to their requests' stored results: "
            f"{stored_results(killed)}; requests queued more than once: "
            f"{queued_twice('killed.')}")
        for line in differing_rows(killed, whole):
            say(line)
        run_throughput(folder, env, args, say, pool)
    finally:
        pool.stop()


if __name__ == "__main__":
    main()
