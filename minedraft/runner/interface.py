"""What the workers ask of a model runner: the interface ModelRunner implements (and a llama.cpp runner will).

A runner owns one model and its KV cache. Sequences are named by the caller (any hashable id); the runner
keeps, per sequence, how many positions are cached. The cache operations, in a request's life:

* `cache.can_allocate(n)`: whether a sequence of n positions would fit now (admission asks first);
* `cache.allocate(seq_id, n, blocks=None, prompt=None, cached=0)`: reserve room for n positions, so a running
  request never runs out mid-flight. With `blocks` (the scheduler's block table, prefix caching) the leading
  `cached // block_size` blocks hold `prompt`'s prefix and may be shared; returns how many leading positions
  are already computed here (the caller feeds only the rest);
* `forward(...)` appends tokens: each call extends each listed sequence by its new tokens;
* `cache.length(seq_id)`: positions cached so far;
* `cache.truncate(seq_id, n)`: roll back to the first n positions (rejected draft tokens), O(1): what lies past
  the length is never read and is overwritten by the next forward. Never below a committed or shared prefix;
* `cache.commit(seq_id, tokens, upto)`: positions [0, upto) hold tokens[:upto] for good, so their full blocks
  may serve later requests with the same prefix;
* `cache.free(seq_id)`: the sequence is done; its own blocks return to the pool (shared ones stay cached);
* `cache.num_seqs`, `cache.used_blocks`: occupancy, for stats.

Exactness: a row's logits must not depend on which other rows share the call or on how many tokens it scores
at once (batch invariance): speculative decoding's output equals the target decoding alone only then.
"""

from __future__ import annotations

from typing import Hashable, Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class RunnerCache(Protocol):
    num_seqs: int
    used_blocks: int

    def can_allocate(self, num_tokens: int) -> bool: ...

    def allocate(self, seq_id: Hashable, num_tokens: int, blocks: list[int] | None = None,
                 prompt: Sequence[int] | None = None, cached: int = 0) -> int: ...

    def length(self, seq_id: Hashable) -> int: ...

    def truncate(self, seq_id: Hashable, new_length: int) -> None: ...

    def commit(self, seq_id: Hashable, tokens: Sequence[int], upto: int) -> None: ...

    def free(self, seq_id: Hashable) -> None: ...


@runtime_checkable
class Runner(Protocol):
    cache: RunnerCache
    vocab_size: int         # width of the logits (a reduced-vocabulary draft: its target's vocabulary)
    device: torch.device
    dtype: torch.dtype
    fc: object | None       # set for a feature-conditioned (EAGLE-style) draft: forward then takes features

    @property
    def hidden_size(self) -> int: ...

    def forward(self, seq_ids: list, token_lists: list[list[int]], num_logits: int = 1,
                features: list[torch.Tensor] | None = None, hidden: bool = False, packed: bool = False):
        """Append token_lists[i] to sequence seq_ids[i]; return float32 logits [B, num_logits, vocab_size] of
        each row's last num_logits new tokens, right-aligned (a row with fewer new tokens repeats its first
        token's logits in the leading places). packed=True: (rows [M, V], index [B, num_logits]) with
        rows[index] that tensor. hidden=True: (logits, per-row final-norm states [len(tokens_i), H])."""
        ...

    def keep_states(self) -> None:
        """Keep each cached position's final-norm state (the target of a feature-conditioned draft)."""
        ...

    def stored_states(self, seq_id: Hashable, start: int, stop: int) -> torch.Tensor:
        """The kept states of positions [start, stop) of a sequence, [stop - start, H]."""
        ...
