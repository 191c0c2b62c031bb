"""The verifier's state machine, free of any transport: score drafts with the target and sample the verdict."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling.batch_sampling import RowParams, take_rows, verify_batch
from ..controls.logits import Controls, RowControl, process_positions
from ..sampling.logprobs import token_logprobs
from ..sampling_params import SamplingParams
from ..runner.model_runner import ModelRunner
from ..ipc.messages import NewRequest, StepResult


@dataclass
class _VerifySeq:
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    ctl: RowControl | None = None  # penalties / logit bias / grammar (controls/logits.py), None without
    cached: int = 0        # prompt positions found in the prefix cache (not computed)
    fresh: bool = True     # no step yet


class Verifier:
    def __init__(self, runner: ModelRunner, max_draft: int, eos_token_ids: list[int], features: bool = False,
                 tokenizer_dir: str | None = None):
        """max_draft: the most drafts a row may carry in one step (k + Tetris extra); the cache reserves for it.
        features: keep the target's features of the kept positions of each result in last_features (the draft
        is feature-conditioned, drafting/drafter.py). tokenizer_dir: where structured output finds the tokenizer."""
        self.runner, self.max_draft, self.features = runner, max_draft, features
        self.eos = frozenset(eos_token_ids)
        self.controls = Controls(runner.vocab_size, eos_token_ids, tokenizer_dir)
        self.seqs: dict[int, _VerifySeq] = {}
        # per result row of the last verify(): its features ([n, H] tensor; None when finished or not features);
        # tensors stay out of StepResult, which is a message
        self.last_features: list = []
        if features:
            runner.keep_states()

    def add(self, req: NewRequest) -> None:
        cached = self.runner.cache.allocate(req.rid, req.cache_tokens(self.max_draft), req.blocks, req.prompt_ids,
                                            req.cached)
        p = req.params
        stop = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos)
        s = self.seqs[req.rid] = _VerifySeq(list(req.prompt_ids), len(req.prompt_ids), p, req.seed, stop,
                                            cached=cached)
        s.ctl = self.controls.make(p, s.tokens)

    def remove(self, rid: int) -> None:
        self.seqs.pop(rid, None)
        self.runner.cache.free(rid)

    def verify(self, rids: list[int], drafts: list[list[int]], q: torch.Tensor | None) -> list[StepResult]:
        """One target forward over every request's unverified tail plus its own drafts (rows may have
        different draft counts), acceptance for the whole batch in tensor ops; finished ones are freed."""
        dev = self.runner.device
        counts = [len(d) for d in drafts]
        K = max(counts, default=0)
        if q is not None:
            q = q.to(dev)  # the drafter's device may be another GPU; no copy when it is the same
        seqs = [self.seqs[r] for r in rids]
        cache = self.runner.cache
        feed = [s.tokens[cache.length(r):] + d for r, s, d in zip(rids, seqs, drafts)]
        states = None
        if self.features:
            (rows, index), states = self.runner.forward(rids, feed, K + 1, hidden=True, packed=True)
        else:
            rows, index = self.runner.forward(rids, feed, K + 1, packed=True)
        counts_t = torch.tensor(counts, dtype=torch.long, device=dev)
        if K and min(counts) < K:  # right-aligned by the runner -> position j of row b at column j
            index = index.gather(1, (K - counts_t[:, None] + torch.arange(K + 1, device=dev)[None, :]).clamp(max=K))
        pad = torch.tensor([d + [0] * (K - len(d)) for d in drafts], dtype=torch.long, device=dev).view(len(rids), K)
        rp = RowParams.of([s.params for s in seqs], [s.seed for s in seqs], dev)
        pos0 = torch.tensor([len(s.tokens) for s in seqs], dtype=torch.long, device=dev)
        ctls = [s.ctl for s in seqs]
        if any(c is not None for c in ctls):  # each position's controls, from the history and drafts before it
            logits = process_positions(take_rows(rows, index), ctls, drafts)
            ns, toks = verify_batch(logits, pad, counts_t, q, rp, pos0)
        else:
            ns, toks = verify_batch(rows, pad, counts_t, q, rp, pos0, index)  # copies the logits once at most
        results = []
        self.last_features = feats_out = []
        for i, (rid, s, d, c, n, tok) in enumerate(zip(rids, seqs, drafts, counts, ns, toks)):
            new, reason = self._cut(s, d[:n] + [tok])
            s.tokens.extend(new)
            results.append(StepResult(rid, new, c, n, reason, s.prompt_len - s.cached if s.fresh else 0))
            if s.params.logprobs is not None:  # the target's raw law at each emitted position
                results[-1].logprobs = token_logprobs(rows.index_select(0, index[i, :len(new)]), new,
                                                      s.params.logprobs)
            if s.ctl is not None and not reason:
                s.ctl.push(new)
            f = None
            if states is not None and not reason:  # the unverified tail and the accepted drafts
                f = states[i][:len(feed[i]) - c + n]
                if s.fresh and s.cached:  # the draft's features start at position 0 whatever was cached
                    f = torch.cat([self.runner.stored_states(rid, 0, s.cached), f])
            feats_out.append(f)
            s.fresh = False
            if reason:
                self.remove(rid)
            else:
                cache.truncate(rid, len(s.tokens) - 1)  # the newest token is fed next step
                cache.commit(rid, s.tokens, len(s.tokens) - 1)
        return results

    @staticmethod
    def _cut(s: _VerifySeq, new: list[int]) -> tuple[list[int], str | None]:
        room = s.params.max_tokens - (len(s.tokens) - s.prompt_len)
        for i, t in enumerate(new[:room]):
            if t in s.stop_ids:
                return new[:i + 1], "stop"   # the stop token ends token_ids (RequestState keeps its text out)
        if len(new) >= room:
            return new[:room], "length"
        return new, None
