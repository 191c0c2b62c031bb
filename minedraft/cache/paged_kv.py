"""Paged KV cache for ragged batches.

K and V live in one flat tensor per layer, [num_blocks * block_size, kv_heads, head_dim]. A sequence owns a
list of blocks (its block table) and a length. Every block a sequence may ever need is reserved when it is
admitted, so a running request never runs out of memory mid-flight and nothing has to be preempted; a request
that does not fit waits. Rolling back rejected draft tokens is just lowering the length: the stale entries
past it are never read (the attention mask stops at the length) and get overwritten by the next write.

With prefix caching the scheduler's BlockManager (blocks.py) hands each request its block table, some of whose
leading blocks it shares with other requests (`allocate(..., blocks=, prompt=, cached=)`). This cache then only
keeps its own record of which blocks hold which prefix (`commit` records a block once every position in it is
final), so a shared block is skipped only if this worker really has computed it; otherwise (a draft that has not
fed that far yet) the request computes it, writing the same tokens there. A sequence never rolls back into a
block it has committed or shares, and writes only past its length, so a shared block is never changed.
"""

from __future__ import annotations

import torch

from .blocks import chain_hashes


class BlockAllocator:
    """Free list of block ids; raises on double free so a bookkeeping bug cannot go unnoticed."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"need {n} blocks, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"block {b} freed twice or never allocated")
            self._used.remove(b)
            self._free.append(b)


class PagedKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_tokens: int,
                 block_size: int = 16, dtype=torch.float32, device="cpu"):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.num_blocks = max(1, num_tokens // block_size)
        self.allocator = BlockAllocator(self.num_blocks)
        shape = (self.num_blocks * block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.device = torch.device(device)
        self._tables: dict[object, list[int]] = {}
        self._lengths: dict[object, int] = {}
        self._capacity: dict[object, int] = {}
        self._content: dict[int, bytes] = {}     # block -> key of the prefix it holds (full, final positions)
        self._keys: dict[object, list[bytes]] = {}  # per sequence: keys of its leading full blocks recorded
        self._own: set = set()                   # sequences whose blocks came from self.allocator

    # -- admission and life-cycle ------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.allocator.num_free

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether a sequence this long could be admitted into an empty cache."""
        return self.blocks_for(num_tokens) <= self.num_blocks

    def allocate(self, seq_id, num_tokens: int, blocks: list[int] | None = None, prompt=None, cached: int = 0,
                 start: int | None = None) -> int:
        """Reserve room for num_tokens positions; returns how many leading positions are already computed.

        Without blocks, take them from this cache's own free list (raises MemoryError if they do not fit now).
        With blocks (the scheduler's table), use them: the first cached // block_size are shared with other
        requests and hold prompt's prefix; those this worker has computed are skipped. start (tensor-parallel
        followers) sets the skipped length the leader found instead of looking it up."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has cache")
        need = self.blocks_for(num_tokens)
        if blocks is None:
            table = self.allocator.allocate(need)
            self._own.add(seq_id)
        else:
            if len(blocks) < need or not all(0 <= b < self.num_blocks for b in blocks):
                raise ValueError(f"table of {len(blocks)} blocks cannot hold {num_tokens} positions here")
            table = list(blocks)
        n_shared = cached // self.block_size
        for b in table[n_shared:]:  # fresh for this sequence: whatever they held is gone
            self._content.pop(b, None)
        keys = []
        if start is None:
            want = chain_hashes(b"", prompt, self.block_size, n_shared) if n_shared else []
            for b, k in zip(table, want):
                if self._content.get(b) != k:
                    break
                keys.append(k)
            start = len(keys) * self.block_size
        self._tables[seq_id], self._lengths[seq_id], self._keys[seq_id] = table, start, keys
        self._capacity[seq_id] = len(table) * self.block_size
        return start

    def commit(self, seq_id, tokens, upto: int) -> None:
        """Positions [0, upto) of seq_id hold tokens[:upto] for good: record its full blocks below that (and its
        length) as computed, so a request given them as shared skips them."""
        keys = self._keys[seq_id]
        n = min(upto, self._lengths[seq_id], len(tokens)) // self.block_size
        if n > len(keys):
            bs = self.block_size
            new = chain_hashes(b"", tokens[len(keys) * bs:], bs, n - len(keys), keys[-1] if keys else b"")
            for i, k in enumerate(new, len(keys)):
                self._content[self._tables[seq_id][i]] = k
            keys += new

    def frozen(self, seq_id) -> int:
        """Positions a rollback may not go below (once reached): shared or committed blocks."""
        return len(self._keys[seq_id]) * self.block_size

    def free(self, seq_id) -> None:
        blocks = self._tables.pop(seq_id, None)
        if blocks is not None:
            if seq_id in self._own:
                self._own.discard(seq_id)
                self.allocator.free(blocks)
            del self._lengths[seq_id], self._capacity[seq_id], self._keys[seq_id]

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._tables

    @property
    def num_seqs(self) -> int:
        return len(self._tables)

    @property
    def used_blocks(self) -> int:
        if len(self._own) == len(self._tables):
            return self.num_blocks - self.allocator.num_free
        return len({b for t in self._tables.values() for b in t})

    # -- lengths and rollback ----------------------------------------------------------------------
    def length(self, seq_id) -> int:
        return self._lengths[seq_id]

    def truncate(self, seq_id, new_length: int) -> None:
        """Roll back to the first new_length positions (O(1): entries past it are dead)."""
        old = self._lengths[seq_id]
        if not min(old, self.frozen(seq_id)) <= new_length <= old:
            raise ValueError(f"cannot truncate {seq_id!r} from {old} to {new_length} (committed or shared up to "
                             f"{self.frozen(seq_id)})")
        self._lengths[seq_id] = new_length

    # -- addressing --------------------------------------------------------------------------------
    def slots(self, seq_id, start: int, stop: int) -> torch.Tensor:
        """Flat cache indices of positions [start, stop) of a sequence."""
        if stop > self._capacity[seq_id]:
            raise MemoryError(f"sequence {seq_id!r} needs {stop} positions, reserved {self._capacity[seq_id]}")
        table = torch.tensor(self._tables[seq_id], dtype=torch.long)
        pos = torch.arange(start, stop)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def batch_slots(self, seq_ids: list, totals: list[int]) -> torch.Tensor:
        """[B, max(totals)] flat cache indices of positions [0, totals[b]) of each sequence (0 past the end)."""
        for sid, n in zip(seq_ids, totals):
            if n > self._capacity[sid]:
                raise MemoryError(f"sequence {sid!r} needs {n} positions, reserved {self._capacity[sid]}")
        S = max(totals)
        nb = self.blocks_for(S)
        rows = [self._tables[sid][:nb] for sid in seq_ids]
        tables = torch.tensor([r + [0] * (nb - len(r)) for r in rows], dtype=torch.long)  # one call for the batch
        pos = torch.arange(S)
        slots = tables[:, pos // self.block_size] * self.block_size + pos % self.block_size
        return slots.masked_fill(pos[None, :] >= torch.tensor(totals)[:, None], 0)

    def extend(self, seq_id, n: int) -> None:
        new = self._lengths[seq_id] + n
        if new > self._capacity[seq_id]:
            raise MemoryError(f"sequence {seq_id!r} would hold {new} positions, reserved {self._capacity[seq_id]}")
        self._lengths[seq_id] = new
