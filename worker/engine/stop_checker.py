"""Stop conditions checked after each sampled token: stop tokens and stop strings.

After vLLM v1's `v1/core/sched/utils.py` (`check_stop`) and `v1/engine/detokenizer.py`
(`check_stop_strings`). The scheduler calls these in order, for each new token:
EOS / stop token ids, then stop strings in the text, then the length limits (which it owns,
since `max_model_len` is an engine setting).
"""

from __future__ import annotations

from collections.abc import Sequence

from llmq.worker.engine.request import Request
from llmq.worker.engine.sampling_params import SamplingParams


def check_stop_token(request: Request, token_id: int) -> bool:
    """Whether the just-appended `token_id` ends the request; sets `request.stop_reason`.

    EOS counts unless `ignore_eos`; `stop_token_ids` always count. Neither counts before
    `min_tokens` output tokens (this token included) exist.
    """
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        return False
    if token_id in params.stop_token_ids:
        request.stop_reason = token_id
        return True
    # NOTE: stop_reason stays None for EOS, as in vLLM and the OpenAI API ("stop", no match).
    return not params.ignore_eos and token_id in request.eos_token_ids


def find_stop_string(text: str, num_new_chars: int, stop: Sequence[str],
                     include_stop_str_in_output: bool) -> tuple[str, int] | None:
    """The earliest stop string completed by the last `num_new_chars` characters of `text`.

    Returns (the stop string, the length `text` is cut to) or None. Matches may start in
    earlier text, so a stop string split across tokens is found; matches that end before the
    new characters were already looked for on earlier calls.
    """
    best: tuple[str, int] | None = None
    best_start = len(text)
    for stop_str in stop:
        start = text.find(stop_str, max(len(text) - num_new_chars - len(stop_str) + 1, 0))
        if 0 <= start < best_start:
            best_start = start
            end = start + len(stop_str) if include_stop_str_in_output else start
            best = (stop_str, end)
    return best


def num_held_back_chars(params: SamplingParams) -> int:
    """Characters of a running request's text not yet sent out, since a stop string that
    starts there may still complete and be cut. With them held back, text once sent is final,
    so the concatenated deltas equal the final text."""
    return max(map(len, params.stop), default=1) - 1
