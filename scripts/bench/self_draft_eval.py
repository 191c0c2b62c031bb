"""Self-draft schemes on the real target: agreement, acceptance, cost, memory, load time (BENCHMARKS "Self-drafts").

    flock /work/notes/bench.lock python scripts/bench/self_draft_eval.py [--target DIR] [--max-new 64]

1. The fp32 target answers the held-out chat prompts greedily (chat template applied), through ModelRunner.
2. Each draft variant reads those sequences teacher-forced: top-1 agreement with the target at each answer
   position, and 1 - TV(p, q) (the expected acceptance of one sampled draft token at T = 1).
3. Greedy per-draft-token acceptance at k = 1..8 follows exactly from the agreement vector: after each verdict the
   context is the target's own greedy text, so a step from position j accepts the run of agreements from j (at most
   k) and drafts k. (The engine's incremental bf16 decode may differ from teacher forcing in rare near-ties.)
4. ms per decode step (one token per row, 64-token context, one thread) at B = 1, 4, 16, target and each draft.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from minedraft.bench.prompts import held_out_prompts
from minedraft.drafting import self_draft
from minedraft.runner.model_runner import ModelRunner, load_causal_lm

VARIANTS = {  # name -> (scheme, group, head, activations)
    "bf16": ("bf16", 32, "float", "bfloat16"),
    "int4-g32-head4-f32": ("int4", 32, "int4", "float32"),
    "int4-g32-headf-f32": ("int4", 32, "float", "float32"),
    "int4-g32-head4-bf16": ("int4", 32, "int4", "bfloat16"),
    "int4-g64-head4-f32": ("int4", 64, "int4", "float32"),
    "int4-g128-head4-f32": ("int4", 128, "int4", "float32"),
}


def greedy_answers(runner, prompts, max_new, eos):
    seqs = list(range(len(prompts)))
    for s, p in zip(seqs, prompts):
        runner.cache.allocate(s, len(p) + max_new + 1)
    out = [[] for _ in seqs]
    live = list(seqs)
    logits = runner.forward(seqs, prompts, 1)[:, 0]
    for _ in range(max_new):
        toks = logits.argmax(-1).tolist()
        feed = []
        for s, t in zip(live, toks):
            out[s].append(t)
        live2 = [s for s, t in zip(live, toks) if t not in eos]
        for s in live:
            if s not in live2:
                runner.cache.free(s)
        live = live2
        if not live:
            break
        feed = [[out[s][-1]] for s in live]
        logits = runner.forward(live, feed, 1)[:, 0]
    for s in live:
        runner.cache.free(s)
    return out


def teacher_forced(runner, prompts, answers):
    """Per prompt: logits [len(answer), V] predicting each answer token."""
    res = []
    for p, a in zip(prompts, answers):
        runner.cache.allocate(0, len(p) + len(a) + 1)
        seq = p + a[:-1]
        res.append(runner.forward([0], [seq], len(a))[0])
        runner.cache.free(0)
    return res


def greedy_acceptance(agree: list[list[bool]], k: int) -> float:
    acc = drafted = 0
    for row in agree:
        j = 0
        while j < len(row):
            run = 0
            while run < k and j + run < len(row) and row[j + run]:
                run += 1
            drafted += k
            acc += run
            j += run + 1
    return acc / drafted


def step_ms(runner, prompts, B, reps):
    seqs = list(range(B))
    for s in seqs:
        runner.cache.allocate(s, 200)
    runner.forward(seqs, [prompts[s % len(prompts)][:64] for s in seqs], 1)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.forward(seqs, [[5]] * B, 1)
        ts.append(time.perf_counter() - t0)
        for s in seqs:
            runner.cache.truncate(s, runner.cache.length(s) - 1)
    for s in seqs:
        runner.cache.free(s)
    return 1e3 * sorted(ts)[len(ts) // 2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(Path.home() / ".cache/minedraft/models/smollm2-135m"))
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for p in held_out_prompts()]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
    t0 = time.perf_counter()
    target = ModelRunner(load_causal_lm(args.target), 16384)
    t_load = time.perf_counter() - t0
    eos = {tok.eos_token_id, *([target.config.eos_token_id] if isinstance(target.config.eos_token_id, int) else [])}
    answers = greedy_answers(target, prompts, args.max_new, eos)
    positions = sum(map(len, answers))
    p_logits = teacher_forced(target, prompts, answers)
    report = {"prompts": len(prompts), "positions": positions, "max_new": args.max_new, "variants": {}}
    tw = self_draft.weight_bytes(target.model)
    print(f"{len(prompts)} prompts, {positions} answer positions; target {tw / 2**20:.0f} MiB, load {t_load:.1f} s")
    costs = {B: step_ms(target, prompts, B, args.reps) for B in (1, 4, 16)}
    report["target"] = {"weight_mib": tw / 2**20, "load_s": t_load, "ms": costs}
    print("target ms/step B=1/4/16: " + " / ".join(f"{costs[B]:.1f}" for B in costs), flush=True)
    for name in args.variants.split(","):
        scheme, group, head, act = VARIANTS[name]
        t0 = time.perf_counter()
        model = self_draft.convert(load_causal_lm(args.target), scheme, group, head, act)
        d = ModelRunner(model, 16384)
        load = time.perf_counter() - t0
        q_logits = teacher_forced(d, prompts, answers)
        agree = [(q.argmax(-1) == torch.tensor(a)).tolist() for q, a in zip(q_logits, answers)]
        top1 = sum(map(sum, agree)) / positions
        ovl = torch.cat([torch.minimum(p.softmax(-1), q.softmax(-1)).sum(-1) for p, q in zip(p_logits, q_logits)])
        acc = {k: greedy_acceptance(agree, k) for k in range(1, 9)}
        ms = {B: step_ms(d, prompts, B, args.reps) for B in (1, 4, 16)}
        wb = self_draft.weight_bytes(model)
        report["variants"][name] = {"top1": top1, "one_minus_tv": ovl.mean().item(), "greedy_acceptance": acc,
                                    "ms": ms, "weight_mib": wb / 2**20, "load_s": load}
        print(f"{name}: top-1 {top1:.3f}, 1-TV {ovl.mean().item():.3f}, greedy acc/draft token k=1..8 "
              + " ".join(f"{acc[k]:.3f}" for k in acc) + "; ms B=1/4/16 " + " / ".join(f"{ms[B]:.1f}" for B in ms)
              + f"; {wb / 2**20:.0f} MiB, load {load:.1f} s", flush=True)
        del d, model
    if args.json:
        json.dump(report, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
