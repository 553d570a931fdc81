"""`forward_layers(..., out_rows=...)`: a step's last layer runs its output projection and MLP
for the rows the caller reads (a prefill's sampled rows) alone, and they come out the same bits
as when every row runs it; every row's K/V is still written, so the next step attends to the
whole prompt. (Under adapters, the kept rows keep theirs: tests/model/test_lora.py's mixed
batches against each request alone, and tests/model/test_lora_batch.py.)

On the tiny model loaded batch-invariant (a row's arithmetic does not depend on how many rows
share its call; otherwise a smaller call may take another form and round differently), with
native weights (the quantized kernels) and float32 dense ones, both on the fused kernels; and on
the op-by-op path, close rather than the same bits.
"""

from __future__ import annotations

import pytest
import torch

from llmq.worker.engine.model.attention import AttentionMetadata
from llmq.worker.engine.model.llama import run_to_end
from tests.fixtures.models import interleaved_block_tables, one_torch_thread

PROMPTS = [[100 + (i * 7 + j * 13) % 300 for i in range(n)] for j, n in enumerate((5, 17, 40))]
BLOCK = 16


@pytest.fixture(scope="module", params=["float32:native", "float32:fp32"])
def model(tiny_model_path, request):
    from llmq.worker.engine.model.loader import load_model

    one_torch_thread()
    dtype, weights = request.param.split(":")
    return load_model(tiny_model_path, dtype, weights, batch_invariant=True).model


def prefill(model, out_rows: list[int] | None) -> tuple[torch.Tensor, list[torch.Tensor], list]:
    """One step prefilling PROMPTS on fresh caches: (hidden states, the caches, the rows each
    layer's MLP ran)."""
    tables, num_blocks = interleaved_block_tables([len(p) for p in PROMPTS], BLOCK)
    caches = model.make_kv_caches(num_blocks, BLOCK)
    meta = AttentionMetadata.build([len(p) for p in PROMPTS], [len(p) for p in PROMPTS],
                                   tables, BLOCK)
    mlp_rows: list[int] = []
    hooks = [layer.mlp.down_proj.register_forward_hook(
        lambda _m, args, _out: mlp_rows.append(args[0].shape[0])) for layer in model.layers]
    try:
        ids = torch.tensor([t for p in PROMPTS for t in p])
        hidden = run_to_end(model.forward_layers(ids, meta, caches, out_rows=out_rows))
    finally:
        for hook in hooks:
            hook.remove()
    return hidden, caches, mlp_rows


def test_the_last_layer_runs_only_the_rows_that_are_read(model):
    last_rows = torch.tensor([len(p) for p in PROMPTS]).cumsum(0) - 1  # each prompt's last

    every, every_cache, every_mlp = prefill(model, None)
    read, read_cache, read_mlp = prefill(model, last_rows.tolist())

    # The earlier layers run all 62 rows; the last one's MLP the 3 that sample
    assert every_mlp == [62] * len(model.layers)
    assert read_mlp == [62] * (len(model.layers) - 1) + [3]
    # and those 3 come out the same bits, in the order asked
    assert read.shape == (3, every.shape[1])
    assert torch.equal(read, every[last_rows])
    # and every layer's K/V is written for every row
    assert all(torch.equal(a, b) for a, b in zip(read_cache, every_cache, strict=True))


def test_a_step_that_samples_no_row_still_writes_every_row_s_kv(model):
    every, every_cache, _ = prefill(model, None)
    read, read_cache, read_mlp = prefill(model, [])

    assert read.shape == (0, every.shape[1])
    assert read_mlp == [62] * (len(model.layers) - 1)  # the last layer's MLP never ran
    assert all(torch.equal(a, b) for a, b in zip(read_cache, every_cache, strict=True))


def test_the_op_by_op_path_runs_only_the_rows_that_are_read_too(tiny_model_path):
    """The path of the families off the fused kernels (Gemma's, mixture-of-experts; forced
    here on the tiny Llama), not batch-invariant: close, not the same bits."""
    from llmq.worker.engine.model.loader import load_model

    one_torch_thread()
    model = load_model(tiny_model_path, "float32", "fp32").model
    model._fused_able = False
    last_rows = torch.tensor([len(p) for p in PROMPTS]).cumsum(0) - 1

    every, every_cache, _ = prefill(model, None)
    read, read_cache, read_mlp = prefill(model, last_rows.tolist())

    assert read_mlp == [62] * (len(model.layers) - 1) + [3]
    torch.testing.assert_close(read, every[last_rows], rtol=1e-4, atol=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(read_cache, every_cache, strict=True))
