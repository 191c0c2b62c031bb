"""Sizes the KV cache and the request limits from the machine and the model, when the configuration leaves them
unset (EngineConfig.kv_cache_tokens / max_prompt_tokens / max_tokens_limit = None). Light: reads config.json and
/proc/meminfo, imports neither torch nor transformers, so the CLI can check a prompt before any worker starts.

The rule (the way vLLM sizes its cache by gpu_memory_utilization, but on the host's memory and for the cache
alone: the weights are counted apart):
  * budget = kv_cache_memory_fraction x the memory available now (MemAvailable), shared by both workers' caches
    (each holds kv_cache_tokens positions: the drafter's per-position bytes come from the draft's config);
  * the longest request (prompt + output) = the target's context length (max_position_embeddings), or what the
    budget holds if that is less; max_tokens_limit = half of it, at most 1024; max_prompt_tokens = the rest;
  * kv_cache_tokens = the budget in positions, capped by what max_batch_size requests of the longest kind use.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

MAX_OUTPUT_DEFAULT = 1024   # max_tokens_limit's default at most: HTTP chat's default max_tokens, which each
#                             request reserves in the cache up front
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class Sizing:
    kv_cache_tokens: int
    max_prompt_tokens: int
    max_tokens_limit: int
    target_bytes_per_token: int
    draft_bytes_per_token: int
    context: int | None
    available_bytes: int | None  # None: the KV size was given, not derived from memory

    @property
    def kv_bytes(self) -> int:
        """Bytes of both workers' caches together."""
        return self.kv_cache_tokens * (self.target_bytes_per_token + self.draft_bytes_per_token)

    def summary(self, fraction: float) -> str:
        """One line for the start-up log."""
        mib = 1 << 20
        how = (f"{fraction:g} of {self.available_bytes / (1 << 30):.1f} GiB available"
               if self.available_bytes is not None else "as configured")
        ctx = f", model context {self.context}" if self.context else ""
        return (f"KV cache: {self.kv_cache_tokens} positions per worker, {self.kv_bytes / mib:.0f} MiB in all "
                f"(target {self.kv_cache_tokens * self.target_bytes_per_token / mib:.0f} MiB, draft "
                f"{self.kv_cache_tokens * self.draft_bytes_per_token / mib:.0f} MiB; {how}); requests up to "
                f"{self.max_prompt_tokens} prompt + {self.max_tokens_limit} output tokens{ctx}")


def read_config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    return cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}


def kv_bytes_per_token(model_cfg: dict, dtype: str) -> int:
    """Key and value bytes one position takes over every layer."""
    heads = int(model_cfg["num_attention_heads"])
    head_dim = model_cfg.get("head_dim") or int(model_cfg["hidden_size"]) // heads
    kv_heads = int(model_cfg.get("num_key_value_heads") or heads)
    return 2 * int(model_cfg["num_hidden_layers"]) * kv_heads * int(head_dim) * DTYPE_BYTES[dtype]


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated now without swapping (MemAvailable); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def weights_bytes(model_dir: str) -> int:
    return sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir)
               if f.endswith((".safetensors", ".bin")))


def size(cfg, draft_cfg: dict | None, draft_dtype: str | None, available: int | None) -> Sizing:
    """Fill in the unset sizes of EngineConfig `cfg` (see the module docstring); ValueError, naming the option to
    change, when the model and one request do not fit. draft_cfg: the drafter's model config (None: it runs no
    model); available: bytes of memory available (None: unknown, then 4 GiB is assumed)."""
    target_cfg = read_config(cfg.target)
    t_bpt = kv_bytes_per_token(target_cfg, cfg.dtype)
    d_bpt = kv_bytes_per_token(draft_cfg, draft_dtype) if draft_cfg is not None else 0
    context = target_cfg.get("max_position_embeddings")
    context = int(context) if isinstance(context, int) and context > 0 else None
    tail = cfg.max_draft + 1  # a request's positions past prompt + output: the drafts of its last step
    block = cfg.block_size
    derived = cfg.kv_cache_tokens is None
    if derived:
        avail = available if available is not None else 4 << 30
        budget = int(cfg.kv_cache_memory_fraction * avail) // (t_bpt + d_bpt) // block * block
        weights = weights_bytes(cfg.target) + (weights_bytes(cfg.draft_model) if cfg.draft_model and
                                               os.path.isdir(cfg.draft_model) else 0)
        if available is not None and weights >= available:
            raise ValueError(f"kv_cache_tokens: the model weights alone ({weights / (1 << 30):.1f} GiB) do not fit "
                             f"in the {available / (1 << 30):.1f} GiB of memory available")
    else:
        budget = cfg.kv_cache_tokens
    longest = min(x for x in (context, budget) if x is not None)
    out = cfg.max_tokens_limit
    if out is None:
        out = max(1, min(MAX_OUTPUT_DEFAULT, longest // 2))
    prompt = cfg.max_prompt_tokens
    if prompt is None:
        prompt = longest - out - tail
        if prompt < 1:
            raise ValueError(
                f"kv_cache_tokens: the KV cache holds {budget} positions, too few for one request of "
                f"{out} output tokens (max_tokens_limit) and a prompt; raise kv_cache_memory_fraction "
                f"(--kv-cache-memory-fraction) or kv_cache_tokens (--kv-cache-tokens), or lower max_tokens_limit")
    tokens = budget
    if derived:
        one = -(-(prompt + out + tail) // block) * block
        tokens = min(budget, cfg.max_batch_size * one)
        if tokens < one:
            raise ValueError(
                f"kv_cache_tokens: {cfg.kv_cache_memory_fraction:g} of the {avail / (1 << 30):.1f} GiB available "
                f"holds {budget} KV positions per worker, fewer than one request of max_prompt_tokens {prompt} + "
                f"max_tokens_limit {out} needs ({one}); raise --kv-cache-memory-fraction, or lower "
                f"--max-prompt-tokens / --max-tokens-limit")
    return Sizing(tokens, prompt, out, t_bpt, d_bpt, context, available if derived else None)
