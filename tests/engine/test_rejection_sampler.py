"""The verification rule on a known distribution: a deterministic draft x is accepted with
probability p(x), and a rejection yields p with x removed, renormalised (the speculative
sampling rule for a point-mass draft), checked over 40000 draws."""

from __future__ import annotations

import math

import torch

from llmq.worker.engine.sampler import Sampler, SamplingMetadata
from llmq.worker.engine.sampling_params import SamplingParams
from llmq.worker.engine.spec_decode.rejection_sampler import verify


def test_a_draft_token_is_accepted_with_its_probability_and_rejections_follow_the_rest():
    # Given a target distribution over 6 tokens (after temperature 0.7), and the draft [2]
    probs = torch.tensor([0.05, 0.15, 0.30, 0.25, 0.20, 0.05])
    temperature = 0.7
    logits = (probs.log() * temperature).repeat(40_000, 2).view(40_000, 2, 6)  # rows x 2 pos.
    logits = logits.reshape(80_000, 6)
    target = torch.softmax(probs.log(), dim=-1)
    draft = [2]
    params = SamplingParams(temperature=temperature, max_tokens=4)
    metadata = SamplingMetadata.build([params] * 80_000, [[0]] * 80_000,
                                      [[], [2]] * 40_000, vocab_size=6)
    out = Sampler(seed=1234)(logits, metadata)
    # When each pair of rows (the draft position, then the bonus position) is verified
    accepted = 0
    rejected = [0] * 6
    for row in range(0, 80_000, 2):
        kept = verify(out, row, draft)
        assert kept.error is None
        if kept.token_ids[0] == draft[0]:
            accepted += 1
            assert len(kept.token_ids) == 2  # the bonus token follows a whole accepted draft
        else:
            rejected[kept.token_ids[0]] += 1
            assert len(kept.token_ids) == 1
    # Then acceptance happens with probability p(x) (within 5 standard deviations)
    n, p_x = 40_000, float(target[2])
    assert abs(accepted / n - p_x) < 5 * math.sqrt(p_x * (1 - p_x) / n)
    # And rejections follow p without x, renormalised (total variation under 0.02)
    num_rejected = sum(rejected)
    residual = target.clone()
    residual[2] = 0
    residual /= residual.sum()
    tv = 0.5 * sum(abs(rejected[t] / num_rejected - float(residual[t])) for t in range(6))
    assert rejected[2] == 0 and tv < 0.02
