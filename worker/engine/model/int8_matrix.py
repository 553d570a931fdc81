"""Int8Matrix: a projection's weights as int8 per output channel, for steps of many rows.

Above a few rows a projection is compute-bound, and on CPUs without AMX the fastest GEMM torch
has is int8 (`torch._int_mm`, oneDNN's s8s8s32 GEMM on AVX-512 VNNI): ~4x float32 oneDNN's
multiply-adds a second. Prefill and batched decode of `--weights native` run on it.

Numerics (why two int8 terms for x): with one int8 term per token (W8A8) the outlier channels
of a Llama's activations (max/mean of a row 20-100x in SmolLM2) cost 2-5% of a projection's
output, and the greedy text changed on 4 of 6 test prompts. Splitting each row of x into
x ~= s1 * q1 + s2 * q2 (q2 quantizes what q1 leaves, |x - s1 q1| <= s1 / 2) gives ~15 bits a
value; both terms go through one `_int_mm` of 2M rows, still ~2x float32's speed. What is left
is the weights' int8 rounding: w ~= scale[n] * q[n, k], scale[n] = max|w[n]| / 127, a fraction
of the file's own 4-bit rounding (measured in tests/model/test_native_weights.py).
Each row's result depends only on that row: batch composition does not change a token's
numbers (unlike float GEMMs, whose blocking follows the batch's shape).

References: LLM.int8() and SmoothQuant (the outlier problem of per-token int8 activations),
vLLM's W8A8 `scaled_mm` (per-token activation and per-channel weight scales),
torch `_int_mm` (CPU: oneDNN `gemm_api` s8s8s32).
"""

from __future__ import annotations

import functools

import torch


class Int8Matrix:
    """w [out, in] as int8 q [out, in] and float32 scale [out] (w ~= scale[:, None] * q),
    plus the projection's bias, which the kernel adds."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        w = weight.detach().float()
        self.out_features, self.in_features = w.shape
        amax = w.abs().amax(dim=1)
        self.scale = (amax / 127).contiguous()
        inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
        self.q = torch.round(w * inv[:, None]).to(torch.int8).contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @classmethod
    def from_parts(cls, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
                   ) -> Int8Matrix:
        """An Int8Matrix of q [out, in] int8 and scale [out] float32 built before (the repack
        cache's arrays)."""
        self = cls.__new__(cls)
        self.out_features, self.in_features = q.shape
        self.q, self.scale = q, scale
        self.bias = None if bias is None else bias.detach().float().contiguous()
        return self

    @staticmethod
    @functools.cache
    def available() -> bool:
        """torch's int8 GEMM runs on this build (it is a private op: check, don't assume)."""
        try:
            a = torch.ones(2, 8, dtype=torch.int8)
            return bool((torch._int_mm(a, a.t()) == 8).all())
        except (AttributeError, RuntimeError, NotImplementedError):
            return False

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes
