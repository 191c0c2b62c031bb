"""Request-level admission over the BlockManager, shared by the scheduler and the in-process LocalEngine.

A request is admitted when its blocks fit (shared ones counted once) and no block of its prefix is still being
computed by another request; it then carries its block table and cached length to the workers
(NewRequest.blocks / .cached). Its first verdict confirms its prefill (its prompt blocks become shareable); its
release registers the reply it produced and lets its blocks go (to the cache, or free).
"""

from __future__ import annotations

import hashlib

from .blocks import BlockManager

PASS_OVER = 64  # requests waiting on a pending prefix that one admission pass looks past


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

    def admit_from(self, waiting, room: int) -> list:
        """Admit up to `room` requests of the queue `waiting` (request states, oldest first), removing them from
        it and giving each its blocks (req.blocks, req.cached); returns them in queue order.

        A request waiting for another's pending prefix is passed over: it cannot start before that prefix is
        computed, and the requests behind it should not wait for that (at most PASS_OVER of them are passed, so
        a long queue of siblings costs bounded work per call). A request whose blocks do not fit stops the scan:
        memory goes first come, first served, so a long prompt is not starved by short ones behind it."""
        out, i, passed = [], 0, 0
        while len(out) < room and i < len(waiting):
            req = waiting[i].req
            need, pending = self.blocks.cost(req.prompt_ids, self.reserve(req))
            if pending:
                passed += 1
                if passed > PASS_OVER:
                    break
                i += 1
                continue
            if need > self.blocks.num_available:
                break
            req.blocks, req.cached = self.blocks.admit(req.rid, req.prompt_ids, self.reserve(req))
            self._tokens[req.rid] = list(req.prompt_ids)
            out.append(waiting[i])
            del waiting[i]
        return out

    def on_result(self, rid: int, new_tokens) -> bool:
        """A verdict row; True when it confirmed the request's prefill (its prompt blocks became shareable, so
        a request waiting on that prefix may now be admitted)."""
        toks = self._tokens.get(rid)
        if toks is None:
            return False
        first = rid not in self._started
        if first:
            self._started.add(rid)
            self.blocks.mark_ready(rid)
        toks.extend(new_tokens)
        return first

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
