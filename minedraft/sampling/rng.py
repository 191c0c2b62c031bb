"""Counter-based randomness: every random number is a hash of (request seed, stream, position, draw index).

Why not torch.Generator: a generator's output depends on how many numbers were drawn before, so a request's
samples would depend on how many draft tokens it got, which rows shared its batch, and in what order the
rows were processed. A hash of the counters gives each (request, position) its own numbers, computed for a
whole batch in a few integer tensor ops, on any device, with no per-row Python.

The hash is SplitMix64's finalizer (Steele, Lea & Flood 2014), applied in int64 tensor arithmetic, which
wraps on overflow like uint64; right shifts are made logical with a mask.
"""

from __future__ import annotations

import torch

# streams: what the number is for (drafter and verifier must never share a stream by accident)
DRAFT, ACCEPT, TARGET, GUMBEL = 0, 1, 2, 3


def _s64(x: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _s64(0x9E3779B97F4A7C15)
_M1 = _s64(0xBF58476D1CE4E5B9)
_M2 = _s64(0x94D049BB133111EB)
_MASK53 = (1 << 53) - 1


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finalizer on int64 tensors (bit-for-bit the uint64 algorithm)."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def hash_counters(seed: torch.Tensor, stream: int, pos: torch.Tensor, draw: torch.Tensor | int = 0) -> torch.Tensor:
    """int64 hash of broadcastable counter tensors; a chain of mixes, so no two counter tuples collide by
    simple arithmetic (seed + pos vs seed' + pos')."""
    h = mix(seed.long() * 4 + stream)
    h = mix(h ^ pos.long())
    return mix(h ^ (draw.long() if torch.is_tensor(draw) else torch.tensor(draw, dtype=torch.long, device=h.device)))


def uniform(seed: torch.Tensor, stream: int, pos: torch.Tensor, draw: torch.Tensor | int = 0) -> torch.Tensor:
    """float64 uniforms in (0, 1), 53 random bits each (never exactly 0 or 1)."""
    m = _shr(hash_counters(seed, stream, pos, draw), 11) & _MASK53
    return (m.double() + 0.5) * (2.0 ** -53)


def gumbel(seed: torch.Tensor, pos: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [..., vocab] for rows with seed [...] and positions [...]: one per token id, so
    argmax(log p + noise) is an exact sample from p that depends only on (seed, position)."""
    v = torch.arange(vocab, device=pos.device)
    u = uniform(seed[..., None], GUMBEL, pos[..., None], v)
    return (-torch.log(-torch.log(u))).float()
