"""The runner's forward through the C kernels (kernels.c): batch-invariant by construction, one weight stream
per step.

Every token's work is a function of that token alone (its row's cached keys included), done in one fixed order
of float operations: a row's logits come out bitwise the same whether it is scored alone, beside other rows, or
with 1-8 tokens at once, and on AVX2, AVX-512 or plain-C machines alike. At load each projection is packed into
panels (kernels.c), q/k/v fused into one matrix and gate/up into another, so a layer is one C call and each
weight is read once per step whatever the number of rows.

Covers float32 Llama-family models on CPU (Llama, Mistral, Qwen2, Qwen3: GQA, sliding windows, q/k norms,
q/k/v/o biases, tied or untied head), reduced-vocabulary and feature-conditioned drafts, `hidden=True` states.
`unsupported` says why anything else (other dtypes or devices, tensor-parallel shards, quantized layers, other
activations, MLP biases, rope types that depend on the sequence length) keeps the torch path.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

CHUNK = 4096  # rotary tables are computed in fixed chunks of positions, so a position's values never change

P, I32, F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class LayerArgs(ctypes.Structure):  # md_layer_t
    _fields_ = [("ln1", P), ("ln2", P), ("wqkv", P), ("bqkv", P), ("qnorm", P), ("knorm", P), ("wo", P),
                ("bo", P), ("wgu", P), ("wdown", P), ("kc", P), ("vc", P), ("window", I32)]


class StepArgs(ctypes.Structure):  # md_step_t
    _fields_ = [("N", I32), ("H", I32), ("nh", I32), ("nkv", I32), ("D", I32), ("I", I32), ("eps", F32),
                ("scale", F32), ("cos", P), ("sin", P), ("row", P), ("pos", P), ("tables", P), ("nblocks", I32),
                ("block_size", I32), ("x", P), ("qkv", P), ("att", P), ("act", P), ("tmp", P), ("scores", P)]


def pack(weight: torch.Tensor, width: int) -> torch.Tensor:
    """A Linear's weight [N, K] as panels [ceil(N / width), K, width] (zero columns past N)."""
    n, k = weight.shape
    panels = -(-n // width)
    out = torch.zeros(panels * width, k, dtype=torch.float32)
    out[:n] = weight.detach()
    return out.view(panels, width, k).transpose(1, 2).contiguous()


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def unsupported(runner) -> str | None:
    """Why the kernels cannot run this model (None: they can)."""
    cfg = runner.config
    if runner.device.type != "cpu" or runner.dtype != torch.float32:
        return f"{runner.dtype} on {runner.device} (the kernels run float32 on CPU)"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act}"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "linear", "llama3", "yarn"):
        return f"rope type {rope.get('rope_type')}"  # e.g. dynamic: its tables change with the sequence length
    if type(runner.embed) is not nn.Embedding:
        return "a tensor-parallel or non-standard embedding"
    linears = [runner.lm_head] + ([runner.fc] if runner.fc is not None else [])
    for layer in runner.layers:
        a, m = layer.self_attn, layer.mlp
        linears += [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
    odd = {type(x).__name__ for x in linears if type(x) is not nn.Linear}
    if odd:
        return f"layers of type {sorted(odd)} (tensor-parallel shards or quantized layers)"
    return None


class KernelModel:
    def __init__(self, runner, lib):
        self.runner, self.lib = runner, lib
        cfg, pw = runner.config, lib.md_panel_width()
        self.H, self.nh, self.nkv, self.D = cfg.hidden_size, runner.num_heads, runner.num_kv_heads, runner.head_dim
        self.I = runner.layers[0].mlp.gate_proj.out_features
        self.eps = float(cfg.rms_norm_eps)
        self.scale = float(runner.layers[0].self_attn.scaling)
        self.keep = []  # every tensor whose address the C structs hold
        self.layers = []
        for layer, window in zip(runner.layers, runner.layer_windows):
            a, m = layer.self_attn, layer.mlp
            qkv = [a.q_proj, a.k_proj, a.v_proj]
            bias = None
            if any(x.bias is not None for x in qkv):
                bias = torch.cat([x.bias.detach() if x.bias is not None else torch.zeros(x.out_features)
                                  for x in qkv]).float()
            t = dict(ln1=layer.input_layernorm.weight.detach(), ln2=layer.post_attention_layernorm.weight.detach(),
                     wqkv=pack(torch.cat([x.weight for x in qkv]), pw), bqkv=bias,
                     qnorm=a.q_norm.weight.detach() if hasattr(a, "q_norm") else None,
                     knorm=a.k_norm.weight.detach() if hasattr(a, "k_norm") else None,
                     wo=pack(a.o_proj.weight, pw), bo=None if a.o_proj.bias is None else a.o_proj.bias.detach(),
                     wgu=pack(torch.cat([m.gate_proj.weight, m.up_proj.weight]), pw), wdown=pack(m.down_proj.weight, pw))
            self.keep.append(t)
            self.layers.append(LayerArgs(**{k: _ptr(v) for k, v in t.items()}, window=window or 0))
        self.norm_w = runner.norm.weight.detach()
        self.head = pack(runner.lm_head.weight, pw)
        self.head_bias = None if runner.lm_head.bias is None else runner.lm_head.bias.detach().float()
        self.fc = None if runner.fc is None else pack(runner.fc.weight, pw)
        self.fc_bias = None if runner.fc is None or runner.fc.bias is None else runner.fc.bias.detach()
        self.cache = None
        self.cos = self.sin = torch.empty(0, self.D)
        self.cap, self.scores = 0, torch.empty(0)
        self.step = StepArgs(H=self.H, nh=self.nh, nkv=self.nkv, D=self.D, I=self.I, eps=self.eps, scale=self.scale)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weights (and biases and norms) this model holds."""
        tensors = [t for d in self.keep for t in d.values() if t is not None]
        tensors += [t for t in (self.norm_w, self.head, self.head_bias, self.fc, self.fc_bias) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def release_module_weights(self) -> None:
        """Free the torch modules' copies of the projections now packed here (the embedding stays: token lookups
        read it, and a tied head shares it). Only for a runner that owns its model: the torch path cannot run on
        it afterwards."""
        empty = lambda: nn.Parameter(torch.empty(0), requires_grad=False)  # noqa: E731
        for layer in self.runner.layers:
            a, m = layer.self_attn, layer.mlp
            for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
                lin.weight = empty()
        head = self.runner.lm_head
        if head.weight is not self.runner.embed.weight:
            head.weight = empty()

    # -- per-step state ----------------------------------------------------------------------------
    def _bind_cache(self):
        cache = self.runner.cache
        if cache is not self.cache:  # the runner's cache was built (or replaced): point the layers at it
            for args, k, v in zip(self.layers, cache.k, cache.v):
                args.kc, args.vc = k.data_ptr(), v.data_ptr()
            self.cache = cache
            self.step.block_size = cache.block_size

    def _rotary(self, upto: int):
        """cos/sin rows of positions [0, upto), computed chunk by chunk and kept."""
        while self.cos.shape[0] < upto:
            start = self.cos.shape[0]
            pos = torch.arange(start, start + CHUNK)[None]
            cos, sin = self.runner.rotary(torch.zeros(1, dtype=torch.float32), pos)
            self.cos = torch.cat([self.cos, cos[0].float()])
            self.sin = torch.cat([self.sin, sin[0].float()])

    def _scratch(self, n: int, scores: int):
        if n > self.cap or scores > self.scores.numel():
            self.cap = max(n, 2 * self.cap, 16)
            c, H = self.cap, self.H
            nq = (self.nh + 2 * self.nkv) * self.D
            self.buf = dict(x=torch.empty(c, H), qkv=torch.empty(c, nq), att=torch.empty(c, self.nh * self.D),
                            act=torch.empty(c, 2 * self.I), tmp=torch.empty(c, H),
                            scores=torch.empty(max(scores, 2 * self.scores.numel(), 1024)))
            self.scores = self.buf["scores"]
            for k, v in self.buf.items():
                setattr(self.step, k, v.data_ptr())

    def matmul(self, x: torch.Tensor, packed: torch.Tensor, n_out: int, bias=None) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty(x.shape[0], n_out)
        self.lib.md_matmul(x.data_ptr(), x.shape[1], x.shape[0], x.shape[1], packed.data_ptr(), n_out, _ptr(bias),
                           y.data_ptr(), n_out)
        return y

    def rmsnorm(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        y = torch.empty_like(x)
        self.lib.md_rmsnorm(x.data_ptr(), self.H, x.shape[0], self.norm_w.data_ptr(), self.H, self.eps,
                            y.data_ptr(), self.H)
        return y

    # -- forward -----------------------------------------------------------------------------------
    def forward_group(self, seq_ids, token_lists, num_logits, features=None, hidden=False):
        """As ModelRunner._forward_group: (logit rows [M, V], index [B, num_logits] into them, states or None)."""
        r, cache = self.runner, self.runner.cache
        self._bind_cache()
        lens = [len(t) for t in token_lists]
        starts = [cache.length(s) for s in seq_ids]
        totals = [s + n for s, n in zip(starts, lens)]
        for sid, n in zip(seq_ids, totals):
            if n > cache._capacity[sid]:
                raise MemoryError(f"sequence {sid!r} needs {n} positions, reserved {cache._capacity[sid]}")
        B, N, bs = len(seq_ids), sum(lens), cache.block_size
        nb = -(-max(totals) // bs)
        tables = torch.tensor([(cache._tables[s][:nb] + [0] * nb)[:nb] for s in seq_ids], dtype=torch.int32)
        lens_t = torch.tensor(lens)
        row = torch.repeat_interleave(torch.arange(B, dtype=torch.int32), lens_t)
        first = torch.cumsum(lens_t, 0) - lens_t                      # each row's first packed token
        pos = (torch.arange(N) - first.repeat_interleave(lens_t) + torch.tensor(starts).repeat_interleave(lens_t))
        pos32 = pos.to(torch.int32)
        ids = torch.tensor([t for toks in token_lists for t in toks], dtype=torch.long)
        if r.in_map is not None:
            ids = r.in_map[ids]
        self._rotary(max(totals))
        cos, sin = self.cos.index_select(0, pos), self.sin.index_select(0, pos)
        self._scratch(N, max(totals) * self.nh)
        h = r.embed.weight.detach().index_select(0, ids)
        if self.fc is not None:
            f = torch.cat(features).to(torch.float32)
            h = self.matmul(torch.cat([f, h], 1), self.fc, self.H, self.fc_bias)
        s = self.step
        s.N, s.cos, s.sin, s.row, s.pos = N, cos.data_ptr(), sin.data_ptr(), row.data_ptr(), pos32.data_ptr()
        s.tables, s.nblocks = tables.data_ptr(), nb
        hp, sp = h.data_ptr(), ctypes.byref(s)
        for args in self.layers:
            self.lib.md_layer(sp, ctypes.byref(args), hp)
        for sid, n in zip(seq_ids, lens):
            cache.extend(sid, n)
        last = (lens_t[:, None] - num_logits + torch.arange(num_logits)[None, :]).clamp(min=0)
        flat = (first[:, None] + last).reshape(-1)
        if min(lens) < num_logits:  # ragged rows repeat their first token: its logits computed once
            flat, index = flat.unique(return_inverse=True)
        else:
            index = torch.arange(flat.numel())
        states = None
        if hidden:
            states = self.rmsnorm(h)
            if r.state_store is not None:
                slots = tables[row.long(), pos // bs].long() * bs + pos % bs
                r.state_store.index_copy_(0, slots, states)
            x = states.index_select(0, flat)
        else:
            x = self.rmsnorm(h.index_select(0, flat))
        rows = r._logits(self.matmul(x, self.head, self.head_n, self.head_bias))
        hs = list(states.split(lens)) if hidden else None
        return rows, index.view(B, num_logits), hs

    @property
    def head_n(self) -> int:
        return self.runner.lm_head.out_features
