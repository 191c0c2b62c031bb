"""The slots' shared memory as the engine (the caller's process) makes it: sizes and POSIX segments, without
torch (the workers view the same bytes as tensors: tensors.py)."""

from __future__ import annotations

from multiprocessing import shared_memory

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def slot_nbytes(max_batch: int, max_draft: int, vocab: int) -> int:
    """max_draft: the most drafts one row can carry (k + Tetris extra)."""
    return max_batch * 8 + max_batch * max_draft * 8 + max_batch * max_draft * vocab * 4


def create_shm(num_slots: int, nbytes: int) -> list[shared_memory.SharedMemory]:
    return [shared_memory.SharedMemory(create=True, size=max(nbytes, 8)) for _ in range(num_slots)]


def destroy_shm(segments) -> None:
    for s in segments:
        try:
            s.close()
            s.unlink()
        except FileNotFoundError:
            pass


def feature_slot_nbytes(cfg, hidden: int) -> int:
    """A verdict carries each position's feature once, when the verifier keeps it (a lease's steps included: no
    row joins a batch while it is leased). So it holds at most what its rows can cache (the KV cache bounds
    it) and at most every row's whole life, prompt and output (max_batch_size rows of max_prompt_tokens +
    max_tokens_limit, and the drafts of one step): on a big cache the second bound is far tighter."""
    rows = cfg.max_batch_size * (cfg.max_prompt_tokens + cfg.max_tokens_limit + cfg.max_draft + 1)
    return min(cfg.kv_cache_tokens, rows) * hidden * DTYPE_BYTES[cfg.dtype]
