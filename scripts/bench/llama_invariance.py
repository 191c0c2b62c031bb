"""Is llama.cpp batch-invariant? Logits of the same positions computed different ways, compared bitwise.

For each prompt (the bench's open-chat and grounded sets, chat template applied), the reference is llama.cpp decoding
that sequence alone, greedily, one token per llama_decode (what llama-server does for one request). Then the same
tokens are scored as a verifier would: in windows of w tokens per call (w = 1 re-runs the reference), and with
B - 1 other sequences in the same batch. Per setting it prints the share of positions whose logits are bitwise the
reference's, the largest absolute difference, and how many positions change their argmax.

    PYTHONPATH=$PWD python scripts/bench/llama_invariance.py ~/.cache/minedraft/gguf/smollm2-135m.F32.gguf

Options: --flash-attn on|off|auto, --kv f16|f32, --tokens, --prompts. Needs llama-cpp-python (pip install -e ".[gguf]").
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def chat_ids(tok, text_or_messages) -> list[int]:
    msgs = text_or_messages if isinstance(text_or_messages, list) else [{"role": "user", "content": text_or_messages}]
    return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))


def prompts(tok, n: int, max_prompt: int) -> list[list[int]]:
    from minedraft.bench.prompts import open_chat_prompts
    from minedraft.bench.workloads import grounded_prompts
    out = [chat_ids(tok, p) for p in open_chat_prompts()[:n]]
    out += [ids for ids in (chat_ids(tok, m) for m in grounded_prompts(3 * n)) if len(ids) <= max_prompt][:n]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt in the reference")
    ap.add_argument("--prompts", type=int, default=3, help="prompts of each set (chat, grounded)")
    ap.add_argument("--flash-attn", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--kv", choices=("f16", "f32"), default="f16")
    ap.add_argument("--windows", default="1,2,4,8", help="tokens per row per call")
    ap.add_argument("--batch", default="1,4", help="rows per call")
    ap.add_argument("--ubatch", type=int, default=63, help="llama.cpp's n_ubatch (the runner's default: 63)")
    ap.add_argument("--pad", action="store_true", help="pad and add outputs as for float weights (LlamaCppRunner."
                    "pad_float) whatever the GGUF's type")
    ap.add_argument("--engine", type=int, default=0, metavar="B",
                    help="also: greedy output of suffix-draft SD against the target alone through LocalEngine "
                         "(continuous batching, B requests at once, 4B requests)")
    a = ap.parse_args()
    from minedraft.runner.gguf import model_dir
    from minedraft.runner.llama_cpp import LlamaCppRunner
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir(a.gguf), local_files_only=True)
    fa = {"auto": None, "on": True, "off": False}[a.flash_attn]
    runner = LlamaCppRunner(a.gguf, 16384, 16, threads=1, flash_attn=fa, kv_type=a.kv, ubatch=a.ubatch)
    runner.pad_float = runner.pad_float or a.pad
    ps = prompts(tok, a.prompts, 900)
    cache = runner.cache

    # reference: each sequence alone, prefill then one token per call
    ref_tokens, ref_logits = [], []
    for i, p in enumerate(ps):
        cache.allocate(("ref", i), len(p) + a.tokens + 1)
        lg = runner.forward([("ref", i)], [p], 1)[0, 0].numpy()
        seq, rows = [], []
        for _ in range(a.tokens):
            t = int(lg.argmax())
            seq.append(t)
            rows.append(lg.copy())
            lg = runner.forward([("ref", i)], [[t]], 1)[0, 0].numpy()
        cache.free(("ref", i))
        ref_tokens.append(seq)
        ref_logits.append(np.stack(rows))  # row j: logits after prompt + seq[:j] (they choose seq[j])
    print(f"{os.path.basename(a.gguf)}: flash_attn={a.flash_attn} kv={a.kv} ubatch={a.ubatch}, {len(ps)} prompts x "
          f"{a.tokens} tokens")
    print(f"{'rows':>4} {'window':>6} {'bitwise':>8} {'max |diff|':>11} {'argmax changed':>15}")
    for B in map(int, a.batch.split(",")):
        for w in map(int, a.windows.split(",")):
            same = total = flips = 0
            worst = 0.0
            for i in range(len(ps)):
                others = [(j + i + 1) % len(ps) for j in range(B - 1)]
                rows_ids = [("t", i)] + [("o", j) for j in others]
                seqs = [ps[i]] + [ps[j] for j in others]
                conts = [ref_tokens[i]] + [ref_tokens[j] for j in others]
                for r, s in zip(rows_ids, seqs):
                    cache.allocate(r, len(s) + a.tokens + 1)
                # the prompts in one call (row 0 of the reference is its last token's logits), then the
                # continuation in windows of w tokens: token j of it predicts token j + 1
                lg = runner.forward(rows_ids, seqs, 1)[0].numpy()
                checks = [(lg, ref_logits[i][:1])]
                feeds = [c[:-1] for c in conts]
                for start in range(0, a.tokens - 1, w):
                    lg = runner.forward(rows_ids, [f[start:start + w] for f in feeds], w)[0].numpy()
                    checks.append((lg, ref_logits[i][start + 1:start + 1 + w]))
                for lg, ref in checks:
                    got = lg[len(lg) - len(ref):]
                    same += int(sum(np.array_equal(x, y) for x, y in zip(got, ref)))
                    worst = max(worst, float(np.abs(got - ref).max()))
                    flips += int((got.argmax(-1) != ref.argmax(-1)).sum())
                    total += len(ref)
                for r in rows_ids:
                    cache.free(r)
            print(f"{B:>4} {w:>6} {same / total:>8.3f} {worst:>11.2e} {flips:>8d} / {total}")
    if a.engine:
        engine_check(a, tok, runner)
    return 0


def engine_check(a, tok, runner) -> None:
    """Greedy output through the whole engine (one process): suffix drafts (sequential SD, fixed k = 6) against the
    target alone, both with continuous batching of a.engine requests: how many requests come out identical."""
    from minedraft.config import EngineConfig
    from minedraft.engine.local_engine import LocalEngine
    from minedraft.sampling_params import SamplingParams
    import minedraft.engine.local_engine as le
    ps = prompts(tok, 2 * a.engine, 900)
    params = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    kw = dict(target=a.gguf, kv_cache_tokens=16384, max_prompt_tokens=1024, max_tokens_limit=a.tokens,
              max_batch_size=a.engine)
    made = le.LlamaCppRunner
    def make(path, n, bs):
        r = made(path, n, bs, threads=1, flash_attn=runner_fa(a), kv_type=a.kv, ubatch=a.ubatch)
        r.pad_float = r.pad_float or a.pad
        return r
    le.LlamaCppRunner = make
    try:
        alone = LocalEngine(EngineConfig(draft="suffix", mode="autoregressive", **kw)).generate(ps, params)
        spec = LocalEngine(EngineConfig(draft="suffix", mode="sequential", adaptive_k=False, k=6, **kw)
                           ).generate(ps, params)
    finally:
        le.LlamaCppRunner = made
    same = sum(x.token_ids == y.token_ids for x, y in zip(alone, spec))
    first = [next((j for j, (u, v) in enumerate(zip(x.token_ids, y.token_ids)) if u != v), None)
             for x, y in zip(alone, spec)]
    acc = sum(r.stats.accepted_tokens for r in spec) / max(1, sum(r.stats.draft_tokens for r in spec))
    # the target-alone run's top-2 gap (log-probabilities differ as logits do) where the two first part
    gaps = [round(x.logprobs[j][1][0][1] - x.logprobs[j][1][1][1], 4) for x, j in zip(alone, first) if j is not None]
    print(f"engine, B={a.engine}, {len(ps)} requests x {a.tokens} tokens: suffix SD == target alone for {same}/"
          f"{len(ps)} (first differing token: {[j for j in first if j is not None]}, top-2 gap there {gaps}); "
          f"draft acceptance {acc:.2f}")


def runner_fa(a):
    return {"auto": None, "on": True, "off": False}[a.flash_attn]


if __name__ == "__main__":
    sys.exit(main())
