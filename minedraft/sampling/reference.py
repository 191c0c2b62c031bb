"""Lossless speculative sampling, one request at a time: the reference the engine's batched sampler
(minedraft/sampling/batch_sampling.py) is tested and benchmarked against, and the logit processing both share.

Draft and target distributions go through the *same* processing (temperature, then top-k, then top-p) before
they are compared, so the accepted output follows the processed target distribution exactly.
Greedy rows (temperature 0) accept while the draft equals the target's argmax, then take the target's token.
Sampled rows accept draft token x with probability min(1, p(x)/q(x)); on the first rejection they sample from
norm(max(0, p - q)); when all k drafts are accepted they sample a bonus token from p at position k.
"""

from __future__ import annotations

import torch

from ..sampling_params import SamplingParams


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V]; a greedy request gets the one-hot of its argmax."""
    if params.greedy:
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        drop = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_draft(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None):
    """One draft token from logits [V]: returns (token, q [V] or None for greedy)."""
    if params.greedy:
        return int(logits.argmax()), None
    q = process_logits(logits, params)
    return int(torch.multinomial(q, 1, generator=gen)), q


def accept(draft_tokens: list[int], q: torch.Tensor | None, target_logits: torch.Tensor,
           params: SamplingParams, gen: torch.Generator | None,
           target_argmax: list[int] | None = None) -> tuple[int, int]:
    """Verify k drafts of one request.

    draft_tokens: k ints; q: [k, V] draft probabilities (None if greedy); target_logits: [k+1, V];
    target_argmax: its argmax per position when the caller already has it (one device sync for a whole batch).
    Returns (number of accepted drafts n, the token that follows them).
    """
    k = len(draft_tokens)
    if params.greedy:
        target = target_argmax if target_argmax is not None else target_logits.argmax(dim=-1).tolist()
        n = 0
        while n < k and draft_tokens[n] == target[n]:
            n += 1
        return n, target[n]
    p = process_logits(target_logits, params)
    if k:
        idx = torch.arange(k, device=p.device)
        d = torch.tensor(draft_tokens, device=p.device)
        ratio = p[idx, d] / q[idx, d]
        u = torch.rand(k, generator=gen, device=p.device)
        rejected = (u >= ratio).nonzero()
        if len(rejected):
            n = int(rejected[0])
            residual = (p[n] - q[n]).clamp_min(0)
            total = residual.sum()
            # p == q up to rounding: nothing left to correct, p itself is the right law
            residual = residual / total if total > 1e-12 else p[n]
            return n, int(torch.multinomial(residual, 1, generator=gen))
    return k, int(torch.multinomial(p[k], 1, generator=gen))


def make_generator(seed: int, stream: int, device="cpu") -> torch.Generator:
    """Per-request generator; drafter and verifier use different streams of the same seed."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 2 + stream) % (2**63))
    return g
