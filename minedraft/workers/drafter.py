"""The drafter's state machine, free of any transport: draft tokens for a batch, then apply the verdict."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import tetris
from ..batch_sampling import RowParams, sample_draft_step
from ..sampling_params import SamplingParams
from .model_runner import ModelRunner
from .requests import NewRequest


@dataclass
class _DraftSeq:
    tokens: list[int]
    params: SamplingParams
    seed: int
    drafted_from: int | None = None  # len(tokens) when the last draft was made, None once its verdict is in
    rounds: int = 0        # verdicts applied: a redraft of a position draws fresh numbers


class Drafter:
    def __init__(self, runner: ModelRunner, max_k: int):
        """max_k: the most drafts a row may get in one step (k + Tetris extra); the cache reserves for it."""
        self.runner, self.max_k = runner, max_k
        self.seqs: dict[int, _DraftSeq] = {}

    def add(self, req: NewRequest) -> None:
        self.runner.cache.allocate(req.rid, req.cache_tokens(self.max_k))
        self.seqs[req.rid] = _DraftSeq(list(req.prompt_ids), req.params, req.seed)

    def remove(self, rid: int) -> None:
        self.seqs.pop(rid, None)
        self.runner.cache.free(rid)

    def draft(self, rids: list[int], k: int, capacity: int | None = None
              ) -> tuple[list[list[int]], torch.Tensor | None]:
        """Up to k draft tokens per request and, unless every request is greedy, their probabilities
        [B, max kept, V]. capacity (Tetris): keep only that many drafts across the batch, the best-ranked
        prefixes (tetris.select); None keeps all k for every row."""
        k = min(k, self.max_k)
        seqs = [self.seqs[r] for r in rids]
        dev = self.runner.device
        cache = self.runner.cache
        rp = RowParams.of([s.params for s in seqs], [s.seed for s in seqs], dev)
        pos = torch.tensor([len(s.tokens) for s in seqs], dtype=torch.long, device=dev)
        draw = torch.tensor([s.rounds for s in seqs], dtype=torch.long, device=dev)
        feed = [s.tokens[cache.length(r):] for r, s in zip(rids, seqs)]
        toks, qs, confs = [], [], []
        for i in range(k):
            logits = self.runner.forward(rids, feed, 1)[:, 0]
            tok, q, conf = sample_draft_step(logits, rp, pos + i, draw)
            toks.append(tok)
            qs.append(q)
            confs.append(conf)
            feed = [[t] for t in tok.tolist()]  # the one sync per draft position, for the whole batch
        if not k:
            return [[] for _ in rids], None
        for s in seqs:
            s.drafted_from = len(s.tokens)
        tok = torch.stack(toks, 1)
        counts = [k] * len(rids)
        if capacity is not None:
            counts = tetris.select(tetris.scores(torch.stack(confs, 1)), capacity).tolist()
        kept = max(counts)
        drafts = [row[:c] for row, c in zip(tok.tolist(), counts)]
        q = torch.stack(qs, 1)[:, :kept] if qs[0] is not None and kept else None
        return drafts, q

    def apply(self, rid: int, num_accepted: int, new_tokens: list[int]) -> None:
        """Take the verifier's verdict: keep the accepted drafts' cache entries, drop the rest."""
        s = self.seqs[rid]
        s.tokens.extend(new_tokens)
        s.rounds += 1
        if s.drafted_from is not None:  # a step without drafts (k = 0) leaves the cache as it is
            cache = self.runner.cache
            cache.truncate(rid, min(cache.length(rid), s.drafted_from + num_accepted))
            s.drafted_from = None
