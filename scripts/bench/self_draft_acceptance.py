"""Per-draft-token acceptance of drafts on the real pair, measured through the engine's own code (LocalEngine,
sequential SD): the held-out chat prompts with the chat template, greedy and at T = 1.

    python scripts/bench/self_draft_acceptance.py --drafts self:int4 self:bf16 trained --k 1 2 3 4 5 6 7 8 --temps 0 1

Prints one line per (draft, temperature, k): accepted / drafted, and output tokens per step.
"""

from __future__ import annotations

import argparse
import json

import torch

from minedraft.models import hub
from minedraft.bench.prompts import held_out_prompts
from minedraft.config import EngineConfig
from minedraft.engine.local_engine import LocalEngine
from minedraft.sampling_params import SamplingParams


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafts", nargs="+", default=["self:int4", "self:bf16", "trained"])
    ap.add_argument("--k", type=int, nargs="+", default=list(range(1, 9)))
    ap.add_argument("--temps", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=24, help="the first N held-out prompts (default: all 24)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    target, trained = hub.resolve(args.model)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(target, local_files_only=True)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for p in held_out_prompts()[:args.prompts]]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
    out = []
    for d in args.drafts:
        draft = trained if d == "trained" else d
        for t in args.temps:
            for k in args.k:
                eng = LocalEngine(EngineConfig(target=target, draft=draft, mode="sequential", k=k,
                                               max_prompt_tokens=256, max_tokens_limit=args.max_tokens,
                                               kv_cache_tokens=32768, max_batch_size=len(prompts)))
                params = [SamplingParams(max_tokens=args.max_tokens, temperature=t, seed=i if t else None)
                          for i in range(len(prompts))]
                res = eng.generate(prompts, params)
                acc = sum(r.stats.accepted_tokens for r in res)
                drafted = sum(r.stats.draft_tokens for r in res)
                steps = sum(r.stats.steps for r in res)
                n = sum(len(r.token_ids) for r in res)
                row = {"draft": d, "temperature": t, "k": k, "per_draft_token": acc / drafted,
                       "tokens_per_step": n / steps, "drafted": drafted}
                out.append(row)
                print(f"{d} T={t:g} k={k}: acceptance {acc / drafted:.3f} ({acc}/{drafted}), "
                      f"{n / steps:.2f} tokens/step", flush=True)
                del eng
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
