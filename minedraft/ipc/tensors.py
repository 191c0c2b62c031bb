"""Out-of-band tensor slots: drafts (drafter -> verifier) and target features (verifier -> drafter).

The drafter owns one draft slot per batch id. It writes batch b's draft tokens and draft probabilities into slot b
and broadcasts only a small descriptor. Slot b is written again only after the verifier's verdict for batch b
has come back, and the verifier sends that verdict only after it has finished reading, so the producer keeps
the buffer alive and untouched exactly as long as the consumer needs it, with no extra handshake.

CPU: POSIX shared memory created by the engine (the parent, through shm.py, which needs no torch), which unlinks it on shutdown; if the parent is
killed, Python's resource tracker unlinks it. GPU: CUDA memory allocated by the drafter, shared once at start
through torch's CUDA IPC handles; the drafter synchronizes before it broadcasts.

Feature slots run the other way, for a feature-conditioned draft (EAGLE-style, drafting/drafter.py): with each
verdict the verifier writes the target's final-norm hidden states of the positions it kept into feature slot b,
and the drafter copies them out when it takes that verdict, before it drafts batch b again; the verifier writes
slot b again only after that batch's next drafts. On GPU the verifier allocates them and sends the handles.
"""

from __future__ import annotations

import math
import pickle
from multiprocessing import shared_memory

import torch

from .messages import DraftsDesc, FeatureDesc

_DTYPES = {"int64": torch.int64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class _Slots:
    """Views over the slot buffers, the same on both sides."""

    def __init__(self, buffers: list[torch.Tensor], keep=()):
        self.buffers = buffers   # flat uint8 tensors
        self._keep = keep        # SharedMemory objects: must outlive the views

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def attach_shm(cls, names: list[str]):
        segs = [shared_memory.SharedMemory(name=n) for n in names]
        return cls([torch.frombuffer(s.buf, dtype=torch.uint8) for s in segs], segs)

    @classmethod
    def allocate_cuda(cls, num_slots: int, nbytes: int, device):
        return cls([torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(num_slots)])

    def cuda_handles(self) -> bytes:
        """Picklable IPC handles (not data) for the consumer; sent once at start."""
        from torch.multiprocessing.reductions import reduce_tensor
        return pickle.dumps([reduce_tensor(b) for b in self.buffers])

    @classmethod
    def attach_cuda(cls, handles: bytes):
        return cls([fn(*args) for fn, args in pickle.loads(handles)])

    def close(self) -> None:
        self.buffers = []
        for s in self._keep:
            try:
                s.close()
            except BufferError:  # a view is still alive; the OS frees it at exit
                pass
        self._keep = ()

    def _view(self, slot: int, offset: int, dtype, shape) -> torch.Tensor:
        size = math.prod(shape) * dtype.itemsize
        return self.buffers[slot][offset:offset + size].view(dtype).view(*shape)

    def _sync(self, slot: int) -> None:
        if self.buffers and self.buffers[slot].is_cuda:
            torch.cuda.current_stream(self.buffers[slot].device).synchronize()


class DraftSlots(_Slots):

    def write(self, slot: int, drafts: list[list[int]], q: torch.Tensor | None) -> DraftsDesc:
        """Store one batch's drafts (rows may differ in length: Tetris); return the descriptor that travels
        in the message. Layout: counts [B], tokens [B, k] padded with 0, q [B, k, V]; k = the longest row."""
        B = len(drafts)
        counts = [len(d) for d in drafts]
        k = max(counts, default=0)
        if not k:  # no drafts (autoregressive, k = 0): nothing to store; skipping the slot saves tensor calls
            return DraftsDesc(slot, B, 0, 0)
        self._view(slot, 0, torch.int64, (B,)).copy_(torch.tensor(counts, dtype=torch.int64))
        tok = self._view(slot, B * 8, torch.int64, (B, k))
        tok.copy_(torch.tensor([d + [0] * (k - len(d)) for d in drafts], dtype=torch.int64).view(B, k))
        V = 0
        if q is not None:
            V = q.shape[-1]
            self._view(slot, B * 8 + B * k * 8, torch.float32, (B, k, V)).copy_(q)
        self._sync(slot)
        return DraftsDesc(slot, B, k, V)

    def read(self, desc: DraftsDesc) -> tuple[list[list[int]], torch.Tensor | None]:
        B, k, V, slot = desc.rows, desc.width, desc.vocab, desc.slot
        if not k:
            return [[] for _ in range(B)], None
        counts = self._view(slot, 0, torch.int64, (B,)).tolist()
        rows = self._view(slot, B * 8, torch.int64, (B, k)).tolist()
        drafts = [r[:c] for r, c in zip(rows, counts)]
        q = self._view(slot, B * 8 + B * k * 8, torch.float32, (B, k, V)) if V else None
        return drafts, q


class FeatureSlots(_Slots):
    def write(self, slot: int, rows: list[torch.Tensor]) -> FeatureDesc:
        """Store one verdict's features, row after row ([n_i, H] each, n_i may be 0); return the descriptor."""
        counts = [int(r.shape[0]) for r in rows]
        n = sum(counts)
        H = next((int(r.shape[1]) for r in rows if r.shape[0]), 0)
        if n:
            flat = torch.cat([r for r in rows if r.shape[0]])
            dt = _DTYPES[str(flat.dtype).removeprefix("torch.")]
            size = n * H * dt.itemsize
            if size > self.buffers[slot].numel():
                raise RuntimeError(f"a verdict's features ({size} bytes) exceed the feature slot "
                                   f"({self.buffers[slot].numel()} bytes)")
            self._view(slot, 0, dt, (n, H)).copy_(flat)
            self._sync(slot)
            return FeatureDesc(slot, counts, H, str(dt).removeprefix("torch."))
        return FeatureDesc(slot, counts, 0, "float32")

    def read(self, desc: FeatureDesc) -> list[torch.Tensor]:
        """Copies (the verifier reuses the slot), one [n_i, H] tensor per row."""
        counts, H = desc.counts, desc.hidden
        n = sum(counts)
        if not n:
            return [torch.empty(0, 0) for _ in counts]
        flat = self._view(desc.slot, 0, _DTYPES[desc.dtype], (n, H)).clone()
        return list(flat.split(counts))
