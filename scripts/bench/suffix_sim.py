"""Simulate the suffix drafter on the target's own greedy answers: tokens per verify step, no engine involved.

The target (float32, greedy, alone: `LocalEngine` with mode="autoregressive") answers grounded or open-chat
prompts once (cached in --answers); then, for each knob setting, every answer is replayed as a greedy
speculative decode would run it: at each step the index proposes up to k tokens from the prompt + answer so far
(and the global index of earlier answers), the accepted ones are the proposal's longest prefix that equals the
answer, and the step emits those plus one. Requests run one after another, each publishing its answer to the
global index when done. Prints tokens per verify step (= emitted / steps), draft tokens per step and acceptance.

  python scripts/bench/suffix_sim.py --split dev --n 32 --max-tokens 128           # grounded dev split
  python scripts/bench/suffix_sim.py --workload chat --n 24 --max-tokens 128       # the open-chat control
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from minedraft.drafting.suffix_index import SuffixConfig, SuffixIndex  # noqa: E402


def answers(args) -> list[tuple[list[int], list[int]]]:
    if args.answers and os.path.exists(args.answers):
        with open(args.answers) as f:
            return [tuple(x) for x in json.load(f)]
    from transformers import AutoTokenizer

    from minedraft.bench.workloads import grounded_prompts
    from minedraft.config import EngineConfig
    from minedraft.engine.chat import chat_params, chat_prompt_ids, end_of_turn_id
    from minedraft.engine.local_engine import LocalEngine
    from minedraft.sampling_params import SamplingParams
    tok = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
    if args.workload == "grounded":
        msgs = grounded_prompts(args.n, split=args.split)
    else:
        from minedraft.bench.prompts import held_out_prompts
        pool = held_out_prompts()
        msgs = [[{"role": "user", "content": pool[i % len(pool)]}] for i in range(args.n)]
    prompts = [chat_prompt_ids(tok, m) for m in msgs]
    params = chat_params(SamplingParams(max_tokens=args.max_tokens, temperature=0.0), end_of_turn_id(tok))
    eng = LocalEngine(EngineConfig(target=args.target, draft=args.target, mode="autoregressive",
                                   max_batch_size=16, kv_cache_tokens=32768))
    res = eng.generate(prompts, params)
    out = [(p, r.token_ids) for p, r in zip(prompts, res)]
    if args.answers:
        with open(args.answers, "w") as f:
            json.dump(out, f)
    return out


def simulate(pairs, cfg: SuffixConfig, k: int) -> dict:
    ix = SuffixIndex(cfg)
    steps = emitted = drafted = accepted = 0
    for rid, (prompt, ans) in enumerate(pairs):
        ix.add(rid, prompt)
        t = 0
        while t < len(ans):
            d = ix.propose([rid], k)[0].tokens
            n = 0
            while n < len(d) and t + n < len(ans) and d[n] == ans[t + n]:
                n += 1
            new = ans[t:t + n + 1]
            ix.extend(rid, new)
            t += len(new)
            steps += 1
            emitted += len(new)
            drafted += len(d)
            accepted += n
        ix.remove(rid)
    return {"tok_per_step": emitted / steps, "draft_per_step": drafted / steps,
            "acceptance": accepted / max(drafted, 1), "steps": steps}


def batch_cost(pairs, cfg: SuffixConfig, k: int, rows: int, trace: bool = False) -> dict:
    """The drafter's own work for `rows` requests decoded together: per step, one propose over all rows plus
    each row's verdict (extend); prompts indexed at admission. Returns ms per step, the admission cost and the
    memory the index holds at the end (with trace: tracemalloc, which also slows the timed work)."""
    import time
    import tracemalloc
    if trace:
        tracemalloc.start()
    ix = SuffixIndex(cfg)
    live = list(range(min(rows, len(pairs))))
    t0 = time.perf_counter()
    for r in live:
        ix.add(r, pairs[r][0])
    admit = (time.perf_counter() - t0) / len(live)
    pos = {r: 0 for r in live}
    steps, spent = 0, 0.0
    while live:
        t0 = time.perf_counter()
        props = ix.propose(live, k)
        for r, p in zip(list(live), props):  # the target's answer decides what is accepted
            ans, t = pairs[r][1], pos[r]
            n = 0
            while n < len(p.tokens) and t + n < len(ans) and p.tokens[n] == ans[t + n]:
                n += 1
            new = ans[t:t + n + 1]
            ix.extend(r, new)
            pos[r] = t + len(new)
            if pos[r] >= len(ans):
                ix.remove(r)
                live.remove(r)
        spent += time.perf_counter() - t0
        steps += 1
    mem = tracemalloc.get_traced_memory()[0] if trace else 0
    tracemalloc.stop()
    return {"ms_per_step": spent / steps * 1e3, "admit_ms": admit * 1e3, "mem_kb": mem / 1024,
            "global_tokens": ix.global_held}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=os.path.expanduser("~/.cache/minedraft/models/smollm2-135m"))
    p.add_argument("--workload", choices=("grounded", "chat"), default="grounded")
    p.add_argument("--split", choices=("dev", "test"), default="dev")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, nargs="+", default=[8, 16], help="per-row draft budgets to try")
    p.add_argument("--cost", type=float, default=0.17, help="verify cost per draft token, relative to a step "
                   "without drafts (0.17: 4 tokens a row for 1.5x one, the small-batch CPU figure of issue 30)")
    p.add_argument("--answers", help="JSON cache of (prompt, answer) ids: read if present, else written")
    p.add_argument("--rows", type=int, default=0, help="also time the index's work per step with this many rows "
                   "decoded together (Td of a suffix-drafting step, without the slot write)")
    args = p.parse_args(argv)
    pairs = answers(args)
    if args.rows:
        c = batch_cost(pairs, SuffixConfig(), max(args.k), args.rows)
        m = batch_cost(pairs, SuffixConfig(), max(args.k), args.rows, trace=True)
        print(f"{args.rows} rows together, k={max(args.k)}: {c['ms_per_step']:.2f} ms per step, "
              f"{c['admit_ms']:.2f} ms to index a prompt; index memory at the end {m['mem_kb']:.0f} KiB with "
              f"{m['global_tokens']} tokens in the global index")
    print(f"{len(pairs)} answers, {sum(len(a) for _, a in pairs)} tokens")
    naive = dict(spec_factor=100.0, min_prob=0.0, match_prior=0.0)
    grid = [("naive longest match, k=8", naive, 8), ("default knobs, k=8", {}, 8)]
    for k in args.k:
        for f in (1.0, 2.0, 4.0):
            for mp in (0.1, 0.2, 0.3, 0.5):
                grid.append((f"k={k} spec_factor={f} min_prob={mp}", dict(spec_factor=f, min_prob=mp), k))
    print(f"gain = tokens per step / (1 + {args.cost} x drafts per step): the speed-up if a verify step costs "
          f"1 + {args.cost} per draft token (--cost)")
    for name, kw, k in grid:
        r = simulate(pairs, SuffixConfig(**kw), k)
        gain = r["tok_per_step"] / (1 + args.cost * r["draft_per_step"])
        print(f"{name:40s} tokens/step {r['tok_per_step']:.2f}  drafts/step {r['draft_per_step']:.2f}  "
              f"acceptance {r['acceptance']:.2f}  gain {gain:.2f}")


if __name__ == "__main__":
    main()
