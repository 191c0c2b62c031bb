"""Self-drafts: the target's own weights, made cheaper, run as the draft (`draft="self:int4"`, `"self:bf16"`).

No training and no second tokenizer: the drafter loads the target's folder and converts it at load time (nothing
is written to disk). The verifier stays float32, so outputs stay exactly the target's; only acceptance and the
draft's cost depend on the scheme.

  bf16  every weight cast to bfloat16; activations and the draft's KV cache in bfloat16.
  int4  every decoder Linear weight-only int4 (asymmetric, one scale and offset per group of GROUP input columns,
        torch's own packed kernels), activations bfloat16; the embedding table and LM head stay bfloat16
        (measured in docs/BENCHMARKS.md "Self-drafts": the head is 21% of SmolLM2-135M's weights, and an int4
        head costs acceptance for little time).

Kernels: on CPU `aten._convert_weight_to_int4pack_for_cpu` / `aten._weight_int4pack_mm_for_cpu`; on CUDA
`aten._convert_weight_to_int4pack` / `aten._weight_int4pack_mm` (bf16 activations). torch's CPU int8
weight-only kernel is far slower than float32 on CPU (FINDINGS.md), hence no int8 scheme.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ..config import SELF_PREFIX as PREFIX, SELF_SCHEMES as SCHEMES, self_scheme

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


def _decoder_linears(model):
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, mod in list(parent.named_children()):
                if isinstance(mod, nn.Linear):
                    yield parent, name, mod


def convert(model, scheme: str, group: int = GROUP, head: str = "float", act: str = "float32"):
    """Turn a loaded float32 causal LM into its self-draft, in place; returns it.
    int4 only: head = 'int4' | 'float' (the LM head quantized like the layers, or left in the activation dtype);
    act = 'float32' | 'bfloat16' (the residual stream, norms, attention and KV cache; the int4 matmuls always
    read bfloat16). Measured choices: module docstring."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown self-draft scheme {scheme!r} (valid: {SCHEMES})")
    if scheme == "bf16":
        act = "bfloat16"
    if scheme == "int4":
        for parent, name, lin in _decoder_linears(model):
            if packable(lin, group):  # one that cannot be packed stays float (correct, only slower)
                setattr(parent, name, Int4Linear(lin, group))  # the float weight is freed as each one goes
        if head == "int4" and packable(model.lm_head, group):
            model.lm_head = Int4Linear(model.lm_head, group)  # a tied embedding keeps its own float table
    if act == "bfloat16":
        rot = model.model.rotary_emb  # its inverse frequencies stay float32: a bf16 copy would shift positions
        keep = {n: b.clone() for n, b in rot.named_buffers(recurse=False)}
        model.to(torch.bfloat16)  # int4 buffers are not floating point, so keep their dtype
        for n, b in keep.items():
            setattr(rot, n, b)
    return model.eval()


def weight_bytes(model) -> int:
    """Bytes of every distinct parameter and buffer (tied weights once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def load_self_draft(target_path: str, scheme: str, kv_cache_tokens: int, block_size: int = 16, device="cpu",
                    group: int = GROUP, head: str = "float", act: str = "float32"):
    """The drafter's runner for a self-draft of the target at target_path: load it in float32, convert.
    Returns a ModelRunner with `.draft_info` = {scheme, weight_bytes, load_s}."""
    from .model_runner import ModelRunner, load_causal_lm
    t0 = time.perf_counter()
    model = convert(load_causal_lm(target_path, device, "float32"), scheme, group, head, act)
    runner = ModelRunner(model, kv_cache_tokens, block_size)
    runner.draft_info = {"scheme": PREFIX + scheme, "weight_bytes": weight_bytes(model),
                         "load_s": round(time.perf_counter() - t0, 3)}
    return runner


def load_draft(draft: str, target: str, kv_cache_tokens: int, block_size: int = 16, device="cpu",
               dtype="float32"):
    """The drafter's runner for the draft option: a model folder, or a self-draft built from the target's folder."""
    from .model_runner import ModelRunner
    scheme = self_scheme(draft)
    if scheme is not None:
        return load_self_draft(target, scheme, kv_cache_tokens, block_size, device)
    return ModelRunner.from_pretrained(draft, kv_cache_tokens, block_size, device, dtype)


def model_info(runner) -> dict:
    """What a worker's model takes: {"weight_bytes": n} (+ scheme and load_s for a self-draft)."""
    info = getattr(runner, "draft_info", None)
    if info is None:
        model = getattr(runner, "model", None)
        info = {"weight_bytes": weight_bytes(model)} if model is not None else {}
    return dict(info)
