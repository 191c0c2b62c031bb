"""Distillation data: a target's greedy answers to a batch of prompts with its top-k log-probabilities (soft
labels) and, on request, its features. The training scripts (scripts/train/smollm2_draft.py, scripts/train/eagle.py)
share it; nothing in the engine uses it."""

from __future__ import annotations

import torch

TOPK = 16  # soft labels kept per generated position


def greedy_rows(runner, batch: list[list[int]], max_new: int, eos: int | None, features: bool) -> list[dict]:
    """The target's greedy answers to a batch of prompts: per row its tokens, top-16 log-probabilities and, with
    features, the final-norm hidden state of every fed position (0 .. len(prompt + gen) - 2)."""
    for i, b in enumerate(batch):
        runner.cache.allocate(i, len(b) + max_new + 1)
    gen = [[] for _ in batch]
    tops = [[] for _ in batch]
    feats = [[] for _ in batch]
    live = list(range(len(batch)))
    feed = {i: batch[i] for i in live}
    while live:
        if features:
            logits, states = runner.forward(live, [feed[i] for i in live], 1, hidden=True)
            for i, h in zip(live, states):
                feats[i].append(h.to(torch.float16))
        else:
            logits = runner.forward(live, [feed[i] for i in live], 1)
        v, ix = torch.log_softmax(logits[:, 0], -1).topk(TOPK, -1)
        nxt = ix[:, 0].tolist()
        still = []
        for j, i in enumerate(live):
            gen[i].append(nxt[j])
            tops[i].append((ix[j].to(torch.int32), v[j].to(torch.float16)))
            if nxt[j] == eos or len(gen[i]) >= max_new:
                runner.cache.free(i)
            else:
                still.append(i)
                feed[i] = [nxt[j]]
        live = still
    rows = [{"prompt": b, "gen": gen[i], "top_i": torch.stack([t[0] for t in tops[i]]),
             "top_v": torch.stack([t[1] for t in tops[i]])} for i, b in enumerate(batch)]
    if features:
        for r, f in zip(rows, feats):
            r["feat"] = torch.cat(f)
    return rows
