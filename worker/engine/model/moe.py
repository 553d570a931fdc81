"""SparseMoe: a mixture-of-experts MLP with top-k routing (Qwen3-MoE, OLMoE, Mixtral).

References: transformers' `Qwen3MoeSparseMoeBlock` / `OlmoeSparseMoeBlock` /
`MixtralSparseMoeBlock` (softmax over the router's logits in float32, top-k, the top-k
weights renormalised when `norm_topk_prob`, experts' outputs weighted and summed with
`index_add_`), vLLM `fused_moe` (tokens grouped by expert, each expert's GEMM over its group
only) and llama.cpp's `build_moe_ffn`.

Each expert is an ordinary SwiGLU MLP whose projections are `Linear`s (linear.py), so with
`--weights native` a GGUF's quantized experts run on the quantized kernels over their token
group: a decode step reads only the experts its tokens picked (few active parameters, the CPU
case MoE is made for).
"""

from __future__ import annotations

import torch
from torch import nn

from .arch import ModelArchConfig
from .decoder_layer import LlamaMLP, Target
from .linear import Linear


class SparseMoe(nn.Module):
    gate: Linear

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k = arch.experts_per_tok
        self.norm_topk_prob = arch.norm_topk_prob
        self.gate = Linear(arch.num_experts, arch.hidden_size, False, dtype)  # the router
        self._experts = [LlamaMLP(arch, dtype, arch.moe_intermediate_size)
                         for _ in range(arch.num_experts)]
        self.experts = nn.ModuleList(self._experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden] -> [num_tokens, hidden]: each token through its top-k
        experts, weighted by the router."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [num_tokens, num_experts]
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [num_tokens, top_k] each
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        # NOTE: one pass per expert that some token picked, over exactly those tokens.
        for expert in chosen.unique().tolist():
            rows, slot = torch.nonzero(chosen == expert, as_tuple=True)  # [group] each
            y = self._experts[expert](x[rows])  # [group, hidden]
            out.index_add_(0, rows, y.to(x.dtype) * weights[rows, slot, None])
        return out

    def weight_targets(self, prefix: str) -> dict[str, Target]:
        """HF names under `prefix` (`model.layers.3.mlp.`) -> where each goes."""
        targets: dict[str, Target] = {prefix + "gate.weight": (self.gate.weight, None,
                                                               self.gate)}
        for e, expert in enumerate(self._experts):
            targets.update(expert.weight_targets(f"{prefix}experts.{e}."))
        return targets
