"""Speculative sampling for a whole batch in tensor ops: one host/device sync per verify step.

Three kinds of rows share a batch:
* greedy (temperature 0): accept while the draft equals the target's argmax, then take the argmax;
* sampled, unseeded: standard rejection sampling (accept x with probability min(1, p(x)/q(x)); on the first
  rejection sample norm(max(0, p - q)); after the last kept draft sample p), the law of sampling.accept;
* sampled with a caller's seed ("coupled"): each output token is argmax(log p + G) with Gumbel noise G that
  depends only on (seed, position), an exact sample from p; the drafter proposes argmax(log q + G) with the
  same G, and a draft is accepted when it equals the target's choice. The output is then a function of the
  seed and the target alone: the same whatever shares the batch, however many drafts the row got (Tetris,
  dynamic k), and in every mode, autoregressive included. The price is a lower acceptance than rejection
  sampling when p and q differ (the coupling of "drafter-invariant" speculative decoding).

Random numbers come from minedraft.sampling.rng (a hash of seed, stream, position, draw), never from a generator's
state, so no row's numbers depend on another row's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import rng
from ..sampling_params import SamplingParams


@dataclass
class RowParams:
    """Per-row sampling settings as tensors [B] on one device."""
    greedy: torch.Tensor
    coupled: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    any_greedy: bool
    any_sampled: bool
    any_coupled: bool
    any_top_k: bool
    any_top_p: bool
    any_plain: bool  # sampled rows without a seed: rejection sampling

    @classmethod
    def of(cls, params: list[SamplingParams], seeds: list[int], device="cpu") -> "RowParams":
        greedy = [p.greedy for p in params]
        coupled = [not p.greedy and p.seed is not None for p in params]
        plain = [not p.greedy and p.seed is None for p in params]
        top_k = [0 if p.greedy else p.top_k for p in params]
        top_p = [1.0 if p.greedy else p.top_p for p in params]
        t = lambda xs, dt: torch.tensor(xs, dtype=dt, device=device)  # noqa: E731
        return cls(t(greedy, torch.bool), t(coupled, torch.bool),
                   t([1.0 if p.greedy else p.temperature for p in params], torch.float32),
                   t(top_k, torch.long), t(top_p, torch.float32), t(seeds, torch.long),
                   any(greedy), not all(greedy), any(coupled), any(top_k), any(x < 1.0 for x in top_p), any(plain))


def process_batch(logits: torch.Tensor, rp: RowParams) -> torch.Tensor:
    """logits [B, T, V] -> probabilities [B, T, V], row b processed with its own settings exactly as
    sampling.process_logits does (temperature, then top-k, then top-p; greedy rows get a one-hot)."""
    B, T, V = logits.shape
    x = logits.float() / rp.temperature[:, None, None]
    if rp.any_top_k:
        k = rp.top_k.clamp(1, V)
        kth = torch.sort(x, dim=-1, descending=True).values.gather(-1, (k - 1)[:, None, None].expand(B, T, 1))
        on = ((rp.top_k > 0) & (rp.top_k < V))[:, None, None]
        x = x.masked_fill(on & (x < kth), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if rp.any_top_p:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        top_p = rp.top_p[:, None, None]
        drop = ((torch.cumsum(sorted_p, dim=-1) - sorted_p) >= top_p) & (top_p < 1.0)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if rp.any_greedy:
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(rp.greedy[:, None, None], onehot, probs)
    return probs


def categorical(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [N, V] (need not sum to 1), u [N] uniforms in (0, 1) -> token ids [N].
    A token of probability 0 is never returned (the rounding edge u * total == total included)."""
    cdf = probs.double().cumsum(-1)
    t = (u.double() * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, t, right=True)
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)  # the last token with mass (cdf is flat after it)
    return torch.minimum(idx, last).squeeze(-1)


def _coupled_choice(probs: torch.Tensor, rp: RowParams, pos: torch.Tensor) -> torch.Tensor:
    """argmax(log p + G(seed, pos)) for the coupled rows, [n_coupled, T]; probs [B, T, V], pos [B, T]."""
    idx = rp.coupled.nonzero().squeeze(1)
    g = rng.gumbel(rp.seed[idx, None].expand(-1, pos.shape[1]), pos[idx], probs.shape[-1])
    return (torch.log(probs[idx]) + g).argmax(-1)


def sample_draft_step(logits: torch.Tensor, rp: RowParams, pos: torch.Tensor, draw: torch.Tensor):
    """One draft token per row from logits [B, V] at token positions pos [B].

    Returns (tokens [B] long, q [B, V] or None when every row is greedy, conf [B]): conf is the log of the
    largest draft probability, a function of the context only (never of the token drawn), which Tetris
    ranks on. draw [B] makes a redraft of the same position after a rejection use fresh numbers."""
    tokens = logits.argmax(-1)
    if not rp.any_sampled:
        return tokens, None, torch.log_softmax(logits.float(), -1).max(-1).values
    q = process_batch(logits[:, None], rp)[:, 0]
    conf = torch.log(q.max(-1).values)
    if rp.any_greedy:  # a greedy row's q is a one-hot: rank it by the raw softmax instead
        conf = torch.where(rp.greedy, torch.log_softmax(logits.float(), -1).max(-1).values, conf)
    if rp.any_plain:
        plain = ~rp.greedy & ~rp.coupled
        tokens = torch.where(plain, categorical(q, rng.uniform(rp.seed, rng.DRAFT, pos, draw)), tokens)
    if rp.any_coupled:
        tokens[rp.coupled] = _coupled_choice(q[:, None], rp, pos[:, None])[:, 0]
    return tokens, q, conf


def take_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows [M, V] read at index [B, n] -> [B, n, V] (one copy, no host/device sync)."""
    return rows.index_select(0, index.reshape(-1)).view(*index.shape, rows.shape[-1])


def verify_batch(logits: torch.Tensor, drafts: torch.Tensor, counts: torch.Tensor, q: torch.Tensor | None,
                 rp: RowParams, pos0: torch.Tensor, index: torch.Tensor | None = None
                 ) -> tuple[list[int], list[int]]:
    """Accept or reject every row's drafts at once.

    logits [B, K+1, V]: row b's target logits, position j scoring the token at pos0[b] + j (valid for
    j <= counts[b]); drafts [B, K] (padded past counts[b]); q [B, K, V] draft probabilities or None when
    no row is sampled. With index [B, K+1], logits are distinct rows [M, V] and row b's position j reads
    logits[index[b, j]] (the runner's packed output): a greedy batch then takes each row's argmax once and
    never copies the logits. q None means every draft is deterministic (q one-hot on the drafted token: greedy
    rows, suffix drafts): a sampled row then accepts draft x with probability p(x) and, on a rejection, samples p
    with x removed (norm(max(0, p - onehot(x)))), the same rejection sampling. Returns (accepted drafts per row,
    the token that follows them): one sync."""
    choice = None
    if index is not None:
        if rp.any_sampled:
            logits = take_rows(logits, index)
        else:
            choice = logits.argmax(-1)[index]  # greedy only: each distinct row's argmax, no copy
    B, K = drafts.shape
    T, V = K + 1, logits.shape[-1]
    dev = logits.device
    j = torch.arange(T, device=dev)
    pos = pos0[:, None] + j[None, :]
    match_rows = rp.greedy | rp.coupled
    full = rp.any_top_k or rp.any_top_p or rp.any_coupled
    # without top-k/top-p the processed p is softmax(logits / t): p(draft) needs only a logsumexp per
    # position and a full distribution at one position per row, not p over all [B, K+1, V]
    p = process_batch(logits, rp) if full else None
    x = None if full or not rp.any_plain else logits.float() / rp.temperature[:, None, None]  # greedy: unused
    if choice is None:
        choice = logits.argmax(-1) if rp.any_greedy else torch.zeros(B, T, dtype=torch.long, device=dev)
    if rp.any_coupled:
        choice[rp.coupled] = _coupled_choice(p, rp, pos)
    if K:
        acc = drafts == choice[:, :K]
        if rp.any_plain:
            if full:
                pd = p[:, :K].gather(-1, drafts[..., None]).squeeze(-1)
            else:
                pd = torch.exp(x[:, :K].gather(-1, drafts[..., None]).squeeze(-1) - torch.logsumexp(x[:, :K], -1))
            qd = q.gather(-1, drafts[..., None]).squeeze(-1) if q is not None else torch.ones_like(pd)
            u = rng.uniform(rp.seed[:, None], rng.ACCEPT, pos[:, :K])
            acc = torch.where(match_rows[:, None], acc, u < (pd / qd).double())
        acc &= j[None, :K] < counts[:, None]
        n = acc.long().cumprod(1).sum(1)
    else:
        n = torch.zeros(B, dtype=torch.long, device=dev)
    token = choice.gather(1, n[:, None]).squeeze(1)
    if rp.any_plain:
        at_n = n[:, None, None].expand(B, 1, V)
        pn = (p.gather(1, at_n) if full else torch.softmax(x.gather(1, at_n), -1)).squeeze(1)
        dist = pn
        if K:
            rejected = (n < counts)[:, None]
            if q is not None:
                qn = q.gather(1, n.clamp(max=K - 1)[:, None, None].expand(B, 1, V)).squeeze(1)
                resid = (pn - qn).clamp_min(0)
            else:  # a deterministic draft: p without the rejected token
                resid = pn.scatter(1, drafts.gather(1, n.clamp(max=K - 1)[:, None]), 0.0)
            total = resid.sum(-1, keepdim=True)
            # p == q up to rounding: nothing left to correct, p itself is the right law
            resid = torch.where(total > 1e-12, resid / total.clamp_min(1e-30), pn)
            dist = torch.where(rejected, resid, pn)
        sampled = categorical(dist, rng.uniform(rp.seed, rng.TARGET, pos0 + n))
        token = torch.where(match_rows, token, sampled)
    out = torch.stack([n, token]).tolist()
    return out[0], out[1]
