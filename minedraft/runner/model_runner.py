"""One forward pass over a ragged batch, against the paged KV cache.

The weights and the small modules (embeddings, norms, MLPs, rotary embedding) come from a Hugging Face
model loaded with `from_pretrained(local_path)`; only attention is ours, so that it reads and writes the
paged cache. That covers the Llama family (Llama, Mistral, Qwen2, Qwen3: same block layout).
In float32 on a CPU the forward runs through the C kernels instead (runner/kernel_forward.py: batch-invariant,
one weight stream per step); the torch path below serves every other case, and `kernels=False`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from dataclasses import dataclass

import torch
import transformers
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from ..sampling.batch_sampling import take_rows
from ..cache.paged_kv import PagedKVCache
from .model_files import FEATURE_FILE, load_vocab_map
from .kernel_forward import KernelModel, unsupported
from .kernels import try_load

try:  # location is stable across transformers 4.4x and 5.x
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
except ImportError:  # pragma: no cover
    def _rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def layer_windows(cfg) -> list[int | None]:
    """The sliding window of each layer (None = full attention), decided the way transformers decides it:
    Mistral windows every layer when `sliding_window` is set; Qwen2/Qwen3 read `config.layer_types`, which their
    configs derive from `use_sliding_window` and `max_window_layers` (layers from max_window_layers on slide)."""
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return [None] * n
    types = getattr(cfg, "layer_types", None)
    if cfg.model_type == "mistral" or types is None:
        return [window] * n
    unknown = set(types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"attention layer types {sorted(unknown)} are not supported")
    return [window if t == "sliding_attention" else None for t in types]


def load_causal_lm(path: str, device="cpu", dtype="float32"):
    """Load a local Hugging Face causal LM; no hub access (local_files_only)."""
    hf_logging.disable_progress_bar()
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    # read into memory, not mapped from the file: a worker's runner packs the weights for its kernels and frees
    # the originals (keep_one_weight_copy), which a file mapping would keep resident
    extra = {"disable_mmap": True} if int(transformers.__version__.split(".")[0]) >= 5 else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True, **extra)
    kind = model.config.model_type
    if kind not in SUPPORTED:
        raise ValueError(f"model type {kind!r} at {path} is not supported (supported: {sorted(SUPPORTED)})")
    return model.to(device).eval()


def return_freed_memory() -> None:
    """Hand memory freed after loading (weights converted or packed, then dropped) back to the OS: glibc keeps
    freed heap blocks for reuse, so a worker's resident size would otherwise stay at its loading peak."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def load_feature_fc(path: str, device="cpu", dtype=torch.float32) -> torch.nn.Linear | None:
    """A feature-conditioned draft (EAGLE-style) carries eagle_fc.safetensors: one linear map from [target feature,
    token embedding] (2H) to its hidden size. Its input at position j is fc(cat(f_{j-1}, embed(t_j))), where f is the
    target's final-norm hidden state (the vector its LM head reads); the draft's own final-norm output is its guess
    of the target's feature at j, which it feeds back for the next draft position."""
    f = os.path.join(path, FEATURE_FILE)
    if not os.path.exists(f):
        return None
    from safetensors.torch import load_file
    w = load_file(f)
    fc = torch.nn.Linear(w["weight"].shape[1], w["weight"].shape[0], bias="bias" in w)
    fc.load_state_dict(w)
    return fc.to(device=device, dtype=dtype).eval()


def pad_three_rows(linear: torch.nn.Linear) -> None:
    """Feed `linear` three token rows as four (a zero row, dropped from the output). float32 GEMMs on CPU run
    2 and 3 rows as that many matrix-vector products (3x the 1-row time) and 4+ rows blocked: measured on the
    real pair's shapes, 3 rows took 175 us where 4 took 134 (576x576), the 49,152-wide head 28.7 ms where 4 took
    18.8, a whole forward of 3 tokens 113 ms where 4 took 89. Three rows is a 2-draft verify at B = 1, or a plain
    step at B = 3. (2 rows cost about what 4 do, so they stay as they are.)"""
    plain = linear.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dim() >= 2 and x.shape[-2] == 3:
            return plain(torch.nn.functional.pad(x, (0, 0, 0, 1)))[..., :3, :]
        return plain(x)
    linear.forward = forward


@dataclass
class _Plan:
    """Index tensors for one padded forward over a group of sequences."""
    input_ids: torch.Tensor     # [B, T]
    positions: torch.Tensor     # [B, T]
    write_slots: torch.Tensor   # [N] flat cache index of each real (non-pad) input token
    real_rows: torch.Tensor | None  # [N] index into the flattened [B*T] tokens of the real ones; None = all
    read_slots: torch.Tensor    # [B*S] flat cache index of each key position (0 past the end), row-major
    masks: list[torch.Tensor]   # per layer [B, 1, T, S] bool, True = may attend (layers share equal ones)
    last_index: torch.Tensor    # [B, n] index into T of the last n real tokens per row


class ModelRunner:
    def __init__(self, model, kv_cache_tokens: int, block_size: int = 16, vocab_map=None, feature_fc=None,
                 kernels: bool | None = None):
        """kernels: run the forward through the C kernels (runner/kernel_forward.py: batch-invariant, one weight
        stream per step) where the model allows; False keeps the torch path; None (default) follows the
        environment variable MINEDRAFT_KERNELS (0 = off)."""
        self.model = model
        self.fc = feature_fc  # set: a feature-conditioned draft; forward then needs each token's target feature
        cfg = model.config
        self.config = cfg
        inner = model.model
        self.embed, self.layers, self.norm, self.rotary = inner.embed_tokens, inner.layers, inner.norm, inner.rotary_emb
        self.lm_head = model.lm_head
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # head counts from the projections: a tensor-parallel shard holds only its own heads (tensor_parallel.py)
        attn = self.layers[0].self_attn
        self.num_heads = attn.q_proj.out_features // self.head_dim
        self.num_kv_heads = attn.k_proj.out_features // self.head_dim
        self.vocab_size = cfg.vocab_size
        self.token_ids = self.in_map = None  # reduced-vocabulary draft: target id -> own id, own id -> target id
        if vocab_map is not None:
            ids, self.vocab_size = vocab_map
            if len(ids) + 1 != cfg.vocab_size:
                raise ValueError(f"draft_vocab.json lists {len(ids)} tokens; the model needs {cfg.vocab_size - 1}")
            self.in_map = torch.full((self.vocab_size,), len(ids), dtype=torch.long)
            self.in_map[torch.tensor(ids)] = torch.arange(len(ids))
            self.token_ids = torch.tensor(ids, device=self.device)
        self.layer_windows = layer_windows(cfg)
        self.cache = PagedKVCache(cfg.num_hidden_layers, self.num_kv_heads, self.head_dim, kv_cache_tokens,
                                  block_size, self.dtype, self.device)
        self.state_store: torch.Tensor | None = None  # see keep_states
        self.kernels = None
        if kernels is None:
            kernels = os.environ.get("MINEDRAFT_KERNELS", "1") != "0"
        if kernels and unsupported(self) is None:
            lib = try_load()
            self.kernels = KernelModel(self, lib) if lib is not None else None
        if self.kernels is None and self.device.type == "cpu" and self.dtype == torch.float32:
            for m in model.modules():
                if type(m) is torch.nn.Linear:
                    pad_three_rows(m)

    def keep_states(self) -> None:
        """Keep every cached position's final-norm state beside its KV (the target of a feature-conditioned
        draft): a request that skips a cached prefix must still send the draft that prefix's features."""
        n = self.cache.num_blocks * self.cache.block_size
        self.state_store = torch.zeros(n, self.hidden_size, dtype=self.dtype, device=self.device)

    def stored_states(self, seq_id, start: int, stop: int) -> torch.Tensor:
        return self.state_store.index_select(0, self.cache.slots(seq_id, start, stop).to(self.device))

    @classmethod
    def from_pretrained(cls, path: str, kv_cache_tokens: int, block_size: int = 16, device="cpu",
                        dtype="float32", kernels: bool | None = None) -> "ModelRunner":
        model = load_causal_lm(path, device, dtype)
        return cls(model, kv_cache_tokens, block_size, load_vocab_map(path),
                   load_feature_fc(path, device, next(model.parameters()).dtype), kernels)

    def keep_one_weight_copy(self) -> None:
        """For a worker, which owns its runner: with the kernels running, free the torch modules' copies of the
        packed weights (runner.model can no longer run a transformers forward) and return the memory."""
        if self.kernels is not None:
            self.kernels.release_module_weights()
        return_freed_memory()

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    # -- planning ----------------------------------------------------------------------------------
    def _plan(self, seq_ids, token_lists, num_logits: int) -> _Plan:
        cache, dev = self.cache, self.device
        lens = [len(t) for t in token_lists]
        starts = [cache.length(s) for s in seq_ids]
        T = max(lens)
        totals = [s + n for s, n in zip(starts, lens)]
        S = max(totals)
        ids = torch.tensor([t if n == T else list(t) + [0] * (T - n) for t, n in zip(token_lists, lens)],
                           dtype=torch.long)  # one tensor call, not one per row: planning runs every step
        if self.in_map is not None:
            ids = self.in_map[ids]
        read = cache.batch_slots(seq_ids, totals)
        t = torch.arange(T)
        starts_t, lens_t, totals_t = (torch.tensor(x) for x in (starts, lens, totals))
        positions = starts_t[:, None] + t[None, :]
        valid = t[None, :] < lens_t[:, None]
        key = torch.arange(S)[None, None, :]
        causal = (key <= positions[:, :, None]) & (key < totals_t[:, None, None])
        causal[:, :, 0] |= ~valid  # pad rows attend to something, so softmax stays finite
        by_window = {}
        for w in dict.fromkeys(self.layer_windows):  # one mask per distinct window, shared by its layers
            m = causal
            if w:
                m = causal & (key > positions[:, :, None] - w)
                m[:, :, 0] |= ~valid
            by_window[w] = m[:, None].to(dev)
        writes = read.gather(1, positions.clamp(max=S - 1))[valid]
        last = (lens_t[:, None] - num_logits + torch.arange(num_logits)[None, :]).clamp(min=0)
        real = None if bool(valid.all()) else valid.reshape(-1).nonzero().squeeze(1).to(dev)
        return _Plan(ids.to(dev), positions.to(dev), writes.to(dev), real,
                     read.reshape(-1).to(dev), [by_window[w] for w in self.layer_windows], last.to(dev))

    # -- forward -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, seq_ids: list, token_lists: list[list[int]], num_logits: int = 1,
                features: list[torch.Tensor] | None = None, hidden: bool = False, packed: bool = False):
        """Append token_lists[i] to sequence seq_ids[i]'s cache; return logits [B, num_logits, V] (float32)
        of each sequence's last num_logits new tokens, right-aligned: a row with n < num_logits new tokens
        (ragged Tetris drafts) fills its first num_logits - n places with copies of its first token's logits.

        features (a feature-conditioned draft only): row i's target features [len(token_lists[i]), H], the one
        before each token. hidden=True also returns each row's final-norm hidden states [len(token_lists[i]), H]
        (the target's features, or the draft's guesses of them): (logits, list of tensors).

        Rows of very different lengths (a long prefill beside decodes) run as separate padded groups so a
        prompt does not make every decode row pay for its length.

        packed=True returns the logits as (rows [M, V], index [B, num_logits]) with rows[index] the tensor
        above: each distinct logit row once, so a caller that reorders them (the verifier) copies them once.
        """
        if (features is None) != (self.fc is None):
            raise ValueError("a feature-conditioned draft needs features, and only it takes them")
        if not seq_ids:
            rows = torch.empty(0, self.vocab_size)
            index = torch.empty(0, num_logits, dtype=torch.long)
            logits = (rows, index) if packed else take_rows(rows, index)
            return (logits, []) if hidden else logits
        if any(not toks for toks in token_lists):
            raise ValueError("each sequence needs at least one new token")
        order = sorted(range(len(seq_ids)), key=lambda i: len(token_lists[i]))
        parts: list[torch.Tensor] = []
        offset = 0
        index = torch.empty(len(seq_ids), num_logits, dtype=torch.long, device=self.device)
        states: list = [None] * len(seq_ids)
        group: list[int] = []
        for i in order + [None]:
            # short rows (decodes, ragged drafts) always share a group: with token-wise work packed, their
            # padding costs only attention; a long prefill goes apart so decode rows do not pay for it
            # (the kernels pad nothing: one group streams the weights once)
            if i is not None and (not group or self.kernels is not None
                                  or len(token_lists[i]) <= max(2 * len(token_lists[group[0]]) + 4, 16)):
                group.append(i)
                continue
            rows, idx, hs = self._forward_group([seq_ids[j] for j in group], [token_lists[j] for j in group],
                                                num_logits, None if features is None else [features[j] for j in group],
                                                hidden)
            for j, h in zip(group, hs or ()):
                states[j] = h
            index[group] = idx + offset
            offset += rows.shape[0]
            parts.append(rows)
            group = [i] if i is not None else []
        rows = parts[0] if len(parts) == 1 else torch.cat(parts)
        if packed:
            logits = (rows, index)
        elif len(parts) == 1 and order == list(range(len(order))) and min(map(len, token_lists)) >= num_logits:
            logits = rows.view(len(seq_ids), num_logits, -1)  # rows already in order, none repeated: no copy
        else:
            logits = take_rows(rows, index)
        return (logits, states) if hidden else logits

    def _forward_group(self, seq_ids, token_lists, num_logits, features=None, hidden=False):
        """Token-wise work (embeddings, projections, MLPs) runs on the real tokens only, packed [1, N, H]:
        rows with fewer new tokens (ragged Tetris drafts, decodes beside a prefill) cost only their tokens.
        Attention runs padded, [B, heads, T, S], against the paged cache. Returns (logit rows [M, V], index
        [B, num_logits] into them, the final-norm states per row or None)."""
        if self.kernels is not None:
            return self.kernels.forward_group(seq_ids, token_lists, num_logits, features, hidden)
        p = self._plan(seq_ids, token_lists, num_logits)
        B, T = p.input_ids.shape
        real = p.real_rows
        ids, pos = p.input_ids.reshape(-1), p.positions.reshape(-1)
        if real is not None:
            ids, pos = ids.index_select(0, real), pos.index_select(0, real)
        N = ids.shape[0]
        h = self.embed(ids)[None]                        # [1, N, H]
        if self.fc is not None:  # packed real tokens are the rows' lists in order, so are their features
            f = torch.cat(features).to(device=self.device, dtype=h.dtype)
            h = self.fc(torch.cat([f[None], h], -1))
        cos, sin = self.rotary(h, pos[None])
        S = p.masks[0].shape[-1]

        def padded(x):  # [N, heads, D] -> [B, heads, T, D], pad tokens zero
            if real is None:
                return x.view(B, T, -1, self.head_dim).transpose(1, 2)
            out = x.new_zeros(B * T, x.shape[1], self.head_dim).index_copy_(0, real, x)
            return out.view(B, T, -1, self.head_dim).transpose(1, 2)
        for li, layer in enumerate(self.layers):
            x = layer.input_layernorm(h)
            attn = layer.self_attn
            q = attn.q_proj(x).view(1, N, -1, self.head_dim)
            k = attn.k_proj(x).view(1, N, -1, self.head_dim)
            v = attn.v_proj(x).view(1, N, -1, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [1, heads, N, D]
            kc, vc = self.cache.k[li], self.cache.v[li]
            kc.index_copy_(0, p.write_slots, k[0].transpose(0, 1))
            vc.index_copy_(0, p.write_slots, v[0])
            # index_select on dim 0 copies whole rows: several times faster on CPU than advanced indexing
            keys = kc.index_select(0, p.read_slots).view(B, S, -1, self.head_dim).transpose(1, 2)  # [B,Hkv,S,D]
            vals = vc.index_select(0, p.read_slots).view(B, S, -1, self.head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(padded(q[0].transpose(0, 1)), keys, vals, attn_mask=p.masks[li],
                                               scale=attn.scaling, enable_gqa=self.num_kv_heads != self.num_heads)
            o = o.transpose(1, 2).reshape(B * T, -1)
            if real is not None:
                o = o.index_select(0, real)
            h = h + attn.o_proj(o)[None]
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        for sid, toks in zip(seq_ids, token_lists):
            self.cache.extend(sid, len(toks))
        flat = (torch.arange(B, device=self.device)[:, None] * T + p.last_index).reshape(-1)
        if real is not None:  # [B*T] position -> packed index
            packed = torch.full((B * T,), -1, dtype=torch.long, device=self.device)
            flat = packed.index_copy_(0, real, torch.arange(N, device=self.device))[flat]
        # a row with fewer new tokens than num_logits repeats its first one: the LM head (the widest matmul)
        # runs once per distinct token (ragged Tetris rows), and index says which row each place reads
        if min(map(len, token_lists)) < num_logits:
            flat, index = flat.unique(return_inverse=True)
        else:
            index = torch.arange(flat.numel(), device=self.device)
        if hidden:  # every real token's final-norm state; the logits read the same rows
            states = self.norm(h[0])
            if self.state_store is not None:
                self.state_store.index_copy_(0, p.write_slots, states)
            h = states.index_select(0, flat)
        else:
            h = self.norm(h[0].index_select(0, flat))
        rows = self._logits(self.lm_head(h).float())
        hs = list(states.split([len(t) for t in token_lists])) if hidden else None
        return rows, index.view(B, num_logits), hs

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.token_ids is None:
            return logits
        full = torch.full((*logits.shape[:-1], self.vocab_size), float("-inf"), device=self.device)
        return full.index_copy_(-1, self.token_ids, logits[..., :-1])  # the 'other' row is never proposed
