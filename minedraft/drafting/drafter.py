"""The drafter's state machine, free of any transport: draft tokens for a batch, then apply the verdict.

Two kinds of draft: an ordinary causal LM that sees tokens only, and a feature-conditioned one (EAGLE-style; the
runner's `fc`, see model_runner.load_feature_fc) whose input at each position also carries the target's
final-norm hidden state of the position before. The latter drafts a row only once the verifier has sent the
features of everything before its last token (a new request waits one step: its first step is plain decoding),
feeds drafted positions with its own guesses of those features, and after each verdict drops every drafted
position from its cache to feed the accepted ones again with the target's real features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import tetris
from ..sampling.batch_sampling import RowParams, sample_draft_step
from ..controls.logits import Controls, RowControl, process_rows
from ..sampling_params import SamplingParams
from ..runner.model_runner import ModelRunner
from ..ipc.messages import NewRequest


@dataclass
class _DraftSeq:
    tokens: list[int]
    params: SamplingParams
    seed: int
    drafted_from: int | None = None  # len(tokens) when the last draft was made, None once its verdict is in
    rounds: int = 0        # verdicts applied: a redraft of a position draws fresh numbers
    feats: torch.Tensor | None = None  # feature-conditioned draft: target features not yet fed, from the one
    #                                    before the first unfed token (a zero row stands before token 0)
    ctl: RowControl | None = None      # penalties / logit bias / grammar (controls/logits.py), None without
    skip: int = 0          # features still to drop from the head of the stream: those of a cached prefix
    fresh: bool = True     # not in a step yet: its first step drafts nothing (see Drafter.draft)


class Drafter:
    def __init__(self, runner: ModelRunner, max_draft: int, controls: Controls | None = None):
        """max_draft: the most drafts a row may get in one step (k + Tetris extra); the cache reserves for it.
        controls: builds requests' output controls (the same as the verifier's: eos ids, tokenizer)."""
        self.runner, self.max_draft = runner, max_draft
        self.controls = controls or Controls(runner.vocab_size, (), None)
        self.seqs: dict[int, _DraftSeq] = {}
        self.features = runner.fc is not None  # the verifier must send its features with each verdict

    def add(self, req: NewRequest) -> None:
        cached = self.runner.cache.allocate(req.rid, req.cache_tokens(self.max_draft), req.blocks, req.prompt_ids,
                                            req.cached)
        s = _DraftSeq(list(req.prompt_ids), req.params, req.seed, skip=cached)
        s.ctl = self.controls.make(req.params, s.tokens)
        if self.features:  # the verifier sends features from position 0 on: drop those of the cached prefix
            self._take_features(s, torch.zeros(1, self.runner.fc.in_features - self.runner.hidden_size,
                                               dtype=self.runner.dtype, device=self.runner.device))
        self.seqs[req.rid] = s

    @staticmethod
    def _take_features(s: _DraftSeq, f: torch.Tensor) -> None:
        f = f if s.feats is None else torch.cat([s.feats, f.to(s.feats)])
        drop = min(s.skip, f.shape[0])
        s.feats, s.skip = f[drop:], s.skip - drop

    def _ready(self, rid: int, s: _DraftSeq) -> bool:
        """Whether the row drafts this step: not with a per-request budget of 0 (SamplingParams.max_drafts),
        and a feature-conditioned draft needs a feature for every unfed token (the verifier's come a step later)."""
        if s.params.max_drafts == 0:
            return False
        return not self.features or s.feats.shape[0] >= len(s.tokens) - self.runner.cache.length(rid)

    def remove(self, rid: int, last_tokens=()) -> None:
        """Drop a request (finished: last_tokens are its final verdict's, which a model draft has no use for)."""
        self.seqs.pop(rid, None)
        self.runner.cache.free(rid)

    def draft(self, rids: list[int], k: int, capacity: int | None = None
              ) -> tuple[list[list[int]], torch.Tensor | None]:
        """Up to k draft tokens per request and, unless every request is greedy, their probabilities
        [B, max kept, V]. capacity (Tetris): keep only that many drafts across the batch, the best-ranked
        prefixes (tetris.select); None keeps all k for every row."""
        k = min(k, self.max_draft)
        # A row's first step drafts nothing: its draft prefill (a whole prompt through the draft model) would
        # otherwise come before the target's prefill and delay the first token by it. The drafter process
        # runs that prefill right after sending the step (prefill), while the verifier prefills the target.
        fresh = {r for r in rids if self.seqs[r].fresh}
        for r in fresh:
            self.seqs[r].fresh = False
        if not k:
            return [[] for _ in rids], None
        ready = [i for i, r in enumerate(rids) if r not in fresh and self._ready(r, self.seqs[r])]
        if len(ready) < len(rids):  # rows without a budget or still waiting for features draft nothing
            sub, q = self.draft([rids[i] for i in ready], k, capacity) if ready else ([], None)
            drafts = [[] for _ in rids]
            for i, d in zip(ready, sub):
                drafts[i] = d
            if q is not None:
                full = q.new_zeros(len(rids), *q.shape[1:])
                full[ready] = q
                q = full
            return drafts, q
        seqs = [self.seqs[r] for r in rids]
        dev = self.runner.device
        cache = self.runner.cache
        rp = RowParams.of([s.params for s in seqs], [s.seed for s in seqs], dev)
        pos = torch.tensor([len(s.tokens) for s in seqs], dtype=torch.long, device=dev)
        draw = torch.tensor([s.rounds for s in seqs], dtype=torch.long, device=dev)
        feed = [s.tokens[cache.length(r):] for r, s in zip(rids, seqs)]
        feats = None
        if self.features:  # the target's features of the fed tokens; the rest wait for the next feed
            feats = [s.feats[:len(f)] for s, f in zip(seqs, feed)]
            for s, f in zip(seqs, feed):
                s.feats = s.feats[len(f):]
        ctls = [s.ctl for s in seqs]
        controlled = any(c is not None for c in ctls)
        toks, qs, confs = [], [], []
        for i in range(k):
            if feats is None:
                logits = self.runner.forward(rids, feed, 1)[:, 0]
            else:
                logits, states = self.runner.forward(rids, feed, 1, features=feats, hidden=True)
                logits = logits[:, 0]
                feats = [h[-1:] for h in states]  # its guess of the target's feature, before the next draft
            if controlled:  # this position's penalties / mask, from the history and the drafts before it
                logits = process_rows(logits, ctls)
            tok, q, conf = sample_draft_step(logits, rp, pos + i, draw)
            toks.append(tok)
            qs.append(q)
            confs.append(conf)
            feed = [[t] for t in tok.tolist()]  # the one sync per draft position, for the whole batch
            if controlled:
                for c, f in zip(ctls, feed):
                    if c is not None:
                        c.push(f)
        tok = torch.stack(toks, 1)
        if controlled:  # back to the verified history: a draft leaves no trace in the controls
            for c, row in zip(ctls, tok.tolist()):
                if c is not None:
                    c.pop(row)
        for r, s in zip(rids, seqs):
            s.drafted_from = len(s.tokens)
            cache.commit(r, s.tokens, len(s.tokens))  # what it fed before its drafts is final
        budget = [k if s.params.max_drafts is None else min(k, s.params.max_drafts) for s in seqs]
        counts = budget
        if capacity is not None:
            conf = torch.stack(confs, 1)
            if min(budget) < k:  # positions past a row's budget rank last: the capacity goes to other rows
                j = torch.arange(k, device=conf.device)[None, :]
                conf = conf.masked_fill(j >= torch.tensor(budget, device=conf.device)[:, None], float("-inf"))
            counts = [min(c, b) for c, b in zip(tetris.select(tetris.scores(conf), capacity).tolist(), budget)]
        kept = max(counts)
        drafts = [row[:c] for row, c in zip(tok.tolist(), counts)]
        q = torch.stack(qs, 1)[:, :kept] if qs[0] is not None and kept else None
        return drafts, q

    def prefill(self, rids: list[int]) -> None:
        """Feed new rows' prompts into the draft model's cache now (their first step drafted nothing), so their
        next draft feeds only the prompt's last token and the verdict's. A feature-conditioned draft waits for the target's features
        of the prompt, which come with the first verdict."""
        rids = [r for r in rids if r in self.seqs]
        for r in rids:
            self.seqs[r].fresh = False
        cache = self.runner.cache
        # all but the last token: a draft always feeds at least one (its logits are the first draft's)
        feed = [(r, self.seqs[r].tokens[cache.length(r):-1]) for r in rids]
        feed = [(r, f) for r, f in feed if f]
        if self.features or not feed:
            return
        self.runner.forward([r for r, _ in feed], [f for _, f in feed], 1)
        for r, f in feed:
            s = self.seqs[r]
            cache.commit(r, s.tokens, cache.length(r))

    def apply(self, rid: int, num_accepted: int, new_tokens: list[int], features: torch.Tensor | None = None
              ) -> None:
        """Take the verifier's verdict: keep the accepted drafts' cache entries, drop the rest. A
        feature-conditioned draft keeps none (they were fed with its own guesses) and takes the target's
        features of the positions the verifier kept."""
        s = self.seqs[rid]
        s.tokens.extend(new_tokens)
        s.rounds += 1
        if s.ctl is not None:
            s.ctl.push(new_tokens)
        if self.features:
            if features is None:
                raise RuntimeError("a feature-conditioned draft needs the verifier's features with each verdict")
            self._take_features(s, features)
        if s.drafted_from is not None:  # a step without drafts (k = 0) leaves the cache as it is
            cache = self.runner.cache
            kept = s.drafted_from if self.features else s.drafted_from + num_accepted
            cache.truncate(rid, min(cache.length(rid), kept))
            cache.commit(rid, s.tokens, len(s.tokens))
            s.drafted_from = None
