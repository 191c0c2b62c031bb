#!/usr/bin/env python
"""What output controls cost per step, and what a JSON schema does to acceptance (LocalEngine, sequential SD).

Runs the same prompts free, with a JSON schema, and with penalties, in alternating rounds on one engine, and
reports per setting: output tokens/s, verify steps, acceptance rate, ms per step, and the time spent in the
controls (grammar masks + penalties, on both the drafter's and the verifier's side) per step, measured by
wrapping RowControl.apply. Free requests never reach controls/logits.py (their RowControl is None): the `ctl_ms`
column is 0 for them by construction, and --plain-only runs just the free workload, to compare trees (run it
from each tree's root) for the cost of the checks on the hot path.

    PYTHONPATH=. python scripts/bench/output_control.py --batch 8 --max-tokens 64 --rounds 3
    PYTHONPATH=. python scripts/bench/output_control.py --plain-only --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import minedraft
from minedraft.config import DEFAULT_DRAFT, DEFAULT_TARGET, EngineConfig
from minedraft.engine.local_engine import LocalEngine
from minedraft.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24}, "hobbies": {"type": "array", "items": {"type": "string",
                                                                                         "maxLength": 16},
                                                             "maxItems": 3}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
PROMPTS = ["A person described as JSON:", "Here is a record of a customer in JSON format:",
           "JSON for a fictional character:", "The user's profile, as a JSON object:",
           "Describe a traveller as JSON:", "An employee record (JSON):", "JSON describing a student:",
           "A JSON object for a chess player:"]


def settings(plain_only: bool, max_tokens: int, temperature: float) -> dict:
    base = dict(max_tokens=max_tokens, temperature=temperature, seed=1 if temperature else None)
    out = {"free": SamplingParams(**base)}
    if not plain_only:
        out["schema"] = SamplingParams(json_schema=SCHEMA, **base)
        out["penalties"] = SamplingParams(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1, **base)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--plain-only", action="store_true")
    a = ap.parse_args()
    print(f"minedraft from {minedraft.__file__}")
    eng = LocalEngine(EngineConfig(target=a.target, draft=a.draft, mode="sequential", k=a.k, kv_cache_tokens=32768,
                                   max_batch_size=a.batch))
    ctl_s = [0.0]
    if not a.plain_only:
        from minedraft.sampling import controls
        apply = controls.RowControl.apply

        def timed(self, x):
            t = time.perf_counter()
            try:
                return apply(self, x)
            finally:
                ctl_s[0] += time.perf_counter() - t
        controls.RowControl.apply = timed
    prompts = (PROMPTS * (a.batch // len(PROMPTS) + 1))[:a.batch]
    sets = settings(a.plain_only, a.max_tokens, a.temperature)
    eng.generate(prompts[:2], sets["free"])  # warm-up
    if "schema" in sets:
        eng.generate(prompts[:1], sets["schema"])  # the tokenizer for grammars loads once
    rows = {name: [] for name in sets}
    for r in range(a.rounds):
        order = list(sets) if r % 2 == 0 else list(reversed(sets))
        for name in order:
            ctl_s[0] = 0.0
            t = time.perf_counter()
            res = eng.generate(prompts, sets[name])
            wall = time.perf_counter() - t
            toks = sum(len(x.token_ids) for x in res)
            steps = max(x.stats.steps for x in res)
            drafted = sum(x.stats.draft_tokens for x in res)
            acc = sum(x.stats.accepted_tokens for x in res) / drafted if drafted else 0.0
            done = sum(x.finish_reason == "stop" for x in res)
            rows[name].append(dict(tok_s=toks / wall, steps=steps, acc=acc, step_ms=1000 * wall / steps,
                                   ctl_ms=1000 * ctl_s[0] / steps, stopped=done))
    print(f"{'setting':10s} {'tok/s':>8s} {'steps':>6s} {'accept':>7s} {'ms/step':>8s} {'ctl ms/step':>11s} "
          f"{'eos-ended':>9s}")
    for name, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"{name:10s} {med['tok_s']:8.1f} {med['steps']:6.0f} {med['acc']:7.3f} {med['step_ms']:8.1f} "
              f"{med['ctl_ms']:11.2f} {med['stopped']:6.0f}/{a.batch}")


if __name__ == "__main__":
    main()
