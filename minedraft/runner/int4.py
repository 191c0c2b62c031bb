"""Weight-only int4 linear layer (torch's packed int4 kernels), used by the int4 self-draft (drafting/self_draft.py).

Kernels: on CPU `aten._convert_weight_to_int4pack_for_cpu` / `aten._weight_int4pack_mm_for_cpu`; on CUDA
`aten._convert_weight_to_int4pack` / `aten._weight_int4pack_mm` (bf16 activations).
"""

from __future__ import annotations

import torch
from torch import nn

GROUP = 32  # input columns per scale/offset; 32 measured best for acceptance at equal speed (BENCHMARKS.md)


class Int4Linear(nn.Module):
    """y = x W^T (+ b) with W stored as 4-bit codes q in groups of `group` input columns: W = (q - 8) * s + z.
    Inputs of any float dtype are computed in bfloat16; the output is bfloat16."""

    def __init__(self, linear: nn.Linear, group: int = GROUP):
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape
        if k % group or k % 64 or n % 8:
            raise ValueError(f"int4 needs in_features % {max(group, 64)} == 0 and out_features % 8 == 0, got {n}x{k}")
        self.in_features, self.out_features, self.group = k, n, group
        g = w.view(n, k // group, group)
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        q = ((g - lo) / scale).round().clamp(0, 15).to(torch.int32).view(n, k)
        zero = lo + 8 * scale  # the kernel computes (q - 8) * scale + zero
        sz = torch.cat([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [k/group, n, 2]
        dev = linear.weight.device
        if dev.type == "cuda":
            packed_q = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
            tiles = next(t for t in (8, 4, 2) if k % (32 * t) == 0)  # the CUDA layout's inner K tiles
            packed = torch.ops.aten._convert_weight_to_int4pack(packed_q.to(dev), tiles)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.register_buffer("packed", packed.to(dev))
        self.register_buffer("scales_zeros", sz.to(dev))
        b = linear.bias
        self.register_buffer("bias", None if b is None else b.detach().to(device=dev, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if x2.is_cuda:
            y = torch.ops.aten._weight_int4pack_mm(x2, self.packed, self.group, self.scales_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features).to(x.dtype)


def packable(lin: nn.Linear, group: int = GROUP) -> bool:
    k, n = lin.in_features, lin.out_features
    return k % group == 0 and k % 64 == 0 and n % 8 == 0
