"""Self-drafts: the target's own weights, made cheaper, run as the draft (`draft="self:int4"`, `"self:bf16"`).

No training and no second tokenizer: the drafter loads the target's folder and converts it at load time (nothing
is written to disk). The verifier stays float32, so outputs stay exactly the target's; only acceptance and the
draft's cost depend on the scheme.

  bf16  every weight cast to bfloat16; activations and the draft's KV cache in bfloat16.
  int4  every decoder Linear weight-only int4 (asymmetric, one scale and offset per group of GROUP input columns,
        torch's own packed kernels), activations bfloat16; the embedding table and LM head stay bfloat16
        (measured in docs/BENCHMARKS.md "Self-drafts": the head is 21% of SmolLM2-135M's weights, and an int4
        head costs acceptance for little time).

The int4 layer is runner/int4.py. torch's CPU int8
weight-only kernel is far slower than float32 on CPU (FINDINGS.md), hence no int8 scheme.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from ..config import SELF_PREFIX as PREFIX, SELF_SCHEMES as SCHEMES
from ..runner.int4 import GROUP, Int4Linear, packable


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
    from ..runner.model_runner import ModelRunner, load_causal_lm, return_freed_memory
    t0 = time.perf_counter()
    model = convert(load_causal_lm(target_path, device, "float32"), scheme, group, head, act)
    runner = ModelRunner(model, kv_cache_tokens, block_size)
    return_freed_memory()  # the float32 weights it was converted from
    runner.draft_info = {"scheme": PREFIX + scheme, "weight_bytes": weight_bytes(model),
                         "load_s": round(time.perf_counter() - t0, 3)}
    return runner
