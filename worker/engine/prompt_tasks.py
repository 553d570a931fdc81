"""PromptTasks: what the engine answers from a prompt alone, between two steps.

- `task: embed`: one forward pass over the prompt, its final-normed hidden states pooled as the
  model says (the last token's, their mean, or the first token's: model/pooling.py) and
  normalised to unit length, as vLLM's embed pooler does (`normalize=True`); cosine similarity
  is then a dot product.
- `task: tokenize`: the prompt's ids (the gate tokenized it, chat template and all) and each id's
  vocabulary string, as vLLM's /tokenize answers.
- `task: detokenize`: the text of the given ids, special tokens kept, as vLLM's /detokenize.
- `prompt_logprobs` of a generation request: the same forward pass, with logits at every prompt
  position; computed when the request is added, delivered on its finished output (choice 0).

NOTE: a pass of its own over a contiguous scratch cache (`LlamaForCausalLM.forward_contiguous`),
not the scheduler's prefill: a prefix-cache hit or a chunked prefill never holds every position's
hidden state at once (vLLM bypasses its prefix cache for these requests instead). It costs one
prefill more and holds the busy loop while it runs, so at most one embedding runs per step.
The paged KV cache and the scheduler never see these requests; the scratch cache is the K/V of
one prompt, outside `--kv-cache-memory-bytes` and freed at once (an 8k-token prompt of
SmolLM2-135M in float32: ~380 MB for the pass).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from llmq.protocol import Timings, TokenLogprob, Usage
from llmq.protocol.events import Tokens
from llmq.protocol.token_text import token_text
from llmq.worker.engine.model.pooling import CLS, LAST, MEAN, check_pooling
from llmq.worker.engine.outputs import EngineCoreOutput
from llmq.worker.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llmq.worker.engine.model.llama import LlamaForCausalLM

__all__ = ["PromptTasks"]

# NOTE: prompt positions per forward chunk: bounds the activations and, for prompt logprobs, the
# [chunk, vocab] float32 logits (512 x 49k = 100 MB at most).
_CHUNK = 512


@dataclass
class _Task:
    request_id: str
    prompt_token_ids: list[int]
    task: str
    arrival_time: float
    cancelled: bool = False


class PromptTasks:
    """`model()` gives the engine's current model (a level-2 sleep drops it); `tokenizer` is the
    engine's (worker/engine/model/tokenizer.py), None for an engine of token ids only; `pooling`
    the model's (`ModelArchConfig.pooling`: mean | last | cls)."""

    def __init__(self, model: Callable[[], LlamaForCausalLM], tokenizer: Any,
                 max_model_len: int, clock: Callable[[], float], pooling: str = LAST) -> None:
        self.model = model
        self.pooling = check_pooling(pooling, "pooling")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.clock = clock
        self._pending: collections.deque[_Task] = collections.deque()
        # request_id -> the logprobs of its prompt, until its choice 0 finishes
        self._prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            arrival_time: float) -> None:
        """Take a request with a task; the next `step` answers it."""
        self._pending.append(_Task(request_id, list(prompt_token_ids), params.task,
                                   arrival_time))

    def score_prompt(self, request_id: str, prompt_token_ids: list[int], num: int) -> None:
        """Compute a generation request's prompt logprobs now, for its finished output."""
        self._prompt_logprobs[request_id] = self.prompt_logprobs(prompt_token_ids, num)

    def abort(self, request_ids: Iterable[str]) -> None:
        ids = set(request_ids)
        for task in self._pending:
            task.cancelled |= task.request_id in ids

    def step(self) -> list[EngineCoreOutput]:
        """Answer what is pending: every tokenize and detokenize, and one embedding at most."""
        outputs: list[EngineCoreOutput] = []
        embedded = False
        while self._pending:
            task = self._pending[0]
            if task.task == "embed" and not task.cancelled:
                if embedded:
                    break
                embedded = True
            outputs.append(self._answer(self._pending.popleft()))
        return outputs

    def attach(self, outputs: list[EngineCoreOutput]) -> None:
        """Put each request's prompt logprobs on its finished choice 0 (the `done` event's)."""
        if not self._prompt_logprobs:
            return
        for output in outputs:
            if output.finished and output.index == 0:
                output.prompt_logprobs = self._prompt_logprobs.pop(output.request_id, None)

    def _answer(self, task: _Task) -> EngineCoreOutput:
        started = self.clock()
        output = EngineCoreOutput(task.request_id, [], "", finish_reason="stop", text="")
        if task.cancelled:
            output.finish_reason = "cancelled"
        elif task.task == "embed":
            output.embedding = self.embed(task.prompt_token_ids)
        elif task.task == "tokenize":
            output.tokens = Tokens(task.prompt_token_ids, [
                self.tokenizer.id_to_token(t) or "" for t in task.prompt_token_ids],
                self.max_model_len)
        else:  # detokenize
            output.text = self.tokenizer.decode(task.prompt_token_ids, skip_special_tokens=False)
        ended = self.clock()
        output.usage = Usage(len(task.prompt_token_ids), 0)
        output.timings = Timings(queue=max(0.0, started - task.arrival_time), ttft=None,
                                 e2e=max(0.0, ended - task.arrival_time), per_token=None)
        return output

    @torch.inference_mode()
    def embed(self, prompt_token_ids: list[int]) -> list[float]:
        """The prompt's final hidden states, pooled, at unit length."""
        pooled: torch.Tensor | None = None  # [hidden_size]
        for _, hidden in self._hidden_states(prompt_token_ids):
            if self.pooling == MEAN:
                part = hidden.float().sum(dim=0)
                pooled = part if pooled is None else pooled + part
            elif self.pooling == CLS:
                pooled = hidden[0].float()
                break  # under the causal mask the first position sees nothing after it
            elif self.pooling == LAST:
                pooled = hidden[-1].float()  # the last chunk's last row wins
        assert pooled is not None  # the gate refuses an empty prompt
        if self.pooling == MEAN:
            pooled = pooled / len(prompt_token_ids)
        return torch.nn.functional.normalize(pooled, dim=0).tolist()

    @torch.inference_mode()
    def prompt_logprobs(self, prompt_token_ids: list[int], num: int) -> list[TokenLogprob | None]:
        """Per prompt token, its logprob given the tokens before it, its rank, and the `num` most
        likely tokens there; None for the first token (vLLM's shape)."""
        found: list[TokenLogprob | None] = [None]
        ids = prompt_token_ids
        for start, hidden in self._hidden_states(ids):
            stop = min(start + hidden.shape[0], len(ids) - 1)  # the last token predicts nothing
            if stop <= start:
                break
            logprobs = self.model().compute_logits(  # [rows, vocab]
                hidden[:stop - start]).log_softmax(dim=-1)
            targets = torch.tensor(ids[start + 1:stop + 1]).unsqueeze(1)  # [rows, 1]
            chosen = logprobs.gather(1, targets)  # [rows, 1]
            ranks = (logprobs > chosen).sum(dim=-1) + 1  # [rows]
            top_values, top_ids = logprobs.topk(num, dim=-1)  # [rows, num] each
            rows = zip(targets.squeeze(1).tolist(), chosen.squeeze(1).tolist(), ranks.tolist(),
                       top_ids.tolist(), top_values.tolist(), strict=True)
            found += [TokenLogprob(token_id=t, logprob=_finite(v), rank=r, top_token_ids=ti,
                                   top_logprobs=[_finite(x) for x in tv])
                      for t, v, r, ti, tv in rows]
        if self.tokenizer is not None:
            vocabulary = self.tokenizer.token_bytes
            for lp in found:
                if lp is not None:
                    lp.token = token_text(vocabulary[lp.token_id])
                    lp.top_tokens = [token_text(vocabulary[t]) for t in lp.top_token_ids]
        return found

    def _hidden_states(self, prompt_token_ids: list[int]) -> Iterable[tuple[int, torch.Tensor]]:
        """(first position, final-normed hidden states [chunk, hidden_size]) chunk by chunk."""
        model = self.model()
        cache = model.make_contiguous_cache(len(prompt_token_ids))
        for start in range(0, len(prompt_token_ids), _CHUNK):
            chunk = torch.tensor(prompt_token_ids[start:start + _CHUNK], dtype=torch.long)
            yield start, model.forward_contiguous(chunk, start, cache)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no -inf: None on the wire
