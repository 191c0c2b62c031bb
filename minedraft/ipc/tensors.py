"""Out-of-band tensor slots for drafts.

The drafter owns one slot per batch id. It writes batch b's draft tokens and draft probabilities into slot b
and broadcasts only a small descriptor. Slot b is written again only after the verifier's verdict for batch b
has come back, and the verifier sends that verdict only after it has finished reading, so the producer keeps
the buffer alive and untouched exactly as long as the consumer needs it, with no extra handshake.

CPU: POSIX shared memory created by the engine (the parent), which unlinks it on shutdown; if the parent is
killed, Python's resource tracker unlinks it. GPU: CUDA memory allocated by the drafter, shared once at start
through torch's CUDA IPC handles; the drafter synchronizes before it broadcasts.
"""

from __future__ import annotations

import math
import pickle
from multiprocessing import shared_memory

import torch

_DTYPES = {"int64": torch.int64, "float32": torch.float32}


def slot_nbytes(max_batch: int, max_k: int, vocab: int) -> int:
    return max_batch * max_k * 8 + max_batch * max_k * vocab * 4


def create_shm(num_slots: int, nbytes: int) -> list[shared_memory.SharedMemory]:
    return [shared_memory.SharedMemory(create=True, size=max(nbytes, 8)) for _ in range(num_slots)]


def destroy_shm(segments) -> None:
    for s in segments:
        try:
            s.close()
            s.unlink()
        except FileNotFoundError:
            pass


class DraftSlots:
    """Views over the slot buffers, the same on both sides."""

    def __init__(self, buffers: list[torch.Tensor], keep=()):
        self.buffers = buffers   # flat uint8 tensors
        self._keep = keep        # SharedMemory objects: must outlive the views

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def attach_shm(cls, names: list[str]) -> "DraftSlots":
        segs = [shared_memory.SharedMemory(name=n) for n in names]
        return cls([torch.frombuffer(s.buf, dtype=torch.uint8) for s in segs], segs)

    @classmethod
    def allocate_cuda(cls, num_slots: int, nbytes: int, device) -> "DraftSlots":
        return cls([torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(num_slots)])

    def cuda_handles(self) -> bytes:
        """Picklable IPC handles (not data) for the consumer; sent once at start."""
        from torch.multiprocessing.reductions import reduce_tensor
        return pickle.dumps([reduce_tensor(b) for b in self.buffers])

    @classmethod
    def attach_cuda(cls, handles: bytes) -> "DraftSlots":
        return cls([fn(*args) for fn, args in pickle.loads(handles)])

    def close(self) -> None:
        self.buffers = []
        for s in self._keep:
            try:
                s.close()
            except BufferError:  # a view is still alive; the OS frees it at exit
                pass
        self._keep = ()

    # -- use ---------------------------------------------------------------------------------------
    def _view(self, slot: int, offset: int, dtype, shape) -> torch.Tensor:
        size = math.prod(shape) * dtype.itemsize
        return self.buffers[slot][offset:offset + size].view(dtype).view(*shape)

    def write(self, slot: int, drafts: list[list[int]], q: torch.Tensor | None) -> dict:
        """Store one batch's drafts; return the descriptor that travels in the message."""
        B, k = len(drafts), len(drafts[0]) if drafts else 0
        if not k:  # autoregressive: nothing to store; skipping the slot saves tensor calls on every step
            return {"slot": slot, "B": B, "k": 0, "V": 0}
        tok = self._view(slot, 0, torch.int64, (B, k))
        tok.copy_(torch.tensor(drafts, dtype=torch.int64).view(B, k))
        desc = {"slot": slot, "B": B, "k": k, "V": 0}
        if q is not None and k:
            V = q.shape[-1]
            self._view(slot, B * k * 8, torch.float32, (B, k, V)).copy_(q)
            desc["V"] = V
        if self.buffers and self.buffers[slot].is_cuda:
            torch.cuda.current_stream(self.buffers[slot].device).synchronize()
        return desc

    def read(self, desc: dict) -> tuple[list[list[int]], torch.Tensor | None]:
        B, k, V, slot = desc["B"], desc["k"], desc["V"], desc["slot"]
        if not k:
            return [[] for _ in range(B)], None
        drafts = self._view(slot, 0, torch.int64, (B, k)).tolist()
        q = self._view(slot, B * k * 8, torch.float32, (B, k, V)) if V else None
        return drafts, q
