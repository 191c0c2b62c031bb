"""Benchmark: target-alone, sequential SD, the MINEDRAFT two-batch pipeline, and HF assisted generation,
on the same models, prompts and machine, in one run. `minedraft bench --help` lists the options.

Every figure is a median over --repeats runs; repeats are the outer loop, each row in a fresh engine, the order
reversed every other repeat (drift on a shared host then hits every row alike). Td / Tv are the mean draft and verify times of one step (one
batch); step time is the wall time per verify step, and overlap efficiency is max(Td, Tv) / step time: close
to 1 when one device never waits for the other, about max/(Td+Tv) when they take turns. In greedy runs
"same" is the share of requests whose output is token-for-token the target-alone output for the same
prompts: the benchmark checks losslessness while it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time

from tqdm import tqdm

from .baselines import WARM_UP, headline, hf_assisted, in_process_row, in_process_runs, in_process_variants
from .report import _group, _median, format_table, host_load_note, price_controls, ratios  # noqa: F401 (API)
from ..config import DEFAULT_DRAFT, DEFAULT_TARGET, EngineConfig, default_k, default_mode
from ..cores import available_cores, format_cores, threads_for
from ..sampling_params import SamplingParams

MODES = ("autoregressive", "sequential", "minedraft")


def corpus_prompts(n: int, seed: int = 0, words: tuple[int, int] = (8, 24)) -> list[str]:
    """Prompts cut from Python's own documentation pages (ships with every Python)."""
    from pydoc_data.topics import topics
    rng = random.Random(seed)
    pages = [t for t in topics.values() if len(t.split()) > 40]
    out = []
    for _ in range(n):
        w = rng.choice(pages).split()
        start = rng.randrange(0, len(w) - words[1])
        out.append(" ".join(w[start:start + rng.randint(*words)]))
    return out


def chat_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """n open chat questions on topics the trained draft never saw (minedraft/bench/prompts.py), rendered with the
    target's chat template."""
    from .prompts import open_chat_prompts
    pool = open_chat_prompts()
    random.Random(seed).shuffle(pool)
    return [tokenizer.apply_chat_template([{"role": "user", "content": pool[i % len(pool)]}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
            for i in range(n)]


def grounded(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """n grounded chat requests (minedraft/bench/workloads.py, its test split), in the target's chat template."""
    from ..engine.chat import chat_prompt_ids
    from .workloads import grounded_prompts
    pool = grounded_prompts(split="test")
    random.Random(seed).shuffle(pool)
    return [chat_prompt_ids(tokenizer, pool[i % len(pool)]) for i in range(n)]


def _disjoint(draw, batches, waves: int, repeats: int):
    """prompts_for(n, rep) over one draw of the pool: every (batch size, repeat) and the warm-up get prompts of
    their own, so a row whose drafts learn from earlier text (a suffix index) never meets a prompt it already
    answered in an earlier run of the same engine, while every row still gets the same prompts. Only a pool
    smaller than the whole draw repeats prompts."""
    offsets, off = {}, 0
    for n in sorted({b * waves for b in batches}):
        for rep in range(repeats):
            offsets[(n, rep)], off = off, off + n
    offsets[WARM_UP], off = off, off + WARM_UP[0]
    pool = draw(off, 0)

    def prompts_for(n: int, rep: int) -> list:
        o = offsets.get((n, rep))
        return draw(n, rep) if o is None else pool[o:o + n]  # None: another sample (the HF row's)
    return prompts_for


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else 0.0


async def run_workload(engine, prompts, params, rate: float | None, seed: int = 0, concurrency: int | None = None):
    """Submit prompts (all at once, or Poisson arrivals at `rate` req/s) and measure. concurrency: at most that many
    in flight, the next sent as one ends (the bench's B with --waves > 1; the engine itself admits up to its
    max_batch_size, the largest B of the sweep).

    Returns (metrics, the output token ids of each prompt, in prompt order)."""
    rng = random.Random(seed)
    before = engine.stats()
    t0 = time.perf_counter()
    slots = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(p, delay):
        await asyncio.sleep(delay)
        if slots is None:
            return await engine.generate(p, params)
        async with slots:
            return await engine.generate(p, params)
    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        if rate:
            t += rng.expovariate(rate)
    results = await asyncio.gather(*(one(p, d) for p, d in zip(prompts, delays)))
    wall = time.perf_counter() - t0
    after = engine.stats()
    d = {k: after[k] - before[k] for k in ("steps", "output_tokens", "draft_tokens", "accepted_tokens",
                                             "verified_tokens", "draft_time_s", "verify_time_s")}
    steps = max(d["steps"], 1)
    td, tv = d["draft_time_s"] / steps, d["verify_time_s"] / steps
    step_time = wall / steps
    out_tokens = sum(len(r.token_ids) for r in results)
    return {
        "tok_s": out_tokens / wall,
        "lat_p50": _pct([r.stats.latency_s for r in results], 0.5),
        "lat_p99": _pct([r.stats.latency_s for r in results], 0.99),
        "ttft_p50": _pct([r.stats.ttft_s for r in results], 0.5),
        "accept": d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else 0.0,
        "mean_len": out_tokens / max(sum(r.stats.steps for r in results), 1),
        # verifier work: tokens scored per step (drafts + one per request), and the share of them emitted
        "ver_step": d["verified_tokens"] / steps,
        "out_ver": ((d["accepted_tokens"] + d["verified_tokens"] - d["draft_tokens"]) / d["verified_tokens"]
                    if d["verified_tokens"] else 0.0),
        "td_ms": td * 1e3, "tv_ms": tv * 1e3, "step_ms": step_time * 1e3,
        "overlap": max(td, tv) / step_time if step_time else 0.0,
    }, [r.token_ids for r in results]


# --control: the output controls a run's requests carry (controls/logits.py), to price them against free requests
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
CONTROLS = {"free": {}, "penalties": dict(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1),
            # structured output ends on eos (ignore_eos is refused with it): outputs may be shorter than max_tokens
            "schema": dict(json_schema=SCHEMA, ignore_eos=False)}


def _engine_variants(args, modes, splits, tetris) -> list[tuple]:
    """(mode, kind, split, tetris) of each engine row family; kind: "fixed" (the swept k), "dynamic" or "hybrid"."""
    out = []
    for mode in modes:
        if mode == "autoregressive":
            out.append((mode, "fixed", None, False))
        elif mode == "sequential":
            out += [(mode, "fixed", None, t) for t in tetris]
        else:  # the core split sweep; dynamic speculation runs with the default split
            for t in tetris:
                out += [(mode, "fixed", n, t) for n in splits]
                if args.adaptive:
                    out.append((mode, "dynamic", None, t))
            if args.hybrid:  # the same pipeline with draft "suffix+<model>"
                out.append((mode, "hybrid", None, False))
    return out


def _points_of(variant, points) -> list[tuple]:
    """The (k, B, rate) one engine row family runs: every point, or one per (B, rate) where k does not apply (the
    target alone, dynamic speculation)."""
    if variant[0] == "autoregressive" or variant[1] == "dynamic":
        first: dict = {}
        for k, b, r in points:
            first.setdefault((b, r), (k, b, r))
        return list(first.values())
    return points


async def _engine_rows(args, variant, points, prompts_for, params, rep: int, bar, trace: bool):
    """One repeat of one engine row family over every (k, B, rate): a fresh engine, warmed up first.

    Returns ([(name, (B, rate, rep), metrics, outputs)], trace events or None)."""
    mode, kind, split, tet = variant
    ks = sorted({k for k, _, _ in points})
    allowed = available_cores()
    run_mode = default_mode(args.draft) if kind == "dynamic" else mode  # the engine's defaults, in the mode "auto" picks
    cores = dict(draft_cores=allowed[:split], target_cores=allowed[split:]) if split else {}
    cfg = EngineConfig(target=args.target, draft=f"suffix+{args.hybrid}" if kind == "hybrid" else args.draft,
                       hybrid_threshold=args.hybrid_threshold, mode=run_mode, k=max(ks),
                       adaptive_k=kind == "dynamic", tetris=tet, tetris_extra=args.tetris_extra,
                       tetris_capacity=args.tetris_capacity, max_batch_size=max(b for _, b, _ in points),
                       max_tokens_limit=max(args.max_tokens, 16), kv_cache_tokens=args.kv_cache_tokens,
                       dtype=args.dtype, **cores)
    where = f" cores={format_cores(cfg.draft_cores)}+{format_cores(cfg.target_cores)}" if split else ""
    name = run_mode + (" tetris" if tet else "") + (" (adaptive k)" if kind == "dynamic" else "") + (
        " hybrid" if kind == "hybrid" else "")
    out, events = [], None
    from ..engine.engine import Engine  # torch: not at `bench --help`
    async with Engine(cfg, trace=trace) as engine:
        await run_workload(engine, prompts_for(*WARM_UP), params, None)  # warm-up
        for k, b, r in _points_of(variant, points):
            if mode != "autoregressive" and kind != "dynamic":
                engine.scheduler.set_k(k)
            if trace:
                engine.scheduler.stats.trace.clear()
            n0 = len(engine.adaptive.history) if engine.adaptive else 0
            metrics, outputs = await run_workload(engine, prompts_for(b * args.waves, rep), params, r, seed=rep,
                                                  concurrency=b)
            if trace and k == ks[-1] and b == max(b for _, b, _ in points):
                events = list(engine.scheduler.stats.trace)
            tag = ("" if mode == "autoregressive" else f" k={'auto' if kind == 'dynamic' else k}") + where + f" B={b}"
            tag += f" rate={r:g}/s" if r else ""
            ks_run = engine.adaptive.history[n0:] if engine.adaptive else []
            if kind == "dynamic" and ks_run:  # the mean budget of this run's steps, shown in the name (_merge_repeats)
                metrics["k_auto"] = sum(ks_run) / len(ks_run)
            out.append((name + tag, (b, r, rep), metrics, outputs))
            bar.update(1)
    return out, events


async def _bench(args, control: str = "free") -> list[tuple[str, dict]]:
    ks = args.k or [default_k(args.draft or DEFAULT_DRAFT)]
    batches = args.batch or [16]
    rates = args.rate or [None]
    points = [(k, b, r) for k in ks for b in batches for r in rates]
    modes = [m for m in MODES if m in args.modes]
    workload = "chat" if args.chat else args.workload
    if workload in ("chat", "grounded"):
        from transformers import AutoTokenizer

        from ..runner.gguf import model_dir  # a .gguf target (llama.cpp runner): its companion folder
        tok = AutoTokenizer.from_pretrained(model_dir(args.target), local_files_only=True)
        make_prompts = lambda n, seed: (chat_prompts if workload == "chat" else grounded)(tok, n, seed)  # noqa: E731
    else:
        make_prompts = lambda n, seed: corpus_prompts(n, seed)  # noqa: E731
    make_prompts = _disjoint(make_prompts, batches, args.waves, args.repeats)
    splits = args.split or [None]
    allowed = available_cores()
    for n in splits:
        if n is not None and not 1 <= n < len(allowed):
            raise ValueError(f"--split {n}: the drafter needs 1..{len(allowed) - 1} of the {len(allowed)} cores")
    tetris = {"off": [False], "on": [True], "both": [False, True]}[args.tetris]
    variants = _engine_variants(args, modes, splits, tetris)
    n_runs = sum(len(_points_of(v, points)) for v in variants) * args.repeats + in_process_runs(args, points)
    if args.hf:
        n_runs += args.repeats
    bar = tqdm(total=n_runs, desc="bench", unit="run")
    # unseeded by default: seeded sampled requests take the coupled path (batch_sampling), whose acceptance is
    # lower than rejection sampling's
    params = SamplingParams(**{**dict(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True,
                                      seed=args.seed), **CONTROLS[control]})
    traced = next((v for v in variants if v[0] == "minedraft" and v[1] == "fixed" and not v[3] and v[2] == splits[-1]),
                  None) if args.trace or args.plot else None
    # Repeats outermost, each row family in turn, the order reversed every other repeat: on a shared host speed
    # drifts over minutes, and this way drift hits every row alike instead of the rows that happened to run late.
    items = [("engine", v) for v in variants] + [("in-process", v) for v in in_process_variants(args, points)]
    runs: dict[str, list] = {}  # row name -> [(metrics, outputs, (B, rate, repeat))], rows in repeat 0's order
    trace_events = None
    for rep in range(args.repeats):
        for kind, v in (items if rep % 2 == 0 else items[::-1]):
            if kind == "engine":
                got, events = await _engine_rows(args, v, points, make_prompts, params, rep, bar,
                                                 trace=v == traced and trace_events is None)
                trace_events = trace_events or events
            else:
                got = in_process_row(args, v, points, make_prompts, params, rep, bar)
            for name, key, m, outputs in got:
                runs.setdefault(name, []).append((m, outputs, key))
    rows = _merge_repeats(runs, check=args.temperature == 0 and "autoregressive" in modes)
    if args.hf:  # batch 1 only: its name puts it in the B=1 workload, the only rows it is compared with
        prompts = make_prompts(args.hf_prompts, 0)
        threads = threads_for(allowed)
        rows.append((f"hf assisted ({threads} threads) B=1",
                     hf_assisted(args.target, args.draft, prompts, args.max_tokens, args.repeats, bar, args.dtype,
                                 threads=threads)))
    bar.close()
    if trace_events:
        from .trace import plot_timeline, write_chrome_trace
        if args.trace:
            write_chrome_trace(trace_events, args.trace)
        if args.plot:
            plot_timeline(trace_events, args.plot, max_s=args.plot_seconds)
    return rows


def _merge_repeats(runs: dict[str, list], check: bool) -> list[tuple[str, dict]]:
    """One row per name: the median of its repeats; with `check` (greedy, target alone run) "same", the share of
    its outputs equal to the engine's target-alone outputs for the same prompts (the benchmark checks losslessness
    while it measures). A dynamic row's name gets the mean k its steps ran at ("k=auto(~2.4)")."""
    reference = {key: outs for name, lst in runs.items() if name.startswith("autoregressive") for _, outs, key in lst}
    rows = []
    for name, lst in runs.items():
        k_auto = [x[0]["k_auto"] for x in lst if "k_auto" in x[0]]
        m = _median([{k: v for k, v in x[0].items() if k != "k_auto"} for x in lst])
        if k_auto:
            name = name.replace("k=auto", f"k=auto(~{statistics.median(k_auto):.1f})")
        if check and not name.startswith("autoregressive"):
            pairs = [(o, r) for _, outs, key in lst if key in reference for o, r in zip(outs, reference[key])]
            if pairs:
                m["same"] = sum(o == r for o, r in pairs) / len(pairs)
        rows.append((name, m))
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minedraft bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET, help="target model dir (default: bundled tiny-target)")
    p.add_argument("--draft", default=None, help="draft model dir, or self:int4 / self:bf16 (the target's own "
                   "weights; default: the --model pair's default draft, else the bundled tiny-draft)")
    p.add_argument("--model", default=None, metavar="NAME",
                   help="a named pair instead of --target/--draft, as generate and serve take it: 'tiny' or a "
                        "pulled one such as smollm2-135m (`minedraft models list`)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="modes to compare (default: all)")
    p.add_argument("--k", type=int, nargs="+", help="draft lengths to sweep, e.g. --k 1 2 3 4 5 6 (default: 6 with --draft "
                   "suffix alone, else 4, as the engine's)")
    p.add_argument("--batch", type=int, nargs="+", help="concurrent requests to sweep (default: 16)")
    p.add_argument("--rate", type=float, nargs="+",
                   help="Poisson arrival rates in requests/s to sweep (default: all requests at once)")
    p.add_argument("--waves", type=int, default=1, help="requests per run = batch * waves, batch of them in flight "
                   "(default: 1)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default: 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--repeats", type=int, default=3, help="runs per setting; medians are reported (default: 3)")
    p.add_argument("--dynamic", "--adaptive", action=argparse.BooleanOptionalAction, dest="adaptive", default=True,
                   help="also run minedraft with dynamic speculation (adaptive k, 0 included; the engine's "
                        "default), on by default; --no-dynamic leaves that row out")
    p.add_argument("--tetris", choices=("off", "on", "both"), default="off",
                   help="sequential and minedraft rows without Tetris, with it, or both (default: off)")
    p.add_argument("--tetris-extra", type=int, default=2, help="Tetris: extra drafts per request (default: 2)")
    p.add_argument("--tetris-capacity", type=int, default=None,
                   help="Tetris: draft tokens verified per step (default: k x requests in the batch)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed every sampled request (coupled sampling; default: unseeded)")
    p.add_argument("--split", type=int, nargs="+",
                   help="minedraft core splits to sweep: the drafter gets the first N allowed cores, the verifier "
                        "the rest, e.g. --split 1 2 3 (default: the engine's default split)")
    p.add_argument("--hf", action="store_true", help="also run transformers' assisted generation (batch 1; compared "
                   "only with the B=1 rows)")
    p.add_argument("--chat", action="store_true", help="held-out chat questions in the target's chat template "
                   "instead of documentation snippets (the real pair's draft was trained on chat answers)")
    p.add_argument("--workload", choices=("docs", "chat", "grounded", "shared-prefix"), default="docs",
                   help="docs: documentation snippets as plain prompts; chat: held-out open chat questions (= --chat; "
                        "the control for suffix drafts); grounded: chat requests whose answer reuses the prompt "
                        "(edit a stdlib function, quote a passage, table to JSON, restate an answer); "
                        "shared-prefix: prefix caching on against off (its own options: `minedraft bench "
                        "--workload shared-prefix --help`; it prints each run with the time left)")
    p.add_argument("--control", nargs="+", choices=tuple(CONTROLS), default=["free"],
                   help="output controls every request carries, swept: free (none), penalties (frequency, presence "
                        "and repetition), schema (a JSON schema); rows with a control also show its price per step "
                        "over the free run (ctl +ms) when free is swept too (default: free)")
    p.add_argument("--hybrid", metavar="DIR", help="also run minedraft with draft 'suffix+DIR' (the hybrid)")
    p.add_argument("--hybrid-threshold", type=float, default=1.0,
                   help="the hybrid's suffix score threshold (default: 1.0)")
    p.add_argument("--hf-prompts", type=int, default=8, help="prompts for the HF assisted run (default: 8)")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="KV cache positions per model (default: the engine's, sized from memory and the model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="model dtype (default: float32)")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace of a minedraft run to this JSON file")
    p.add_argument("--plot", help="draw the minedraft draft/verify timeline to this PNG file")
    p.add_argument("--plot-seconds", type=float, default=None, help="only plot the first N seconds")
    return p


def _shared_prefix(argv) -> bool:
    """`--workload shared-prefix` has its own runner (bench/shared_prefix.py)."""
    return any(a == "--workload=shared-prefix" or (a == "--workload" and argv[i + 1:i + 2] == ["shared-prefix"])
               for i, a in enumerate(argv))


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):  # not every platform has it
        return 0.0


def main(argv=None) -> int:
    import sys
    argv = sys.argv[1:] if argv is None else list(argv)
    if _shared_prefix(argv):
        from .shared_prefix import main as shared_prefix_main
        return shared_prefix_main(argv)
    args = build_parser().parse_args(argv)
    loads = [_load()]
    try:
        if args.model:
            from ..models.hub import resolve_model
            args.target, args.draft = resolve_model(args.model, args.draft)
        elif args.draft is None:
            args.draft = DEFAULT_DRAFT
        try:
            import uvloop
            run = uvloop.run
        except ImportError:  # pragma: no cover
            run = asyncio.run
        rows = price_controls({c: run(_bench(args, c)) for c in dict.fromkeys(args.control)})
    except ValueError as e:  # a setting the engine rejects (cores, sizes): one line, not a traceback
        print(f"minedraft bench: error: {e}")
        return 2
    print()
    print(format_table(rows))
    print()
    print("ratios (output tokens/s, medians):")
    for line in ratios(rows):
        print(line)
    diverged = [n for n, m in rows if m.get("same", 1.0) < 1.0]
    if diverged:
        print(f"\nWARNING: greedy outputs differ from target-alone in: {', '.join(diverged)}."
              + (" Reduced-precision matmuls are not batch-invariant (the target alone changes with batch"
                 " composition); exactness holds in float32." if args.dtype != "float32" else ""))
    print()
    note = host_load_note(loads + [_load()], len(available_cores()))
    if note:
        print(note)
    print(headline(rows))  # the last line: minedraft against the best of everything else
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
