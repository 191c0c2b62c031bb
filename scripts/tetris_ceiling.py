#!/usr/bin/env python
"""How much Tetris can gain with a given draft, before any engine cost: the ceiling of its ranking.

The target answers prompts greedily; the draft is run teacher-forced over each answer, giving at every
position its confidence (largest probability) and whether its top token is the target's. From these:
  1. calibration: agreement per confidence bin (Tetris ranks prefixes by cumulative log confidence, so it
     can only help if confidence predicts acceptance);
  2. a simulated greedy step at batch B: B random positions; plain keeps k drafts per row, Tetris drafts
     k + e and keeps the k x B best prefixes across the batch (minedraft/spec/tetris.py's own selection). A
     chain's acceptance is the run of agreements from its position (exact for greedy: a chain is accepted
     only while it equals the target's tokens, and then the draft saw the target's tokens). Beyond the
     first miss the simulation reads the teacher-forced confidences, a stand-in for those of the
     draft's own continuation; they only decide how much capacity a doomed row wastes.
Tokens per row per step and out/ver (tokens emitted per token verified) for both: the best a perfect
implementation of Tetris could do at equal capacity, the draft's and ragged batch's costs left out.

    python scripts/tetris_ceiling.py                                   # bundled pair, corpus prompts
    python scripts/tetris_ceiling.py --target ~/.cache/minedraft/models/smollm2-135m \
        --draft ~/.cache/minedraft/models/smollm2-135m-draft --chat
"""

from __future__ import annotations

import argparse

import torch

from minedraft.bench.runner import chat_prompts, corpus_prompts
from minedraft.config import DEFAULT_DRAFT, DEFAULT_TARGET
from minedraft.spec.tetris import scores, select
from minedraft.workers.model_runner import ModelRunner


@torch.inference_mode()
def greedy_answers(runner: ModelRunner, prompts: list[list[int]], max_new: int, eos: int | None):
    rows = list(range(len(prompts)))
    for r, p in zip(rows, prompts):
        runner.cache.allocate(r, len(p) + max_new + 1)
    nxt = runner.forward(rows, prompts, 1)[:, -1].argmax(-1).tolist()
    gen = [[t] for t in nxt]
    live = [r for r in rows if nxt[r] != eos]
    for _ in range(max_new - 1):
        if not live:
            break
        nxt = runner.forward(live, [[gen[r][-1]] for r in live], 1)[:, -1].argmax(-1).tolist()
        for r, t in zip(live, nxt):
            gen[r].append(t)
        live = [r for r, t in zip(live, nxt) if t != eos]
    for r in rows:
        runner.cache.free(r)
    return gen


@torch.inference_mode()
def teacher_forced(runner: ModelRunner, prompts, answers):
    """Per answer: (confidence [n], agreement [n]) of the draft predicting each answer token."""
    out = []
    for r, (p, g) in enumerate(zip(prompts, answers)):
        runner.cache.allocate(r, len(p) + len(g) + 1)
        logits = runner.forward([r], [p + g[:-1]], len(g))[0].float()
        prob = logits.softmax(-1)
        conf, top = prob.max(-1)
        out.append((conf, (top == torch.tensor(g)).float()))
        runner.cache.free(r)
    return out


def simulate(conf, agree, lengths, B, k, e, trials, gen):
    """(tokens per row per step, out/ver) for plain k and Tetris k + e at capacity k x B; a row's chain
    stays inside one answer."""
    K = k + e
    starts, off = [], 0
    for n in lengths:
        starts += range(off, off + n - K + 1)
        off += n
    starts = torch.tensor(starts)
    res = {}
    for name, tetris in (("plain", False), ("tetris", True)):
        emitted = verified = 0
        for _ in range(trials):
            pos = starts[torch.randint(0, len(starts), (B,), generator=gen)]
            idx = pos[:, None] + torch.arange(K if tetris else k)[None]
            run = agree[idx].cumprod(1).sum(1)
            if tetris:
                kept = select(scores(conf[idx].clamp_min(1e-30).log()), k * B)
            else:
                kept = torch.full((B,), k)
            emitted += torch.minimum(kept, run).sum().item() + B
            verified += kept.sum().item() + B
        res[name] = (emitted / trials / B, emitted / verified)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--chat", action="store_true", help="held-out chat questions in the target's chat template")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--batch", type=int, nargs="+", default=[16, 32])
    p.add_argument("--k", type=int, nargs="+", default=[1, 2])
    p.add_argument("--extra", type=int, default=2)
    p.add_argument("--trials", type=int, default=400)
    a = p.parse_args()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.target, local_files_only=True)
    prompts = chat_prompts(tok, a.prompts) if a.chat else [tok.encode(s) for s in corpus_prompts(a.prompts)]
    target = ModelRunner.from_pretrained(a.target, 65536)
    draft = ModelRunner.from_pretrained(a.draft, 65536)
    if draft.fc is not None:
        raise SystemExit("a feature-conditioned draft needs the target's features; this script takes token drafts")
    answers = greedy_answers(target, prompts, a.max_tokens, tok.eos_token_id)
    pairs = teacher_forced(draft, prompts, answers)
    conf = torch.cat([c for c, _ in pairs])
    agree = torch.cat([g for _, g in pairs])
    print(f"{len(conf)} answer tokens from {len(prompts)} prompts; top-1 agreement {agree.mean():.3f}")
    print("confidence bin   tokens  agreement")
    edges = [i / 10 for i in range(11)]
    for lo, hi in zip(edges, edges[1:]):
        m = (conf >= lo) & ((conf < hi) if hi < 1 else (conf <= hi))
        if m.any():
            print(f"  {lo:.1f} - {hi:.1f}   {int(m.sum()):7d}  {agree[m].mean():9.3f}")
    gen = torch.Generator().manual_seed(0)
    print(f"simulated greedy steps, Tetris e = {a.extra}, capacity k x B (equal to plain's):")
    print("   B  k  plain tok/row  plain out/ver  tetris tok/row  tetris out/ver  tetris/plain")
    for B in a.batch:
        for k in a.k:
            r = simulate(conf, agree, [len(c) for c, _ in pairs], B, k, a.extra, a.trials, gen)
            print(f"{B:4d} {k:2d} {r['plain'][0]:14.3f} {r['plain'][1]:14.3f} {r['tetris'][0]:15.3f} "
                  f"{r['tetris'][1]:15.3f} {r['tetris'][0] / r['plain'][0]:13.3f}")


if __name__ == "__main__":
    main()
