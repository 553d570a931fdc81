"""LoraAdapter: one LoRA adapter's low-rank products, laid out for the model's fused projections.

References: PEFT `tuners/lora/layer.py` (y = x W^T + (x A^T) B^T * scaling, with scaling =
lora_alpha / r, or lora_alpha / sqrt(r) under rsLoRA), vLLM `lora/models.py` (adapters packed
to the base's fused QKV and gate/up projections), Punica / S-LoRA (one base GEMM for the whole
batch, a low-rank product per row's adapter).

The model fuses Q, K and V (and gate and up) into one matrix each (decoder_layer.py), so an
adapter's parts are fused the same way (`LoraProjection`): the A matrices of the parts side by
side, [in, sum of ranks], so one x A covers every part an adapter targets in that projection,
then each part's own B [rank, out_part] adds into its columns of the fused output (a
block-diagonal B would hold, and multiply, as many zeros as weights for Q/K/V). The scaling is
folded into B, and B's Q and K columns are permuted into the interleaved-RoPE order the model
keeps its Q and K rows in (gguf_loader.py `to_interleaved`).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from functools import cached_property

import torch

from llmq.worker.engine.lora.lora_error import LoraError
from llmq.worker.engine.model.arch import ModelArchConfig
from llmq.worker.engine.model.cpu_kernels import LoraProj
from llmq.worker.engine.model.gguf_loader import to_interleaved

# The projections an adapter may target, by their Hugging Face module name -> the model's
# fused projection they belong to (`LoraKey` below names it per layer).
PROJECTIONS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
               "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down"}
ATTENTION = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})


# The fused projections of a layer, in the order of their index in an adapter's kernel table.
FUSED = ("qkv", "o", "gate_up", "down")
# NOTE: the kernel (model/kernels/lora_rows.cpp) reads x A in 16-lane columns: A's columns are
# padded with zeros to a multiple of this, which adds nothing to x A B.
RANK_ALIGN = 16


def lora_key(layer: int, projection: str) -> str:
    """The name a fused projection's LoRA goes by: `3.qkv`, `3.o`, `3.gate_up`, `3.down`."""
    return f"{layer}.{projection}"


def projection_index(key: str) -> int:
    """A `lora_key`'s row in an adapter's kernel table: layer * 4 + its place in FUSED."""
    layer, projection = key.split(".", 1)
    return int(layer) * len(FUSED) + FUSED.index(projection)


@dataclass
class LoraProjection:
    """One adapter's low-rank pair for one fused projection, in float32."""

    a: torch.Tensor  # [in, padded rank]: the parts' A side by side, then zero columns
    # (first column of x A it reads, first output column it adds to, B [rank, cols] scaled)
    blocks: list[tuple[int, int, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, *(b for *_, b in self.blocks)))


@dataclass
class LoraPart:
    """One targeted module of one layer, as the checkpoint holds it."""

    layer: int
    module: str  # q_proj .. down_proj
    lora_a: torch.Tensor  # [rank, in_features]
    lora_b: torch.Tensor  # [out_features, rank]
    scaling: float


@dataclass(eq=False)
class LoraAdapter:
    """The fused low-rank pairs of one adapter, by `lora_key`. Compared by identity: two loads
    are two adapters. The weights are fixed once it serves a step (`kernel_table` points at
    them)."""

    name: str
    rank: int  # the largest rank of any part
    cache_salt: int  # 128 bits of its files' hash: the root of its requests' block hashes
    weights: dict[str, LoraProjection] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"LoraAdapter({self.name!r}, rank={self.rank}, {len(self.weights)} projections)"

    @property
    def nbytes(self) -> int:
        return sum(projection.nbytes for projection in self.weights.values())

    @cached_property
    def kernel_table(self) -> ctypes.Array[LoraProj]:
        """The weights as the LoRA kernel reads them: one LoraProj per `projection_index`
        (null A where the adapter targets nothing). Built on first use, then kept: it holds
        raw pointers into `weights`, which this adapter keeps alive."""
        size = max((projection_index(key) + 1 for key in self.weights), default=0)
        table = (LoraProj * size)()
        for key, projection in self.weights.items():
            entry = table[projection_index(key)]
            if len(projection.blocks) > len(entry.blocks):  # Q, K and V at most
                raise ValueError(f"{key}: {len(projection.blocks)} blocks, the kernel takes "
                                 f"{len(entry.blocks)}")
            entry.a = projection.a.data_ptr()
            entry.in_features, entry.rank_padded = projection.a.shape
            entry.num_blocks = len(projection.blocks)
            for block, (rank_offset, col_start, b) in zip(entry.blocks, projection.blocks,
                                                          strict=False):
                block.b, block.rank_offset, block.col_start = b.data_ptr(), rank_offset, col_start
                block.rank, block.cols = b.shape
        return table


def scaling(alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def fuse_parts(name: str, parts: list[LoraPart], arch: ModelArchConfig, max_rank: int,
               cache_salt: int, half_split: bool = True) -> LoraAdapter:
    """Check every part against the base model's shapes and fuse them per projection;
    LoraError naming the first part that does not fit. `half_split`: the Q/K B rows are in
    Hugging Face's order (PEFT's files), not yet in the interleaved one (llama GGUFs)."""
    if not parts:
        raise LoraError(f"adapter {name!r} has no LoRA weights")
    q, kv, ffn = arch.q_size, arch.kv_size, arch.intermediate_size
    out_rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv),
                "o_proj": (0, arch.hidden_size), "gate_proj": (0, ffn), "up_proj": (ffn, 2 * ffn),
                "down_proj": (0, arch.hidden_size)}
    in_features = {"qkv": arch.hidden_size, "o": q, "gate_up": arch.hidden_size, "down": ffn}
    moe_layers = set() if not arch.num_experts else (
        set(range(arch.num_layers)) - set(arch.dense_layers))
    grouped: dict[str, list[LoraPart]] = {}
    for part in sorted(parts, key=lambda p: (p.layer, list(PROJECTIONS).index(p.module))):
        where = f"adapter {name!r}: layer {part.layer} {part.module}"
        if part.module not in PROJECTIONS:
            raise LoraError(f"{where}: llmq applies LoRA to {', '.join(PROJECTIONS)} only")
        if not 0 <= part.layer < arch.num_layers:
            raise LoraError(f"{where}: the base model has {arch.num_layers} layers (an "
                            "adapter for another base model?)")
        if part.layer in moe_layers and part.module not in ATTENTION:
            raise LoraError(f"{where}: LoRA on mixture-of-experts MLPs is not supported")
        projection = PROJECTIONS[part.module]
        start, stop = out_rows[part.module]
        rank = part.lora_a.shape[0]
        expected_a = (rank, in_features[projection])
        expected_b = (stop - start, rank)
        if part.lora_a.dim() != 2 or tuple(part.lora_a.shape) != expected_a \
                or tuple(part.lora_b.shape) != expected_b:
            raise LoraError(
                f"{where}: lora_A {tuple(part.lora_a.shape)} and lora_B "
                f"{tuple(part.lora_b.shape)} do not fit the base model, which needs "
                f"{expected_a} and {expected_b} (an adapter for another base model?)")
        if rank > max_rank:
            raise LoraError(f"{where}: rank {rank} is above the maximum, max_lora_rank "
                            f"{max_rank}")
        if not (torch.isfinite(part.lora_a).all() and torch.isfinite(part.lora_b).all()):
            raise LoraError(f"{where}: the weights hold NaN or infinite values")
        grouped.setdefault(lora_key(part.layer, projection), []).append(part)

    adapter = LoraAdapter(name, max(p.lora_a.shape[0] for p in parts), cache_salt)
    for key, group in grouped.items():
        projection = key.split(".", 1)[1]
        total = sum(p.lora_a.shape[0] for p in group)
        padded = -(-total // RANK_ALIGN) * RANK_ALIGN
        a = torch.zeros(in_features[projection], padded)  # [in, padded sum of ranks]
        blocks = []
        offset = 0
        for p in group:
            rank = p.lora_a.shape[0]
            a[:, offset:offset + rank] = p.lora_a.float().T
            # HF names, so the Q/K permutation of the base's own rows applies (hf_loader.py)
            block = "self_attn" if p.module in ATTENTION else "mlp"
            rows = p.lora_b.float()  # [out_part, rank]
            if half_split:
                rows = to_interleaved(f"model.layers.{p.layer}.{block}.{p.module}.weight",
                                      rows, arch)
            # [rank, out_part]
            blocks.append((offset, out_rows[p.module][0], (rows.T * p.scaling).contiguous()))
            offset += rank
        adapter.weights[key] = LoraProjection(a, blocks)
    return adapter
