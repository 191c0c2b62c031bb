"""Drafts from the text itself (draft="suffix"), alone or with a draft model (draft="suffix+<model>").

`SuffixDrafter` has the Drafter's interface (add, remove, draft, apply) so the drafter process and LocalEngine
drive either the same way. Its drafts come from minedraft.drafting.suffix_index: deterministic proposals, sent without
probabilities (q None: one-hot on the proposed token, which batch_sampling.verify_batch treats exactly), a row
with no match drafting nothing (the verifier takes ragged rows). No draft model is loaded for "suffix".

Hybrid: each step, rows whose suffix proposal scores at least `threshold` (the expected number of its tokens the
target accepts, drafting/suffix_index.py) take it; the others get the model's draft, drafted for them alone. When some
row is sampled and the model drafted, q holds the model's probabilities for its rows and a one-hot for each
suffix row. `sources` names, after each draft, where each row's draft came from ("suffix", "model" or "").
"""

from __future__ import annotations

import torch

from .suffix_index import SuffixConfig, SuffixIndex
from ..ipc.messages import NewRequest


class SuffixDrafter:
    features = False  # never reads the target's features (a hybrid's model draft must not either)

    def __init__(self, max_k: int, cfg: SuffixConfig | None = None, model=None, threshold: float = 1.0):
        """model: a Drafter for the hybrid, None for suffix drafts alone."""
        if model is not None and model.features:
            raise ValueError("a hybrid suffix draft needs a token-only draft model, not a feature-conditioned one")
        self.max_k, self.model, self.threshold = max_k, model, threshold
        self.index = SuffixIndex(cfg)
        self.sources: list[str] = []
        self.budgets: dict[int, int] = {}  # rows with a per-request draft budget (SamplingParams.max_drafts)

    def add(self, req: NewRequest) -> None:
        self.index.add(req.rid, req.prompt_ids)
        if req.params.max_drafts is not None:
            self.budgets[req.rid] = req.params.max_drafts
        if self.model:
            self.model.add(req)

    def remove(self, rid: int, last_tokens=()) -> None:
        self.index.extend(rid, list(last_tokens))  # a finished request's last step: its whole output is published
        self.index.remove(rid)  # its output joins the global index
        self.budgets.pop(rid, None)
        if self.model:
            self.model.remove(rid, last_tokens)

    def prefill(self, rids: list[int]) -> None:
        if self.model:
            self.model.prefill(rids)

    def apply(self, rid: int, num_accepted: int, new_tokens: list[int], features=None) -> None:
        self.index.extend(rid, new_tokens)
        if self.model:
            self.model.apply(rid, num_accepted, new_tokens, features)

    def draft(self, rids: list[int], k: int, capacity: int | None = None
              ) -> tuple[list[list[int]], torch.Tensor | None]:
        """Up to k tokens per row; q None unless the model drafted for a sampled row (see the module docstring)."""
        if capacity is not None:
            raise ValueError("Tetris selection needs a model draft's confidences; suffix drafts do not take it")
        k = min(k, self.max_k)
        props = self.index.propose(rids, k)
        drafts = [p.tokens[:self.budgets.get(r, k)] for p, r in zip(props, rids)]
        self.sources = ["suffix" if d else "" for d in drafts]
        if not self.model or not k:
            return drafts, None
        use_model = [i for i, p in enumerate(props) if p.score < self.threshold]
        for i in use_model:
            drafts[i], self.sources[i] = [], ""
        if not use_model:
            return drafts, None
        sub, q = self.model.draft([rids[i] for i in use_model], k)
        for i, d in zip(use_model, sub):
            drafts[i] = d
            self.sources[i] = "model" if d else ""
        if q is None:  # every model row greedy: the suffix rows' one-hots need not travel either
            return drafts, None
        K = max(map(len, drafts))
        full = q.new_zeros(len(rids), K, q.shape[-1])
        full[use_model, :q.shape[1]] = q
        for i, d in enumerate(drafts):
            if self.sources[i] == "suffix":
                full[i, torch.arange(len(d)), torch.tensor(d)] = 1.0
        return drafts, full


def make_drafter(runner, max_k: int, suffix: dict | None, threshold: float = 1.0, controls=None):
    """The drafter for a configuration: a model Drafter (runner only), a SuffixDrafter (suffix options only) or
    the hybrid (both); None when there is neither (no drafting). `controls` (controls/logits.py) apply the
    requests' output controls to the model's drafts; a suffix draft needs none: its q is one-hot, so the
    verifier's controlled target law alone decides it."""
    from .drafter import Drafter
    model = Drafter(runner, max_k, controls) if runner is not None else None
    if suffix is None:
        return model
    return SuffixDrafter(max_k, SuffixConfig(**suffix), model, threshold)
