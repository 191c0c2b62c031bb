"""Per-request output controls that change the distribution sampled from: penalties, logit bias, a grammar mask.

Each is a function of the history (prompt + output so far) at the position being scored, so under speculation it
is applied at every drafted position from the history up to that position, drafts included, identically to the
draft's logits (drafting/drafter.py) and to the target's at verification (workers/verifier.py). Acceptance then
compares the processed laws, and the output follows exactly the law of the target alone under the same control
(greedy: its argmax; sampled: rejection sampling is exact for any draft law q, and here q is the draft's processed
law). A rejected draft leaves no trace: every drafted token pushed onto a RowControl is popped again before the
verdict is applied, and the grammar matcher is rolled back with it.

Order at one position, on float32 logits, before temperature / top-k / top-p (sampling/batch_sampling.py):
1. repetition_penalty r on every token seen in the prompt or the output: logit / r if logit > 0, else logit * r;
2. frequency_penalty * count and presence_penalty * (count > 0), counts over output tokens only, subtracted;
3. logit_bias added;
4. the grammar mask: tokens the grammar does not allow next get -inf.
Requests without controls never reach this module (RowControl is None for them): no cost on the hot path.
"""

from __future__ import annotations

import torch

from ..sampling_params import SamplingParams


class RowControl:
    """One request's control state on one worker: token counts and the grammar matcher, at the history's end."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int, matcher=None):
        self.V = vocab_size
        self.rep = float(params.repetition_penalty)
        self.pres, self.freq = float(params.presence_penalty), float(params.frequency_penalty)
        self.out = torch.zeros(vocab_size) if (self.pres or self.freq) else None   # output token counts
        self.seen = None                                                           # prompt + output counts
        if self.rep != 1.0:
            self.seen = torch.zeros(vocab_size)
            ids = torch.tensor([t for t in prompt_ids if t < vocab_size], dtype=torch.long)
            self.seen.index_add_(0, ids, torch.ones(len(ids)))
        bias = [(t, b) for t, b in params.logit_bias if t < vocab_size]
        self.bias_ids = torch.tensor([t for t, _ in bias], dtype=torch.long) if bias else None
        self.bias_val = torch.tensor([float(b) for _, b in bias]) if bias else None
        self.matcher = matcher
        self._stack: list[bool] = []  # per pushed token: did the matcher consume it
        self._refused = 0             # pushed tokens from the first one the grammar refused on

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """logits [V] at the position after the pushed history -> processed float32 logits [V] (a new tensor)."""
        x = x.float()
        state = self.out if self.out is not None else self.seen
        if state is not None and state.device != x.device:
            self._to(x.device)  # the state lives where the logits are (a GPU worker's), moved once
        if self.seen is not None:
            x = torch.where(self.seen > 0, torch.where(x > 0, x / self.rep, x * self.rep), x)
        if self.out is not None:
            x = x - self.freq * self.out - self.pres * (self.out > 0).float()
        if self.bias_ids is not None:
            x = x.index_add(0, self.bias_ids, self.bias_val.to(x.device))
        if self.matcher is not None:
            x = x.masked_fill(~self.matcher.allowed().to(x.device), float("-inf"))
        return x

    def _to(self, device) -> None:
        self.out = self.out.to(device) if self.out is not None else None
        self.seen = self.seen.to(device) if self.seen is not None else None

    def push(self, tokens: list[int]) -> None:
        """Append tokens to the history (drafts or output)."""
        for t in tokens:
            if self.out is not None and t < self.V:
                self.out[t] += 1
            if self.seen is not None and t < self.V:
                self.seen[t] += 1
            if self.matcher is not None:
                # after a refused token the matcher's state is not the history's: tokens past it are not fed
                ok = False
                if self._refused:
                    self._refused += 1
                else:
                    ok = self.matcher.consume(t)
                    self._refused = int(not ok)
                self._stack.append(ok)
            else:
                self._stack.append(False)

    def pop(self, tokens: list[int]) -> None:
        """Undo push(tokens) (the same list, the last ones pushed)."""
        for t in reversed(tokens):
            if self.out is not None and t < self.V:
                self.out[t] -= 1
            if self.seen is not None and t < self.V:
                self.seen[t] -= 1
            consumed = self._stack.pop()
            if self.matcher is not None:
                if consumed:
                    self.matcher.rollback(1)
                elif self._refused:
                    self._refused -= 1


def process_rows(logits: torch.Tensor, ctls: list[RowControl | None]) -> torch.Tensor:
    """Draft step: logits [B, V], row b at the position after its control's history; rows without a control are
    left as they are. Returns float32 logits [B, V] (a copy when any row is processed)."""
    if not any(c is not None for c in ctls):
        return logits
    out = logits.float().clone()
    for b, c in enumerate(ctls):
        if c is not None:
            out[b] = c.apply(out[b])
    return out


def process_positions(logits: torch.Tensor, ctls: list[RowControl | None], drafts: list[list[int]]
                      ) -> torch.Tensor:
    """Verification: logits [B, K+1, V], row b's position j scoring the token after its history plus drafts[b][:j]
    (j <= len(drafts[b]); later, padded, positions are left as they are). Each control advances through the row's
    drafts and is returned to where it was. Returns float32 logits (a copy)."""
    out = logits.float().clone()
    for b, c in enumerate(ctls):
        if c is None:
            continue
        d = drafts[b]
        for j in range(len(d) + 1):
            out[b, j] = c.apply(out[b, j])
            if j < len(d):
                c.push(d[j:j + 1])
        c.pop(d)
    return out


class Controls:
    """A worker's factory of RowControls: grammars are compiled against the target's tokenizer, loaded on the
    first request that has one."""

    def __init__(self, vocab_size: int, eos_ids, tokenizer_dir: str | None):
        self.V, self.eos, self.tokenizer_dir = vocab_size, tuple(sorted(eos_ids)), tokenizer_dir

    def make(self, params: SamplingParams, prompt_ids: list[int]) -> RowControl | None:
        if not params.has_controls:
            return None
        m = None
        if params.structured:
            from .grammar import matcher
            if self.tokenizer_dir is None:
                raise RuntimeError("structured output needs the tokenizer's folder")
            m = matcher(*params.structured, self.tokenizer_dir, self.V, self.eos)
        return RowControl(params, prompt_ids, self.V, m)
