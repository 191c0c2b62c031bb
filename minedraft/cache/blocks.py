"""Block accounting with prefix caching: which KV blocks a request gets, which it shares, which stay cached.

Torch-free, so the scheduler runs it: it is the one authority on block tables. Each admitted request's table
travels to both workers with the request (NewRequest.blocks), and their caches use it as given; the two
workers' caches have the same number of blocks, so one table addresses both. Nothing has to be replayed in the
same order in three processes, and admission counts exactly the blocks the workers will use (a shared block once).

A full block is keyed by a hash chained over every token up to its end plus a namespace (whatever else decides
its content: the target, the draft, and for a feature-conditioned draft the target that makes its features), so
equal keys mean equal KV content. Rules:
* only the full blocks of a prompt's first len(prompt) - 1 tokens are looked up or registered at admission: the
  last prompt token is always fed, because its logits are needed;
* a block registered at admission is *pending* until the owner's prefill has run (mark_ready, at its first
  verdict); a request whose prefix reaches a pending block waits for it rather than computing it twice
  (n > 1 siblings, bursts sharing a system prompt);
* at release the request's full blocks below its last committed position are registered too (commit), so a
  conversation resent with its history finds the previous reply;
* a request's partial last block and every block it may still write are its own: drafts and their rollback
  only ever touch positions past everything shared;
* a block whose last holder leaves stays cached (least recently used first out) and is evicted only when
  fresh blocks are needed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from struct import pack


def chain_hashes(namespace: bytes, tokens, block_size: int, num_blocks: int, parent: bytes = b"") -> list[bytes]:
    """Keys of the first num_blocks full blocks of tokens: block i's key hashes block i-1's key and its tokens."""
    out = []
    h = parent or hashlib.blake2b(namespace, digest_size=16).digest()
    for i in range(num_blocks):
        h = hashlib.blake2b(h + pack(f"<{block_size}q", *tokens[i * block_size:(i + 1) * block_size]),
                            digest_size=16).digest()
        out.append(h)
    return out


@dataclass
class PrefixStats:
    queries: int = 0          # prompt tokens looked up (the cacheable part: all but the last)
    hits: int = 0             # of those, found cached
    evictions: int = 0        # cached blocks dropped to make room

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class _Seq:
    table: list[int]
    keys: list[bytes] = field(default_factory=list)   # keys of its leading full blocks, as far as computed
    registered: list[int] = field(default_factory=list)  # its blocks it registered (pending until ready)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, caching: bool = True, namespace: bytes = b""):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks, self.block_size, self.caching, self.namespace = num_blocks, block_size, caching, namespace
        self.ref = [0] * num_blocks
        self.key: list[bytes | None] = [None] * num_blocks
        self.ready = [False] * num_blocks
        self.by_key: dict[bytes, int] = {}
        self._free = list(range(num_blocks - 1, -1, -1))      # no content worth keeping
        self._lru: OrderedDict[int, None] = OrderedDict()      # cached, held by nobody; oldest first
        self.seqs: dict[object, _Seq] = {}
        self.stats = PrefixStats()

    # -- queries -------------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_available(self) -> int:
        """Blocks a new request could take: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Blocks holding a registered prefix (in use or not)."""
        return len(self.by_key)

    @property
    def used_blocks(self) -> int:
        return sum(1 for r in self.ref if r)

    def _keys(self, prompt) -> list[bytes]:
        n = (len(prompt) - 1) // self.block_size if self.caching else 0
        return chain_hashes(self.namespace, prompt, self.block_size, n)

    def match(self, prompt) -> tuple[list[int], bool]:
        """(the cached ready blocks that start prompt, whether the next block is being computed right now)."""
        hits = []
        for k in self._keys(prompt):
            b = self.by_key.get(k)
            if b is None:
                return hits, False
            if not self.ready[b]:
                return hits, True
            hits.append(b)
        return hits, False

    def cost(self, prompt, reserve_tokens: int) -> tuple[int, bool]:
        """(blocks that admitting it now takes from num_available, whether it should wait for a pending prefix)."""
        hits, pending = self.match(prompt)
        idle_hits = sum(1 for b in hits if self.ref[b] == 0)  # cached, held by nobody: leave the LRU
        return self.blocks_for(reserve_tokens) - len(hits) + idle_hits, pending

    # -- life-cycle ----------------------------------------------------------------------------------
    def admit(self, seq_id, prompt, reserve_tokens: int) -> tuple[list[int], int]:
        """Give seq_id a table for reserve_tokens positions, sharing prompt's cached prefix. Returns (table,
        cached tokens). Raises MemoryError (and changes nothing) when it does not fit."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        keys = self._keys(prompt)
        hits, _ = self.match(prompt)
        need, _ = self.cost(prompt, reserve_tokens)
        if need > self.num_available:
            raise MemoryError(f"need {need} blocks, {self.num_available} available")
        self.stats.queries += len(prompt) - 1 if self.caching else 0
        self.stats.hits += len(hits) * self.block_size
        for b in hits:
            self._lru.pop(b, None)
            self.ref[b] += 1
        fresh = [self._take() for _ in range(self.blocks_for(reserve_tokens) - len(hits))]
        for b in fresh:
            self.ref[b] = 1
        s = _Seq(hits + fresh, keys[:len(hits)])
        self.seqs[seq_id] = s
        self._register(s, keys, ready=False)
        return s.table, len(hits) * self.block_size

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        b, _ = self._lru.popitem(last=False)   # least recently used
        del self.by_key[self.key[b]]
        self.key[b], self.ready[b] = None, False
        self.stats.evictions += 1
        return b

    def _register(self, s: _Seq, keys: list[bytes], ready: bool) -> None:
        for i in range(len(s.keys), len(keys)):
            b = s.table[i]
            s.keys.append(keys[i])
            if keys[i] not in self.by_key and self.key[b] is None:  # the same prefix elsewhere: keep that one
                self.by_key[keys[i]] = b
                self.key[b], self.ready[b] = keys[i], ready
                if not ready:
                    s.registered.append(b)

    def mark_ready(self, seq_id) -> None:
        """seq_id's prefill has run in both workers: what it registered may be shared."""
        s = self.seqs.get(seq_id)
        if s is not None:
            for b in s.registered:
                self.ready[b] = True
            s.registered = []

    def commit(self, seq_id, tokens, num_committed: int) -> None:
        """Register seq_id's full blocks below position num_committed (tokens[:num_committed] are final and
        computed in the workers' caches), so a later request that repeats them shares them."""
        s = self.seqs[seq_id]
        if not self.caching:
            return
        n = min(num_committed, len(tokens)) // self.block_size
        if n > len(s.keys):
            keys = s.keys + chain_hashes(self.namespace, tokens[len(s.keys) * self.block_size:],
                                         self.block_size, n - len(s.keys), s.keys[-1] if s.keys else b"")
            self._register(s, keys, ready=True)

    def free(self, seq_id) -> None:
        s = self.seqs.pop(seq_id, None)
        if s is None:
            return
        pending = set(s.registered)  # never confirmed computed: forget the key
        for b in reversed(s.table):  # tail first, so a prefix's later blocks are evicted before its earlier ones
            self.ref[b] -= 1
            if self.ref[b] < 0:
                raise AssertionError(f"block {b} freed more often than taken")
            if self.ref[b]:
                continue
            if b in pending or self.key[b] is None:
                if self.key[b] is not None:
                    del self.by_key[self.key[b]]
                    self.key[b], self.ready[b] = None, False
                self._free.append(b)
            else:
                self._lru[b] = None   # most recently used end

    def table(self, seq_id) -> list[int]:
        return self.seqs[seq_id].table

    def check(self) -> None:
        """Every invariant of the bookkeeping (tests call it after every operation)."""
        held: dict[int, int] = {}
        for s in self.seqs.values():
            for b in s.table:
                held[b] = held.get(b, 0) + 1
        assert all(self.ref[b] == held.get(b, 0) for b in range(self.num_blocks)), "refcounts disagree with tables"
        free, lru = set(self._free), set(self._lru)
        assert len(free) == len(self._free) and not free & lru, "a block is listed twice"
        for b in range(self.num_blocks):
            idle = self.ref[b] == 0
            assert (b in free or b in lru) == idle, f"block {b}: ref {self.ref[b]} but listed {b in free}/{b in lru}"
            assert b not in free or self.key[b] is None, f"free block {b} still has a key"
            assert b not in lru or (self.key[b] is not None and self.ready[b]), f"idle block {b} is not a ready prefix"
        assert all(self.key[b] == k for k, b in self.by_key.items()), "key index out of date"
        assert sum(k is not None for k in self.key) == len(self.by_key)
