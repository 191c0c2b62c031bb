#!/usr/bin/env python
"""Does the draft's confidence predict acceptance, greedy and at T = 1? Teacher-forced over the target's greedy
answers: at every position the draft's confidence (largest probability), greedy agreement (same argmax) and the
T = 1 acceptance probability of rejection sampling, 1 - TV(p, q). Then a simulated step at batch B with
expected acceptances: plain keeps 1 draft per row, Tetris drafts 3 and keeps the B best prefixes
(minedraft/spec/tetris.py's selection); ratios of expected accepted drafts are printed last.

    python scripts/rank_signal.py                                     # bundled pair, corpus prompts
    python scripts/rank_signal.py --target ~/.cache/minedraft/models/smollm2-135m \\
        --draft ~/.cache/minedraft/models/smollm2-135m-draft --chat   # real pair, held-out chat prompts
"""

import argparse

import torch

from minedraft.bench.runner import chat_prompts, corpus_prompts
from minedraft.config import DEFAULT_DRAFT, DEFAULT_TARGET
from minedraft.spec.tetris import scores, select
from minedraft.workers.model_runner import ModelRunner
from tetris_ceiling import greedy_answers  # scripts/ is on the path when run as a script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=400)
    a = ap.parse_args()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.target, local_files_only=True)
    prompts = chat_prompts(tok, 16) if a.chat else [tok(p)["input_ids"] for p in corpus_prompts(24, 1)]
    t, d = ModelRunner.from_pretrained(a.target, 65536), ModelRunner.from_pretrained(a.draft, 65536)
    answers = greedy_answers(t, prompts, 48, None)
    confs, t1, agree = [], [], []
    with torch.inference_mode():
        for r, (p, g) in enumerate(zip(prompts, answers)):
            for run in (t, d):
                run.cache.allocate(r, len(p) + len(g) + 1)
            P = t.forward([r], [p + g[:-1]], len(g))[0].float().softmax(-1)
            Q = d.forward([r], [p + g[:-1]], len(g))[0].float().softmax(-1)
            confs.append(Q.max(-1).values)
            t1.append(torch.minimum(P, Q).sum(-1))
            agree.append((P.argmax(-1) == Q.argmax(-1)).float())
    c, a1, ag = torch.cat(confs), torch.cat(t1), torch.cat(agree)
    print(f"{len(c)} positions; mean T=1 acceptance {a1.mean():.3f}, greedy agreement {ag.mean():.3f}")
    print("confidence | positions | T=1 acceptance | greedy agreement")
    for lo in [i / 10 for i in range(10)]:
        m = (c >= lo) & ((c < lo + 0.1) if lo < 0.9 else (c <= 1.0))
        if m.any():
            print(f"{lo:.1f}-{lo + 0.1:.1f} | {int(m.sum())} | {a1[m].mean():.3f} | {ag[m].mean():.3f}")
    gen = torch.Generator().manual_seed(0)
    B = a.batch
    for name, acc in (("T=1", t1), ("greedy", agree)):
        plain = tetris = 0.0
        for _ in range(a.steps):
            picks = []
            while len(picks) < B:
                r = int(torch.randint(len(confs), (1,), generator=gen))
                if len(confs[r]) >= 4:
                    picks.append((r, int(torch.randint(len(confs[r]) - 3, (1,), generator=gen))))
            conf = torch.stack([confs[r][s:s + 3] for r, s in picks])
            chain = torch.stack([acc[r][s:s + 3] for r, s in picks]).cumprod(1)
            kept = select(scores(conf.log()), B)
            plain += chain[:, 0].sum().item()
            tetris += sum(chain[b, :int(kept[b])].sum().item() for b in range(B))
        print(f"RATIO {name}: Tetris / plain expected accepted drafts = {tetris / plain:.3f} "
              f"(per step {plain / a.steps:.2f} -> {tetris / a.steps:.2f}, B={B}, k=1, e=2)")


if __name__ == "__main__":
    main()
