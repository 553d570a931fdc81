"""Probe: does a request's answer depend on what shares its engine step? (issue 26)

    flock /tmp/bench.lock .venv/bin/python bench/batch_invariance.py            # tiny model
    flock /tmp/bench.lock .venv/bin/python bench/batch_invariance.py --batch-invariant
    flock /tmp/bench.lock .venv/bin/python bench/batch_invariance.py --model M.gguf

Two levels, each compared bitwise against the same thing computed alone:

1. ops: every projection shape of the model (and the LM head) on rows of a random activation,
   each row computed alone and then inside calls of 3, 17 and 64 rows; and the first layer's
   attention output of one prompt prefilled whole, in chunks of 16, and after its first 32
   tokens came from another step (a prefix-cache hit). Prints how many rows differ and the
   largest difference.
2. engine: one greedy request with logprobs (its tokens and every logprob as float bits) run
   alone, then inside batches of 3, 17 and 64 requests of mixed prompt lengths, with prefill
   budgets of 16 and 48 tokens a step, and after a request sharing its first 48 tokens filled
   the prefix cache. Prints which differ.

Runs the model as a worker would (`--dtype bfloat16`, native weights, LLMQ_FORMS as set:
measured by default). Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmq.worker.engine.config import EngineConfig  # noqa: E402
from llmq.worker.engine.engine_core import EngineCore  # noqa: E402
from llmq.worker.engine.model.attention import AttentionMetadata  # noqa: E402
from llmq.worker.engine.model.linear import Linear  # noqa: E402
from llmq.worker.engine.sampling_params import SamplingParams  # noqa: E402

CACHED: dict[str, int] = {}  # request id -> prompt tokens its last run found cached
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)


def row_differences(run, x: torch.Tensor, sizes: tuple[int, ...], form_of=None) -> str:
    """How many of a call's rows differ from the same row computed alone, per call size."""
    alone = torch.cat([run(x[i:i + 1]).float() for i in range(x.shape[0])])
    parts = []
    for n in sizes:
        together = run(x[:n]).float()
        differ = (together != alone[:n]).any(dim=1)
        worst = float((together - alone[:n]).abs().max())
        parts.append(f"{n} rows: {int(differ.sum())} differ (max {worst:.1e}"
                     + (f", form {form_of(n)})" if form_of else ")"))
    return "; ".join(parts)


def held_forms(linear: Linear) -> dict[str, object]:
    """Each form the projection holds, as a function of x (the same form whatever the rows)."""
    forms = {}
    if linear.quant is not None:
        forms["quant"] = lambda x: linear._chosen_forward(x, "quant")
    if linear.int8 is not None:
        forms["int8"] = lambda x: linear._chosen_forward(x, "int8")
    for form in linear._dense:
        forms[form] = lambda x, form=form: linear._chosen_forward(x, form)
    return forms


def probe_ops(model, sizes: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    seen: set[tuple[int, int]] = set()
    layer = model._layers[0]
    named = [(f"{name} {p.out_features}x{p.in_features}", p) for name, p in
             zip(("qkv", "o", "gate_up", "down"), layer.projections, strict=False)]
    named.append((f"lm_head {model.lm_head.out_features}x{model.lm_head.in_features}",
                  model.lm_head))
    for name, linear in named:
        if (linear.out_features, linear.in_features) in seen and "head" not in name:
            continue
        seen.add((linear.out_features, linear.in_features))
        x = torch.randn(max(sizes), linear.in_features, generator=g)
        with torch.inference_mode():
            print(f"ops: {name}: {row_differences(linear, x, sizes, linear.form_of)}",
                  flush=True)
            if linear.forms is not None:
                for form, run in held_forms(linear).items():
                    print(f"ops: {name}, {form} form alone vs in calls of: "
                          f"{row_differences(run, x, sizes)}", flush=True)
    probe_attention(model)


def probe_attention(model) -> None:
    """The final hidden states of a 1100-token prompt's tokens: prefilled whole, in chunks,
    after a prefix hit (its first 336 tokens computed in an earlier step), its last 5 tokens
    decoded one at a time (as a preempted request's recomputation prefills what was decoded)."""
    prompt = torch.tensor([100 + (i * 7) % 300 for i in range(1100)])
    block_size, num_blocks = 16, 72
    table = list(range(1, 1 + -(-len(prompt) // block_size)))

    def run(chunks: list[int]) -> torch.Tensor:
        caches = model.make_kv_caches(num_blocks, block_size)
        start, hidden = 0, []
        for size in chunks:
            meta = AttentionMetadata.build([size], [start + size], [table], block_size)
            hidden.append(model(prompt[start:start + size], meta, caches))
            start += size
        return torch.cat(hidden)

    whole = run([1100])
    for name, chunks in (("chunks of 300", [300, 300, 300, 200]),
                         ("prefix hit of 336, then 764", [336, 764]),
                         ("last 5 tokens one at a time (decodes)", [1095] + [1] * 5)):
        other = run(chunks)
        differ = int((other != whole).any(dim=1).sum())
        print(f"ops: hidden states of a 1100-token prompt, {name} vs whole: {differ} rows "
              f"differ (max {float((other - whole).abs().max()):.1e})", flush=True)


def run_all(engine: EngineCore, prompts: list[list[int]]
            ) -> list[tuple[list[int], list[tuple[int, ...]]]]:
    """Each prompt's tokens and every step's logprobs as float bits (bitwise comparable)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"probe-{i}", prompt, GREEDY)
    got: dict[str, tuple[list[int], list[tuple[int, ...]]]] = {
        f"probe-{i}": ([], []) for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, bits = got[out.request_id]
            tokens += out.new_token_ids
            if out.finished and out.usage is not None:
                CACHED[out.request_id] = out.usage.cached_prompt_tokens
            bits += [tuple(torch.tensor([lp.logprob, *lp.top_logprobs], dtype=torch.float32)
                           .view(torch.int32).tolist()) for lp in out.new_logprobs]
    return [got[f"probe-{i}"] for i in range(len(prompts))]


def probe_engine(config: EngineConfig, sizes: tuple[int, ...]) -> None:
    rng = random.Random(26)
    prompt = [100 + (i * 13) % 300 for i in range(70)]
    others = [[rng.randrange(100, 500) for _ in range(rng.randint(3, 120))]
              for _ in range(max(sizes))]
    engine = EngineCore(config)
    alone = run_all(engine, [prompt])[0]

    def compare(name: str, got) -> None:
        tokens, bits = got
        same_lp = sum(a == b for a, b in zip(bits, alone[1], strict=True))
        print(f"engine: {name}: tokens {'same' if tokens == alone[0] else 'DIFFER'}, "
              f"logprobs of {same_lp}/{len(bits)} steps bitwise the same", flush=True)

    for n in sizes:
        engine = EngineCore(config)
        outs = run_all(engine, others[:n // 2] + [prompt] + others[n // 2:n - 1])
        compare(f"inside a batch of {n}", outs[n // 2])
    for budget in (16, 48):
        engine = EngineCore(dataclasses.replace(config, max_num_batched_tokens=budget,
                                                max_batch_prefill_tokens=budget))
        compare(f"prefill budget {budget}", run_all(engine, [prompt])[0])
    engine = EngineCore(config)
    run_all(engine, [prompt[:48] + [7, 8, 9]])
    got = run_all(engine, [prompt])[0]
    compare(f"after a prefix hit ({CACHED['probe-0']} prompt tokens cached)", got)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="a .gguf (default: the tiny test model)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--batch-invariant", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_path = args.model
    if not model_path:
        from tests.fixtures.tiny_gguf import write_tiny_llama

        model_path = str(Path(tempfile.mkdtemp(prefix="llmq-binv-")) / "tiny.gguf")
        write_tiny_llama(model_path)
    fields = {"model": model_path, "dtype": args.dtype, "num_kv_blocks": 2048}
    if args.batch_invariant:
        fields["batch_invariant"] = True
    config = EngineConfig(**fields)
    print(f"model {model_path} ({args.dtype}), LLMQ_FORMS={os.environ.get('LLMQ_FORMS', '')!r}"
          f", batch_invariant {args.batch_invariant}", flush=True)
    sizes = (3, 17, 64)
    engine = EngineCore(config)
    probe_ops(engine.runner.model, sizes)
    if not args.skip_engine:
        probe_engine(config, sizes)


if __name__ == "__main__":
    main()
