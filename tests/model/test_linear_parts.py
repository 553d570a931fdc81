"""The LM head in vocabulary slices (linear.py `split`, llama.py `logits_parts`): a head run a
slice at a time, with whole other calls between its slices, gives the logits of the unsplit
head bit for bit, in every form a head can take."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmq.worker.engine.model import form_choice, llama, repack_cache
from llmq.worker.engine.model.loader import load_model
from tests.fixtures.tiny_gguf import write_tiny_llama

pytestmark = pytest.mark.usefixtures("cpu_kernels")
ROWS = (1, 5, 8, 9, 40, 200)  # a decode, the quantized kernels' rows, every bucket above
HIDDEN = 64


@pytest.fixture
def tiny_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(repack_cache.ENV, str(tmp_path / "repacked"))
    monkeypatch.setenv(form_choice.DIR_ENV, str(tmp_path / "forms"))
    # NOTE: 600 rows: the slices are whole 16-row tiles but the last, which is 8 rows short
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, vocab=600, hidden=HIDDEN, intermediate=128, seed=3)
    return path


def whole_and_split(path: Path, weights: str, monkeypatch: pytest.MonkeyPatch):
    split = load_model(path, "float32", weights=weights).model
    with monkeypatch.context() as m:
        m.setattr(llama, "HEAD_PARTS", 1)
        whole = load_model(path, "float32", weights=weights).model
    assert len(split.lm_head.parts) == llama.HEAD_PARTS and len(whole.lm_head.parts) == 1
    return whole, split


@pytest.mark.parametrize(("weights", "form"), [
    ("native", "fixed"), ("native", "quant"), ("native", "int8"), ("native", "bf16"),
    ("native", "fp16"), ("native", "fp32"), ("fp32", "fixed"), ("bf16", "fixed")])
def test_a_head_run_a_slice_at_a_time_gives_the_whole_heads_logits(
        tiny_path, monkeypatch, weights, form):
    # Given the same model loaded with its head in 8 vocabulary slices and in one piece, in
    # one form for every bucket of rows (or the fixed choice: quantized up to 8 rows)
    monkeypatch.setenv(form_choice.ENV, form)
    whole, split = whole_and_split(tiny_path, weights, monkeypatch)
    hidden = torch.randn(max(ROWS), HIDDEN, generator=torch.Generator().manual_seed(0))
    for rows in ROWS:
        expected = whole.compute_logits(hidden[:rows])  # [rows, vocab]
        # When the split head runs a slice at a time, another whole call between two slices
        parts = split.logits_parts(hidden[:rows])
        slices = 0
        while True:
            try:
                next(parts)
            except StopIteration as done:
                logits = done.value
                break
            slices += 1
            split.compute_logits(hidden[rows:rows + 3] if rows < max(ROWS) else hidden[:2])
        # Then it paused after each slice (but in a form held whole, quantized or int8,
        # which runs in one call: a lone decode's head in 8 calls cost it ~10% of its speed)
        # and its logits are the whole head's, bit for bit
        assert slices == (llama.HEAD_PARTS if split.lm_head.sliced(rows) else 1), rows
        assert (not split.lm_head.sliced(rows)) == (
            weights == "native" and split.lm_head.form_of(rows) in ("quant", "int8"))
        assert logits.dtype == torch.float32 and torch.equal(logits, expected), (rows, form)
        assert torch.equal(split.compute_logits(hidden[:rows]), expected)
