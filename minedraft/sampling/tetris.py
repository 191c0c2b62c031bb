"""Tetris: fill the verifier's per-step token budget with the draft prefixes most likely to be accepted.

The drafter drafts up to k + e tokens per row; Tetris keeps, across the whole batch, the `capacity` draft
positions with the highest score, where the score of a row's j-th draft is the sum of the log confidences
(log of the largest draft probability) of its drafts 1..j. Each row keeps a prefix, possibly empty.

Why confidences, not the drafted tokens' own probabilities: the decision to keep draft j must not look at
draft j itself. A sampled draft kept *because* it came out likely is no longer distributed as q, and
rejection sampling against q would then be biased. Confidence j depends only on the context of draft j
(the earlier drafts), and scores never grow along a row, so whether draft j is kept depends on earlier
drafts and on other rows only, and the output law stays exactly the target's (tests/sampling/test_tetris.py shows
the chi-square test rejecting the variant that ranks on the drawn tokens' probabilities). For a greedy
row the two coincide: its draft is the argmax.

Ties go to the earlier position (then the lower row), so a row's later draft never outranks its earlier
one and every row's kept set is a prefix.
"""

from __future__ import annotations

import torch


def scores(conf: torch.Tensor) -> torch.Tensor:
    """conf [B, K] log confidences -> cumulative scores [B, K] (non-increasing along each row)."""
    return conf.float().cumsum(-1)


def select(score: torch.Tensor, capacity: int) -> torch.Tensor:
    """Drafts kept per row [..., B] (long): the `capacity` best positions of score [..., B, K] (each leading
    index is a separate batch), a prefix of each row."""
    *lead, B, K = score.shape
    if capacity <= 0 or K == 0:
        return torch.zeros(*lead, B, dtype=torch.long, device=score.device)
    if capacity >= B * K:
        return torch.full((*lead, B), K, dtype=torch.long, device=score.device)
    flat = score.transpose(-1, -2).reshape(*lead, K * B)  # position-major: ties go to the earlier position
    order = torch.sort(flat, dim=-1, descending=True, stable=True).indices[..., :capacity]
    return torch.nn.functional.one_hot(order % B, B).sum(-2)
