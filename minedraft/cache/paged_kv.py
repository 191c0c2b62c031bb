"""Paged KV cache for ragged batches.

K and V live in one flat tensor per layer, [num_blocks * block_size, kv_heads, head_dim]. A sequence owns a
list of blocks (its block table) and a length. Every block a sequence may ever need is reserved when it is
admitted, so a running request never runs out of memory mid-flight and nothing has to be preempted; a request
that does not fit waits. Rolling back rejected draft tokens is just lowering the length: the stale entries
past it are never read (the attention mask stops at the length) and get overwritten by the next write.
"""

from __future__ import annotations

import torch


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

    # -- admission and life-cycle ------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.allocator.num_free

    def fits_ever(self, num_tokens: int) -> bool:
        """Whether a sequence this long could be admitted into an empty cache."""
        return self.blocks_for(num_tokens) <= self.num_blocks

    def allocate(self, seq_id, num_tokens: int) -> None:
        """Reserve room for num_tokens positions. Raises MemoryError if it does not fit now."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has cache")
        self._tables[seq_id] = self.allocator.allocate(self.blocks_for(num_tokens))
        self._lengths[seq_id] = 0
        self._capacity[seq_id] = len(self._tables[seq_id]) * self.block_size

    def free(self, seq_id) -> None:
        blocks = self._tables.pop(seq_id, None)
        if blocks is not None:
            self.allocator.free(blocks)
            del self._lengths[seq_id], self._capacity[seq_id]

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._tables

    @property
    def num_seqs(self) -> int:
        return len(self._tables)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.allocator.num_free

    # -- lengths and rollback ----------------------------------------------------------------------
    def length(self, seq_id) -> int:
        return self._lengths[seq_id]

    def truncate(self, seq_id, new_length: int) -> None:
        """Roll back to the first new_length positions (O(1): entries past it are dead)."""
        if not 0 <= new_length <= self._lengths[seq_id]:
            raise ValueError(f"cannot truncate {seq_id!r} from {self._lengths[seq_id]} to {new_length}")
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
