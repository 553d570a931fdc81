"""Session fixtures for tests that read the real default model (SmolLM2-135M-Instruct GGUF).

Opening a GGUFReader on it takes ~3 s (Python objects for 49k token strings), and transformers'
GGUF tokenizer ~6 s, so each is built once per test session and shared.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_gguf_reader(default_model_path: Path):
    """The default model's GGUF metadata (`default_model_path` comes from tests/fixtures)."""
    import gguf

    return gguf.GGUFReader(default_model_path)


@pytest.fixture(scope="session")
def smollm_tokenizer(default_gguf_reader):
    """llmq's tokenizer built from the default model's GGUF metadata."""
    from llmq.worker.engine.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(default_gguf_reader)


@pytest.fixture(scope="session")
def hf_smollm_tokenizer(default_model_path: Path):
    """transformers' tokenizer for the same GGUF: the oracle (it lacks llama.cpp's digit split)."""
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return transformers.AutoTokenizer.from_pretrained(
        default_model_path.parent, gguf_file=default_model_path.name)


# --- tiny tokenizer-only GGUF files, written with gguf.GGUFWriter in milliseconds --------------


def _write_tokenizer_gguf(path: Path, model: str, tokens: list[str], types: list[int],
                          pre: str | None = None, merges: list[str] | None = None,
                          scores: list[float] | None = None, **keys) -> Path:
    """A GGUF holding only tokenizer metadata; `keys` name GGUFWriter `add_*` calls."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges is not None:
        writer.add_token_merges(merges)
    if scores is not None:
        writer.add_token_scores(scores)
    for key, value in keys.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# A SentencePiece-style vocabulary: <unk> <s> </s>, the 256 byte tokens, then pieces by score.
# "▁h" scores below "he", so "▁hello" is reached through "he" + "llo", never "▁h" + ...
SPM_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "ll", "he", "llo", "hello", "▁hello", "▁h",
              "or", "ld", "wor", "▁wor", "▁world"]


def _write_spm_gguf(path: Path, add_bos: bool | None = None) -> Path:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SPM_PIECES]
    types = [2, 3, 3, *[6] * 256, *[1] * len(SPM_PIECES)]
    scores = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))]
    extra = {} if add_bos is None else {"add_bos_token": add_bos}
    return _write_tokenizer_gguf(path, "llama", tokens, types, scores=scores,
                                 bos_token_id=1, eos_token_id=2, unk_token_id=0, **extra)


@pytest.fixture(scope="session")
def write_tokenizer_gguf():
    return _write_tokenizer_gguf


@pytest.fixture(scope="session")
def write_spm_gguf():
    return _write_spm_gguf


@pytest.fixture(scope="session")
def spm_tokenizer(tmp_path_factory):
    """A tiny llama-style (SentencePiece BPE with byte fallback) tokenizer from a GGUF file."""
    import gguf

    from llmq.worker.engine.model.tokenizer import Tokenizer

    path = _write_spm_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf")
    return Tokenizer.from_gguf(gguf.GGUFReader(str(path)))


@pytest.fixture(autouse=True, scope="session")
def _repack_cache_in_a_temp_dir(tmp_path_factory):
    """Native loads write the repack cache (repack_cache.py) and the kernel form choice
    (form_choice.py): keep the tests' entries (one per temporary model file) out of the
    user's ~/.cache."""
    names = ("LLMQ_REPACK_DIR", "LLMQ_FORMS_DIR")
    old = {name: os.environ.get(name) for name in names}
    for name in names:
        os.environ[name] = str(tmp_path_factory.mktemp(name.lower()))
    yield
    for name, value in old.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
