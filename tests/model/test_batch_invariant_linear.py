"""A dense projection made batch-invariant (Linear.make_batch_invariant): each output row is
bitwise the same computed alone or inside a call of any number of rows.

At a real model's width (SmolLM2's 576 x 1536 MLP) oneDNN's and MKL's GEMMs sum a row in an
order that follows the call's rows (one row runs as a GEMV), so without the mode these differ
(bench/batch_invariance.py); the tiny test model is too narrow to show it.
"""

from __future__ import annotations

import pytest
import torch

from llmq.worker.engine.model.linear import Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_is_the_same_alone_and_inside_calls_of_any_size(dtype):
    # Given a dense 576 x 1536 projection made batch-invariant
    torch.manual_seed(0)
    linear = Linear(576, 1536, bias=False, dtype=dtype)
    linear.weight.data.copy_(torch.randn(576, 1536) * 0.03)
    linear.finalize(native=False, kernels=None)
    linear.make_batch_invariant()
    x = torch.randn(40, 1536)
    with torch.inference_mode():
        # When each row runs alone, and the rows run together in calls of 3, 17 and 40
        alone = torch.cat([linear(x[i:i + 1]) for i in range(40)])
        # Then every row of every call is bitwise the row computed alone
        for n in (3, 17, 40):
            assert torch.equal(linear(x[:n]), alone[:n])
