"""Loading a checkpoint's tensors into LlamaForCausalLM (llama.py `load_weights`).

Tensors arrive one at a time, in Hugging Face names and layout (`model.layers.0.self_attn.
q_proj.weight`, ...), from a GGUF (gguf_loader.py: `QuantizedTensor`s, dequantized only where
a dense form still needs them) or a safetensors folder (hf_loader.py). Each is copied into its
fused parameter (decoder_layer.py `weight_targets`: Q, K and V into one QKV, gate and up into
one), or, with `weights="native"`, kept as blocks for the projection's quantized forms
(linear.py). Then every projection builds the forms chosen for it (form_choice.py), from the
repack cache where it has them, and the model decides whether the one-call decode kernel can
run its steps.

References: vLLM `models/llama.py` (`load_weights` from an iterator of named tensors, stacked
parameters).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from .block_quant import BLOCK_QUANT_TYPES, BlockQuant, QuantizedEmbedding
from .decoder_layer import LlamaDecoderLayer, Target
from .form_choice import FormChoice
from .gguf_loader import QuantizedTensor
from .linear import Linear
from .moe import SparseMoe
from .repack_cache import RepackCache

if TYPE_CHECKING:
    from .llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, layers: list[LlamaDecoderLayer],
                 weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]],
                 repack: RepackCache | None = None, forms: FormChoice | None = None) -> None:
    """Copy named tensors into `model`'s fused parameters (`layers`: its decoder layers, in
    order), converting dtype on the way.

    Takes an iterator so a loader can dequantize one tensor at a time. A `QuantizedTensor`
    is dequantized into the dense weight, or with `weights="native"` kept for the
    projection's quantized forms. Call it once: afterwards the projections build their
    forms one at a time (linear.py; from `repack`, the repack cache, where it has them) and
    dequantize only what a dense form still needs. `forms`: the kernels' form choice of
    this model on this CPU (form_choice.py; None: the forms by assumption).
    """
    arch = model.arch
    tied_head = model.lm_head if arch.tie_word_embeddings else None
    targets: dict[str, Target] = {
        "model.embed_tokens.weight": (model.embed_tokens, None, tied_head),
        "model.norm.weight": (model.norm, None, None),
    }
    if not arch.tie_word_embeddings:
        targets["lm_head.weight"] = (model.lm_head.weight, None, model.lm_head)
    for i, layer in enumerate(layers):
        targets.update(layer.weight_targets(f"model.layers.{i}."))

    native = model.weights == "native"
    for name, tensor in weights:
        if name not in targets:
            if name == "lm_head.weight" and arch.tie_word_embeddings:
                continue  # some tied checkpoints still store the head: the embedding wins
            raise ValueError(f"unexpected weight {name!r} for {arch.architecture}")
        param, rows, linear = targets.pop(name)
        dest = param if rows is None else param[rows]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dest.shape)}")
        if isinstance(tensor, QuantizedTensor):
            if (native and param is model.embed_tokens
                    and tensor.qtype in BLOCK_QUANT_TYPES):
                model.embed_quant = _quantized_embedding(tensor, repack)
            if native and linear is not None:
                linear.add_quantized(rows, tensor)  # dequantized there if still needed
                continue
            if model.embed_quant is not None and param is model.embed_tokens:
                continue  # looked up from its blocks: the dense table is never read
            tensor = tensor.dequantize()
        dest.copy_(tensor)
    if targets:
        missing = sorted(targets)
        raise ValueError(f"missing {len(missing)} weights, e.g. {missing[:3]}")
    # NOTE: the dense table stays only where lookups still need it; the tied head then
    # keeps just its packed copy.
    keep_embedding = model.embed_quant is None
    if arch.tie_word_embeddings:
        model.lm_head.dense_from = model.embed_quant
    experts = {id(m) for moe in model.modules() if isinstance(moe, SparseMoe)
               for m in moe.experts.modules()}
    if native and model.kernels is not None:
        model.forms = forms or FormChoice("fixed", None, {}, model.kernels)
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            module.finalize(native, model.kernels,
                            keep_dense=keep_embedding and module.weight is model.embed_tokens,
                            quant_only=id(module) in experts, cache=repack, name=name,
                            forms=model.forms, head=module is model.lm_head)
    if repack is not None:
        repack.commit()
    if model.forms is not None:
        model.forms.save()
    if arch.tie_word_embeddings and model.embed_quant is not None:
        # NOTE: the head's qdot tiles are the same weights, and every decode step keeps
        # them resident: looked up there, the embedding's own blocks (mapped, 1.5 bytes a
        # weight: 144 MiB for the 1B model's vocabulary) are never read into the RSS
        model.embed_tiles = model.lm_head.dot_tiles
    if not keep_embedding:
        model.embed_tokens = nn.Parameter(model.embed_tokens.new_empty(0), requires_grad=False)
    logger.info("weights %s: %.0f MiB in the projections", model.weights,
                sum(m.nbytes for m in model.modules() if isinstance(m, Linear)) / 2**20)


def _quantized_embedding(tensor: QuantizedTensor, repack: RepackCache | None
                         ) -> QuantizedEmbedding:
    found = repack.get("embed_tokens") if repack is not None else None
    if found is not None:
        meta, arrays = found
        return QuantizedEmbedding(BlockQuant(arrays["q"], arrays["scales"],
                                             arrays["offsets"], meta["group"], meta["bits"]))
    bq = BlockQuant.from_gguf(tensor.qtype, tensor.data, tensor.shape)
    if repack is not None:
        meta = {"group": bq.group, "bits": bq.bits}
        arrays = repack.put("embed_tokens", meta,
                            {"q": bq.q, "scales": bq.scales, "offsets": bq.offsets})
        bq = BlockQuant(arrays["q"], arrays["scales"], arrays["offsets"], bq.group, bq.bits)
    return QuantizedEmbedding(bq)
