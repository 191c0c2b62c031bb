#!/usr/bin/env python
"""Tetris (rank the batch's draft prefixes by the draft's confidence, verify the best k x B) against plain
drafting: measured in the engine, and its ceiling with a given draft before any engine cost.

    python scripts/bench/tetris.py ab --batch 16 32 --k 1 2 --rounds 3     # engines, alternating, equal capacity
    python scripts/bench/tetris.py ceiling                                 # simulated ranking, bundled pair
    python scripts/bench/tetris.py rank-signal                             # confidence vs acceptance, T=0 and 1
    (each with --target DIR --draft DIR --chat for another pair, e.g. the pulled SmolLM2-135M pair)

The Tetris sweep in docs/BENCHMARKS.md is two `minedraft bench` runs (--tetris both --dynamic, per temperature).
`python scripts/bench/tetris.py COMMAND --help` gives each command's flags and what it prints.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

import torch

from minedraft.bench.runner import chat_prompts, corpus_prompts, run_workload
from minedraft.config import DEFAULT_DRAFT, DEFAULT_TARGET, EngineConfig
from minedraft.engine.engine import Engine
from minedraft.sampling_params import SamplingParams
from minedraft.sampling.tetris import scores, select
from minedraft.runner.model_runner import ModelRunner


def parser(name: str, fn) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"tetris.py {name}", description=fn.__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


# -- ab --------------------------------------------------------------------------------------------------------
KEYS = ("tok_s", "out_ver", "ver_step", "td_ms", "tv_ms", "step_ms")


async def run_setting(cfg: EngineConfig, prompts, params, reps: int):
    async with Engine(cfg) as engine:
        await run_workload(engine, prompts[:2], params, None)  # warm-up
        rows, outs = [], None
        for _ in range(reps):
            metrics, outs = await run_workload(engine, prompts, params, None)
            rows.append(metrics)
        return {key: statistics.median(r[key] for r in rows) for key in KEYS}, outs


def ab(argv) -> int:
    """Tetris against plain minedraft at equal capacity, in alternation (fresh engines, rotated order).

Plain keeps k drafts for every row; Tetris drafts k + e per row and keeps the batch's k x B best-ranked
prefixes (the default capacity), so both score the same number of draft tokens per step. On this project's
2-core box a host's speed drifts by 20-30% over minutes, so the two settings run in alternating rounds with
the same workload (warm-up, then --reps runs, all requests at once, ignore_eos; greedy unless --temperature);
figures are medians over rounds of each round's median, greedy outputs are checked against plain's, and
ratios are printed last.

With --requests above B the batches stay full until the queue drains (serving). With B requests (one closed
batch) Tetris also pays a longer ragged tail: it gives drafts to the rows it is sure of, they finish first,
and the last steps run with fewer rows."""
    ap = parser("ab", ab)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--extra", type=int, default=2, help="Tetris's extra drafts per row (e)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per run (default B): more than B keeps the batches full until the queue drains, "
                         "so the run measures serving rather than the ragged tail of one closed batch")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0 = greedy (outputs checked identical); above 0, unseeded sampling (not compared)")
    ap.add_argument("--chat", action="store_true", help="held-out chat prompts (the real pair's chat template)")
    ap.add_argument("--kv-cache-tokens", type=int, default=65536)
    args = ap.parse_args(argv)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=args.temperature)
    base = dict(target=args.target, draft=args.draft, max_tokens_limit=args.max_tokens,
                kv_cache_tokens=args.kv_cache_tokens, mode="minedraft")
    ratios = []
    for B in args.batch:
        if args.chat:
            from transformers import AutoTokenizer
            prompts = chat_prompts(AutoTokenizer.from_pretrained(args.target, local_files_only=True),
                                   args.requests or B)
        else:
            prompts = corpus_prompts(args.requests or B, 0)
        for k in args.k:
            settings = [("plain", dict(k=k)), ("tetris", dict(k=k, tetris=True, tetris_extra=args.extra))]
            got: dict[str, list[dict]] = {name: [] for name, _ in settings}
            same = True  # stays True unchecked when sampling
            for r in range(args.rounds):
                outs = {}
                for name, kw in (settings if r % 2 == 0 else settings[::-1]):
                    cfg = EngineConfig(**base, **kw, max_batch_size=B)
                    m, outs[name] = asyncio.run(run_setting(cfg, prompts, params, args.reps))
                    got[name].append(m)
                    print(f"B={B} k={k} round {r}: {name:6s} " + " ".join(f"{key} {m[key]:.3g}" for key in KEYS),
                          flush=True)
                same &= args.temperature > 0 or outs["tetris"] == outs["plain"]
            med = {name: {key: statistics.median(m[key] for m in rows) for key in KEYS} for name, rows in got.items()}
            for name, m in med.items():
                print(f"B={B} k={k} {name:6s} median: " + " ".join(f"{key} {m[key]:.3g}" for key in KEYS))
            ratios.append((B, k, med["tetris"]["tok_s"] / med["plain"]["tok_s"],
                           med["plain"]["out_ver"], med["tetris"]["out_ver"], same))
    for B, k, ratio, ov_p, ov_t, same in ratios:
        print(f"RATIO B={B} k={k} e={args.extra} T={args.temperature}: tetris / plain tok/s = {ratio:.2f}  "
              f"(out/ver {ov_p:.3f} -> {ov_t:.3f}; outputs identical: {same})")
    return 0


# -- ceiling ---------------------------------------------------------------------------------------------------
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


def ceiling(argv) -> int:
    """How much Tetris can gain with a given draft, before any engine cost: the ceiling of its ranking.

The target answers prompts greedily; the draft is run teacher-forced over each answer, giving at every
position its confidence (largest probability) and whether its top token is the target's. From these:
  1. calibration: agreement per confidence bin (Tetris ranks prefixes by cumulative log confidence, so it
     can only help if confidence predicts acceptance);
  2. a simulated greedy step at batch B: B random positions; plain keeps k drafts per row, Tetris drafts
     k + e and keeps the k x B best prefixes across the batch (minedraft/sampling/tetris.py's own selection). A
     chain's acceptance is the run of agreements from its position (exact for greedy: a chain is accepted
     only while it equals the target's tokens, and then the draft saw the target's tokens). Beyond the
     first miss the simulation reads the teacher-forced confidences, a stand-in for those of the
     draft's own continuation; they only decide how much capacity a doomed row wastes.
Tokens per row per step and out/ver (tokens emitted per token verified) for both: the best a perfect
implementation of Tetris could do at equal capacity, the draft's and ragged batch's costs left out."""
    p = parser("ceiling", ceiling)
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=DEFAULT_DRAFT)
    p.add_argument("--chat", action="store_true", help="held-out chat questions in the target's chat template")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--batch", type=int, nargs="+", default=[16, 32])
    p.add_argument("--k", type=int, nargs="+", default=[1, 2])
    p.add_argument("--extra", type=int, default=2)
    p.add_argument("--trials", type=int, default=400)
    a = p.parse_args(argv)
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
    return 0


# -- rank-signal -----------------------------------------------------------------------------------------------
def rank_signal(argv) -> int:
    """Does the draft's confidence predict acceptance, greedy and at T = 1? Teacher-forced over the target's greedy
answers: at every position the draft's confidence (largest probability), greedy agreement (same argmax) and the
T = 1 acceptance probability of rejection sampling, 1 - TV(p, q). Then a simulated step at batch B with
expected acceptances: plain keeps 1 draft per row, Tetris drafts 3 and keeps the B best prefixes
(minedraft/sampling/tetris.py's selection); ratios of expected accepted drafts are printed last."""
    ap = parser("rank-signal", rank_signal)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=400)
    a = ap.parse_args(argv)
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
    return 0


COMMANDS = {"ab": ab, "ceiling": ceiling, "rank-signal": rank_signal}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=COMMANDS)
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the command's flags (COMMAND --help lists them)")
    a = ap.parse_args(argv)
    return COMMANDS[a.command](a.args)


if __name__ == "__main__":
    raise SystemExit(main())
