"""Megatron-style tensor parallelism for the Llama family: sharded layers and a loader that reads only one
rank's slices of the checkpoint.

Sharding of one decoder layer over N ranks (rank r):
  * q_proj, k_proj, v_proj, gate_proj, up_proj: column-parallel (rank r keeps a block of output rows, and of
    the bias when there is one). No communication.
  * o_proj, down_proj: row-parallel (rank r keeps the matching block of input columns); each is followed by
    one all_reduce(SUM) of its partial output, then the bias (if any) is added once.
  * attention heads: rank r owns query heads [r*H/N, (r+1)*H/N). With H_kv >= N KV heads it owns KV heads
    [r*H_kv/N, (r+1)*H_kv/N); with H_kv < N (N a multiple of H_kv) the KV heads are replicated: rank r keeps
    only KV head r // (N/H_kv), the one its query heads read. Either way every rank's query heads map onto its
    own KV heads, so attention and the paged KV cache (local heads only) need no communication.
  * norms (incl. Qwen3's per-head q/k norms) and the rotary embedding: replicated (tiny).
  * embedding and LM head: sharded over the vocabulary, in blocks of ceil(V/N) rows. The embedding looks up the
    ids in its block (zero elsewhere) and all_reduces; the LM head computes its block of logits and gathers them
    to rank 0, the only rank that samples. Replicating them would cost every rank V*hidden weights twice (4 GB at
    V=128k, hidden=8k in bf16), usually the largest single matrices; tied embeddings stay tied (one shard).

Numerics: each logit is still one full dot product on one rank, but o_proj/down_proj outputs are sums of N
partial products, added in a different order than one matmul does, so float32 logits differ from tp=1 in the
last bits. Greedy outputs agree unless two logits tie within that error.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class Shard:
    """This process's place in a tensor-parallel group; group=None only in tests that load without one."""
    rank: int
    world: int
    group: object = None


def head_split(num_heads: int, num_kv_heads: int, world: int, rank: int) -> tuple[range, range]:
    """(query heads, KV heads) that rank owns; raises ValueError when the model cannot be split over world."""
    if num_heads % world:
        raise ValueError(f"{num_heads} attention heads cannot be split over tensor-parallel size {world}")
    q = range(rank * num_heads // world, (rank + 1) * num_heads // world)
    if num_kv_heads % world == 0:
        kv = range(rank * num_kv_heads // world, (rank + 1) * num_kv_heads // world)
    elif world % num_kv_heads == 0:
        kv_head = rank // (world // num_kv_heads)     # replicated: world/H_kv ranks share each KV head
        kv = range(kv_head, kv_head + 1)
    else:
        raise ValueError(f"{num_kv_heads} KV heads: tensor-parallel size {world} must divide it or be a multiple")
    return q, kv


def check_model(config, world: int) -> None:
    """Fail before any process starts when a model's shapes do not divide over world ranks."""
    if world == 1:
        return
    heads = config.num_attention_heads
    head_split(heads, getattr(config, "num_key_value_heads", None) or heads, world, 0)
    if config.intermediate_size % world:
        raise ValueError(f"intermediate_size {config.intermediate_size} cannot be split over tensor-parallel "
                         f"size {world}")


def vocab_block(vocab: int, world: int, rank: int) -> tuple[int, int, int]:
    """(first row, rows held, padded block size) of rank's slice of the vocabulary."""
    size = -(-vocab // world)
    start = min(rank * size, vocab)
    return start, min(vocab, start + size) - start, size


# -- sharded layers ----------------------------------------------------------------------------------------------
def _all_reduce(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    if shard.world > 1:
        dist.all_reduce(x, group=shard.group)
    return x


class ColumnParallelLinear(nn.Module):
    """A block of a Linear's output rows; out_features is the local count (the model runner reads head counts
    from it)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """A block of a Linear's input columns: partial product, all_reduce, then the (unsplit) bias once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, shard: Shard):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = weight.shape
        self.shard = shard

    def forward(self, x):
        y = _all_reduce(F.linear(x, self.weight), self.shard)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, start: int, rows: int, shard: Shard):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)   # [padded block, hidden], zero past rows
        self.start, self.rows, self.shard = start, rows, shard

    def forward(self, ids):
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return _all_reduce(h.masked_fill(outside[..., None], 0), self.shard)  # one rank holds each id: exact


class VocabParallelHead(nn.Module):
    """Logits for this rank's vocabulary block, gathered to rank 0. Other ranks get an uninitialised tensor of
    the full shape: they never sample."""

    def __init__(self, weight: nn.Parameter, vocab: int, shard: Shard):
        super().__init__()
        self.weight = weight
        self.vocab, self.shard = vocab, shard

    def forward(self, h):
        part = F.linear(h, self.weight).contiguous()
        if self.shard.world == 1:
            return part[..., :self.vocab]
        parts = [torch.empty_like(part) for _ in range(self.shard.world)] if self.shard.rank == 0 else None
        dist.gather(part, parts, dst=dist.get_global_rank(self.shard.group, 0), group=self.shard.group)
        if parts is None:
            return torch.empty(*part.shape[:-1], self.vocab, dtype=part.dtype, device=part.device)
        return torch.cat(parts, -1)[..., :self.vocab]


# -- loading -----------------------------------------------------------------------------------------------------
class _Checkpoint:
    """Tensor name -> safetensors file, over a single file or an index of several."""

    def __init__(self, path: str):
        from safetensors import safe_open
        self._open, self._files, self.where = safe_open, {}, {}
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                self.where = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
        else:
            for fn in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
                with safe_open(fn, "pt") as f:
                    self.where.update({k: fn for k in f.keys()})
        if not self.where:
            raise FileNotFoundError(f"no safetensors weights in {path} (tensor parallelism reads only those)")

    def slice(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None):
        """Only the requested rows/columns are read from disk (safe_open(...).get_slice)."""
        fn = self.where[name]
        if fn not in self._files:
            self._files[fn] = self._open(fn, "pt")
        s = self._files[fn].get_slice(name)
        if rows is None and cols is None:
            return s[:]
        r = slice(*rows) if rows else slice(None)
        return s[r, slice(*cols)] if cols else s[r]

    def __contains__(self, name):
        return name in self.where


def _heads(config):
    h = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or h
    return h, kv, getattr(config, "head_dim", None) or config.hidden_size // h


def load_sharded(path: str, shard: Shard, device="cpu", dtype=torch.float32):
    """The Hugging Face model at path with rank shard.rank's slices of its weights, every other tensor on the
    meta device never materialised. Returns an eval-mode model the ModelRunner can drive."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from .model_runner import SUPPORTED

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if config.model_type not in SUPPORTED:
        raise ValueError(f"model type {config.model_type!r} at {path} is not supported (supported: "
                         f"{sorted(SUPPORTED)})")
    check_model(config, shard.world)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    ck = _Checkpoint(path)

    def get(name, rows=None, cols=None):
        return ck.slice(name, rows, cols).to(device=device, dtype=dtype)

    def opt(name, rows=None):
        return get(name, rows) if name in ck else None

    H, KV, D = _heads(config)
    qh, kvh = head_split(H, KV, shard.world, shard.rank)
    I = config.intermediate_size
    mlp_rows = (shard.rank * I // shard.world, (shard.rank + 1) * I // shard.world)
    q_rows, kv_rows = (qh.start * D, qh.stop * D), (kvh.start * D, kvh.stop * D)
    for i, layer in enumerate(model.model.layers):
        p, a, m = f"model.layers.{i}.", layer.self_attn, layer.mlp
        for proj, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            n = f"{p}self_attn.{proj}."
            setattr(a, proj, ColumnParallelLinear(get(n + "weight", rows), opt(n + "bias", rows)))
        a.o_proj = RowParallelLinear(get(f"{p}self_attn.o_proj.weight", cols=q_rows),
                                     opt(f"{p}self_attn.o_proj.bias"), shard)
        for proj in ("gate_proj", "up_proj"):
            setattr(m, proj, ColumnParallelLinear(get(f"{p}mlp.{proj}.weight", mlp_rows), None))
        m.down_proj = RowParallelLinear(get(f"{p}mlp.down_proj.weight", cols=mlp_rows), None, shard)

    V = config.vocab_size
    start, rows, size = vocab_block(V, shard.world, shard.rank)
    emb = torch.zeros(size, config.hidden_size, device=device, dtype=dtype)
    emb[:rows] = get("model.embed_tokens.weight", (start, start + rows))
    model.model.embed_tokens = VocabParallelEmbedding(emb, start, rows, shard)
    if "lm_head.weight" in ck and not config.tie_word_embeddings:
        head = torch.zeros_like(emb)
        head[:rows] = get("lm_head.weight", (start, start + rows))
        head = nn.Parameter(head, requires_grad=False)
    else:
        head = model.model.embed_tokens.weight  # tied: the same shard serves both
    model.lm_head = VocabParallelHead(head, V, shard)

    # what is left on the meta device: replicated norms (read whole) and the rotary buffers (recomputed)
    for name, param in list(model.named_parameters()):
        if param.is_meta:
            owner, attr = _owner(model, name)
            setattr(owner, attr, nn.Parameter(get(name), requires_grad=False))
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=config).to(device)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"tensors not loaded for tensor parallelism: {left[:5]}")
    return model.eval()


def _owner(model: nn.Module, name: str):
    *path, attr = name.split(".")
    mod = model
    for p in path:
        mod = getattr(mod, p)
    return mod, attr


def param_bytes(model: nn.Module) -> int:
    """Bytes of this process's weights (a tied tensor counts once)."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
