"""The drafter's state machine, free of any transport: draft k tokens for a batch, then apply the verdict."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..sampling import make_generator, sample_draft
from ..sampling_params import SamplingParams
from .model_runner import ModelRunner
from .requests import NewRequest


@dataclass
class _DraftSeq:
    tokens: list[int]
    params: SamplingParams
    gen: torch.Generator
    drafted_from: int = 0  # len(tokens) when the last draft was made


class Drafter:
    def __init__(self, runner: ModelRunner, max_k: int):
        self.runner, self.max_k = runner, max_k
        self.seqs: dict[int, _DraftSeq] = {}

    def add(self, req: NewRequest) -> None:
        self.runner.cache.allocate(req.rid, req.cache_tokens(self.max_k))
        self.seqs[req.rid] = _DraftSeq(list(req.prompt_ids), req.params,
                                       make_generator(req.seed, 0, self.runner.device))

    def remove(self, rid: int) -> None:
        self.seqs.pop(rid, None)
        self.runner.cache.free(rid)

    def draft(self, rids: list[int], k: int) -> tuple[list[list[int]], torch.Tensor | None]:
        """k draft tokens per request and, unless every request is greedy, their probabilities [B, k, V]."""
        k = min(k, self.max_k)
        seqs = [self.seqs[r] for r in rids]
        cache = self.runner.cache
        drafts: list[list[int]] = [[] for _ in rids]
        sampled = any(not s.params.greedy for s in seqs)
        q = torch.zeros(len(rids), k, self.runner.vocab_size, device=self.runner.device) if sampled and k else None
        feed = [s.tokens[cache.length(r):] for r, s in zip(rids, seqs)]
        greedy = [s.params.greedy for s in seqs]
        for i in range(k):
            logits = self.runner.forward(rids, feed, 1)[:, 0]
            top = logits.argmax(-1).tolist() if any(greedy) else None  # one device sync for all greedy rows
            for b, s in enumerate(seqs):
                if greedy[b]:
                    drafts[b].append(top[b])
                    continue
                tok, probs = sample_draft(logits[b], s.params, s.gen)
                drafts[b].append(tok)
                q[b, i] = probs
            feed = [[d[-1]] for d in drafts]
        for s in seqs:
            s.drafted_from = len(s.tokens)
        return drafts, q

    def apply(self, rid: int, num_accepted: int, new_tokens: list[int]) -> None:
        """Take the verifier's verdict: keep the accepted drafts' cache entries, drop the rest."""
        s = self.seqs[rid]
        s.tokens.extend(new_tokens)
        cache = self.runner.cache
        cache.truncate(rid, min(cache.length(rid), s.drafted_from + num_accepted))
