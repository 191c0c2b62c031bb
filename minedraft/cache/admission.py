"""Request-level admission over the BlockManager, shared by the scheduler and the in-process LocalEngine.

A request is admitted when its blocks fit (shared ones counted once) and no block of its prefix is still being
computed by another request; it then carries its block table and cached length to the workers
(NewRequest.blocks / .cached). Its first verdict confirms its prefill (its prompt blocks become shareable); its
release registers the reply it produced and lets its blocks go (to the cache, or free).
"""

from __future__ import annotations

import hashlib

from .blocks import BlockManager


def cache_namespace(config) -> bytes:
    """What a block's content depends on besides its tokens: both models (a feature-conditioned draft's inputs
    come from the target, which is named too) and the dtype."""
    draft = config.draft if config.speculative else ""
    return hashlib.blake2b(f"{config.target}\0{draft}\0{config.dtype}".encode(), digest_size=16).digest()


class Admission:
    def __init__(self, config, max_draft: int):
        self.max_draft = max_draft
        self.blocks = BlockManager(config.kv_cache_tokens // config.block_size, config.block_size,
                                   config.prefix_caching, cache_namespace(config))
        self._tokens: dict[int, list[int]] = {}   # rid -> prompt + output so far
        self._started: set[int] = set()

    def reserve(self, req) -> int:
        return req.cache_tokens(self.max_draft)

    def fits_ever(self, req) -> bool:
        return self.blocks.blocks_for(self.reserve(req)) <= self.blocks.num_blocks

    def try_admit(self, req) -> bool:
        """Give req its blocks (req.blocks, req.cached) if it can start now; False: it must wait."""
        need, pending = self.blocks.cost(req.prompt_ids, self.reserve(req))
        if pending or need > self.blocks.num_available:
            return False
        req.blocks, req.cached = self.blocks.admit(req.rid, req.prompt_ids, self.reserve(req))
        self._tokens[req.rid] = list(req.prompt_ids)
        return True

    def on_result(self, rid: int, new_tokens) -> None:
        toks = self._tokens.get(rid)
        if toks is None:
            return
        if rid not in self._started:
            self._started.add(rid)
            self.blocks.mark_ready(rid)
        toks.extend(new_tokens)

    def release(self, rid: int) -> None:
        toks = self._tokens.pop(rid, None)
        if toks is None:
            return
        if rid in self._started:  # the verifier has computed every position but the last
            self._started.discard(rid)
            self.blocks.commit(rid, toks, len(toks) - 1)
        self.blocks.free(rid)

    @property
    def free_blocks(self) -> int:
        return self.blocks.num_available


def prefix_stats(blocks: BlockManager) -> dict:
    st = blocks.stats
    return {"prefix_cache_queries": st.queries, "prefix_cache_hits": st.hits, "prefix_cache_hit_rate": st.hit_rate,
            "prefix_cache_blocks": blocks.num_cached, "prefix_cache_evictions": st.evictions}
