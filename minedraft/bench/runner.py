"""Benchmark: target-alone, sequential SD, the MINEDRAFT two-batch pipeline, and HF assisted generation,
on the same models, prompts and machine, in one run. `minedraft bench --help` lists the options.

Every figure is a median over --repeats runs. Td / Tv are the mean draft and verify times of one step (one
batch); step time is the wall time per verify step, and overlap efficiency is max(Td, Tv) / step time: close
to 1 when one device never waits for the other, about max/(Td+Tv) when they take turns. In greedy runs
"same" is the share of requests whose output is token-for-token the target-alone output for the same
prompts: the benchmark checks losslessness while it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from tqdm import tqdm

from .baselines import IN_PROCESS_AR, WARM_UP, headline, hf_assisted, in_process_rows, in_process_runs
from ..config import DEFAULT_DRAFT, DEFAULT_TARGET, EngineConfig, default_mode
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
    """n held-out chat questions (minedraft/bench/prompts.py), rendered with the target's chat template."""
    from .prompts import held_out_prompts
    pool = held_out_prompts()
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


async def run_workload(engine, prompts, params, rate: float | None, seed: int = 0):
    """Submit prompts (all at once, or Poisson arrivals at `rate` req/s) and measure.

    Returns (metrics, the output token ids of each prompt, in prompt order)."""
    rng = random.Random(seed)
    before = engine.stats()
    t0 = time.perf_counter()

    async def one(p, delay):
        await asyncio.sleep(delay)
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


def _median(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


COLS = [("tok_s", "tok/s", "{:8.1f}"), ("lat_p50", "lat p50 s", "{:9.3f}"), ("lat_p99", "lat p99 s", "{:9.3f}"),
        ("ttft_p50", "ttft s", "{:7.3f}"), ("accept", "accept", "{:6.2f}"), ("mean_len", "tok/step", "{:8.2f}"),
        ("ver_step", "ver/step", "{:8.1f}"), ("out_ver", "out/ver", "{:7.2f}"),
        ("td_ms", "Td ms", "{:7.2f}"), ("tv_ms", "Tv ms", "{:7.2f}"), ("step_ms", "step ms", "{:7.2f}"),
        ("overlap", "overlap", "{:7.2f}"), ("same", "same", "{:5.2f}"), ("ctl_ms", "ctl +ms", "{:7.2f}")]


LEGEND = ("accept: accepted / drafted tokens (- : the row never drafts); tok/step: output tokens per request "
          "step; ver/step: tokens the verifier scores per step (drafts + one per request); out/ver: output tokens "
          "per scored token; Td/Tv: draft/verify time per step; overlap: max(Td, Tv) / step time; same: share of "
          "greedy outputs equal to the target alone's; ctl +ms (--control): step ms over the same row's free run, "
          "the price of the controls per step")


def format_table(rows: list[tuple[str, dict]]) -> str:
    w = max([50] + [len(n) + 1 for n, _ in rows])
    head = f"{'setting':{w}s}" + "".join(f"{h:>{len(fmt.format(0))+1}s}" for _, h, fmt in COLS)
    lines = [head, "-" * len(head)]
    for name, m in rows:
        never_drafts = name.startswith(("autoregressive", IN_PROCESS_AR))

        def cell(k, fmt):
            width = len(fmt.format(0))
            if k == "accept" and never_drafts:
                return f"{'-':>{width}s}"
            return fmt.format(m[k]) if k in m else " " * width
        lines.append(f"{name:{w}s}" + "".join(" " + cell(k, fmt) for k, _, fmt in COLS))
    return "\n".join(lines + [LEGEND])


# --control: the output controls a run's requests carry (spec/controls.py), to price them against free requests
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
CONTROLS = {"free": {}, "penalties": dict(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1),
            # structured output ends on eos (ignore_eos is refused with it): outputs may be shorter than max_tokens
            "schema": dict(json_schema=SCHEMA, ignore_eos=False)}


async def _bench(args, control: str = "free") -> list[tuple[str, dict]]:
    ks = args.k or [4]
    batches = args.batch or [16]
    rates = args.rate or [None]
    points = [(k, b, r) for k in ks for b in batches for r in rates]
    modes = [m for m in MODES if m in args.modes]  # target-alone first: it is the reference for "same"
    workload = "chat" if args.chat else args.workload
    if workload in ("chat", "grounded"):
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.target, local_files_only=True)
        make_prompts = lambda n, seed: (chat_prompts if workload == "chat" else grounded)(tok, n, seed)  # noqa: E731
    else:
        make_prompts = lambda n, seed: corpus_prompts(n, seed)  # noqa: E731
    make_prompts = _disjoint(make_prompts, batches, args.waves, args.repeats)
    splits = args.split or [None]
    allowed = available_cores()
    for n in splits:
        if n is not None and not 1 <= n < len(allowed):
            raise ValueError(f"--split {n}: the drafter needs 1..{len(allowed) - 1} of the {len(allowed)} cores")
    workloads = len({(b, r) for _, b, r in points})
    tetris = {"off": [False], "on": [True], "both": [False, True]}[args.tetris]
    per_mode = {"autoregressive": workloads, "sequential": len(points) * len(tetris),
                "minedraft": (len(points) * len(splits) + (workloads if args.adaptive else 0)) * len(tetris)
                + (len(points) if args.hybrid else 0)}
    n_runs = sum(per_mode[m] for m in modes) * args.repeats + in_process_runs(args, points)
    if args.hf:
        n_runs += args.repeats
    bar = tqdm(total=n_runs, desc="bench", unit="run")
    rows: list[tuple[str, dict]] = []
    trace_events = None
    # Greedy runs double as a losslessness check: every SD row's outputs against target-alone's, per workload.
    reference: dict = {}
    check = args.temperature == 0 and "autoregressive" in modes
    # unseeded by default: seeded sampled requests take the coupled path (batch_sampling), whose acceptance is
    # lower than rejection sampling's
    params = SamplingParams(**{**dict(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True,
                                      seed=args.seed), **CONTROLS[control]})
    for mode in modes:
        variants = [(False, None, t) for t in tetris] if mode == "sequential" else [(False, None, False)]
        if mode == "minedraft":  # the core split sweep; adaptive k runs with the default split
            variants = [(a, n, t) for t in tetris
                        for a, n in [(False, n) for n in splits] + ([(True, None)] if args.adaptive else [])]
            if args.hybrid:  # the same pipeline with draft "suffix+<model>"
                variants.append(("hybrid", None, False))
        for adaptive, split, tet in variants:
            hybrid = adaptive == "hybrid"
            adaptive = adaptive is True
            # the dynamic row is the engine's defaults: in the mode "auto" picks for this draft
            run_mode = default_mode(args.draft) if adaptive else mode
            cores = dict(draft_cores=allowed[:split], target_cores=allowed[split:]) if split else {}
            cfg = EngineConfig(target=args.target, draft=f"suffix+{args.hybrid}" if hybrid else args.draft,
                               hybrid_threshold=args.hybrid_threshold, mode=run_mode, k=max(ks), adaptive_k=adaptive,
                               tetris=tet, tetris_extra=args.tetris_extra, tetris_capacity=args.tetris_capacity,
                               max_batch_size=max(batches), max_tokens_limit=max(args.max_tokens, 16),
                               kv_cache_tokens=args.kv_cache_tokens, dtype=args.dtype, **cores)
            where = (f" cores={format_cores(cfg.draft_cores)}+{format_cores(cfg.target_cores)}" if split else "")
            want_trace = (bool(args.trace or args.plot) and mode == "minedraft" and not adaptive and not tet
                          and split == splits[-1])
            from ..engine.engine import Engine  # torch: not at `bench --help`
            async with Engine(cfg, trace=want_trace) as engine:
                await run_workload(engine, make_prompts(*WARM_UP), params, None)  # warm-up
                seen: set = set()
                for k, b, r in points:
                    if mode == "autoregressive" or adaptive:  # k does not apply: one run per (B, rate)
                        if (b, r) in seen:
                            continue
                        seen.add((b, r))
                    if mode != "autoregressive" and not adaptive:
                        engine.scheduler.set_k(k)
                    runs, same, total = [], 0, 0
                    for rep in range(args.repeats):
                        if want_trace:
                            engine.scheduler.stats.trace.clear()
                        prompts = make_prompts(b * args.waves, rep)
                        metrics, outputs = await run_workload(engine, prompts, params, r, seed=rep)
                        runs.append(metrics)
                        if check and mode == "autoregressive":
                            reference[(b, r, rep)] = outputs
                        elif check:
                            same += sum(o == ref for o, ref in zip(outputs, reference[(b, r, rep)]))
                            total += len(outputs)
                        if want_trace and trace_events is None and k == ks[-1] and b == batches[-1]:
                            trace_events = list(engine.scheduler.stats.trace)
                        bar.update(1)
                    name = run_mode + (" tetris" if tet else "") + (" (adaptive k)" if adaptive else "") + (
                        " hybrid" if hybrid else "")
                    tag = ("" if mode == "autoregressive" else f" k={'auto' if adaptive else k}") + where + f" B={b}"
                    tag += f" rate={r:g}/s" if r else ""
                    m = _median(runs)
                    if total:
                        m["same"] = same / total  # share of requests identical to target-alone, all repeats
                    if adaptive and engine.adaptive and engine.adaptive.history:
                        tag = tag.replace("k=auto", f"k=auto(~{statistics.median(engine.adaptive.history):g})")
                    rows.append((name + tag, m))
    # the baselines a user would run instead: one process, every core the engine may use
    rows += in_process_rows(args, points, make_prompts, params, reference, bar)
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


def _group(name: str) -> str:
    """The workload part of a row name ("B=16 rate=20/s"): rows of one group are comparable."""
    return name[name.index(" B=") + 1:] if " B=" in name else ""


def _k(name: str) -> str:
    return name.split(" k=", 1)[1].split(" ", 1)[0] if " k=" in name else ""


def ratios(rows: list[tuple[str, dict]]) -> list[str]:
    """Throughput against sequential SD at the same k, the best sequential k, and target-alone."""
    out = []
    for g in dict.fromkeys(_group(n) for n, _ in rows if _group(n)):
        grp = [(n, m) for n, m in rows if _group(n) == g]
        ar = next((m for n, m in grp if n.startswith("autoregressive")), None)
        seq = {_k(n): m for n, m in grp if n.startswith("sequential k=")}
        md = {_k(n): m for n, m in grp if n.startswith("minedraft k=")}
        best_seq = max(seq.items(), key=lambda x: x[1]["tok_s"]) if seq else None
        best_md = max(md.items(), key=lambda x: x[1]["tok_s"]) if md else None
        out.append(f"[{g}]")
        for n, m in grp:
            parts = []
            if n.startswith("minedraft") and _k(n) in seq:
                parts.append(f"{m['tok_s'] / seq[_k(n)]['tok_s']:.2f}x sequential SD at the same k")
            if (n.startswith("minedraft") or n.startswith("hf")) and best_seq:
                parts.append(f"{m['tok_s'] / best_seq[1]['tok_s']:.2f}x best sequential SD (k={best_seq[0]})")
            if n.startswith("minedraft tetris k=") and _k(n) in md:
                parts.append(f"{m['tok_s'] / md[_k(n)]['tok_s']:.2f}x plain minedraft at the same k")
            if n.startswith("sequential tetris k=") and _k(n) in seq:
                parts.append(f"{m['tok_s'] / seq[_k(n)]['tok_s']:.2f}x plain sequential SD at the same k")
            if "adaptive" in n and best_md:
                parts.append(f"{m['tok_s'] / best_md[1]['tok_s']:.2f}x best fixed-k minedraft (k={best_md[0]})")
            if ar and not n.startswith("autoregressive"):
                parts.append(f"{m['tok_s'] / ar['tok_s']:.2f}x autoregressive")
            if parts:
                out.append(f"  {n}: " + ", ".join(parts))
    return out


def price_controls(by_control: dict[str, list[tuple[str, dict]]]) -> list[tuple[str, dict]]:
    """One table from the runs of each --control: a controlled row is named "... B=8 control=schema" (its own
    workload group: compared with rows under the same control) and gets ctl_ms, its step time over the same row's
    free run."""
    if list(by_control) == ["free"]:
        return by_control["free"]
    free = dict(by_control.get("free", []))
    rows = []
    for c, rs in by_control.items():
        for name, m in rs:
            if c != "free":
                if name in free and "step_ms" in m and "step_ms" in free[name]:
                    m = {**m, "ctl_ms": m["step_ms"] - free[name]["step_ms"]}
                name = f"{name} control={c}"
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
    p.add_argument("--k", type=int, nargs="+", help="draft lengths to sweep, e.g. --k 1 2 3 4 5 6 (default: 4)")
    p.add_argument("--batch", type=int, nargs="+", help="concurrent requests to sweep (default: 16)")
    p.add_argument("--rate", type=float, nargs="+",
                   help="Poisson arrival rates in requests/s to sweep (default: all requests at once)")
    p.add_argument("--waves", type=int, default=1, help="requests per run = batch * waves (default: 1)")
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
    p.add_argument("--workload", choices=("docs", "chat", "grounded"), default="docs",
                   help="docs: documentation snippets as plain prompts; chat: held-out open chat questions (= --chat; "
                        "the control for suffix drafts); grounded: chat requests whose answer reuses the prompt "
                        "(edit a stdlib function, quote a passage, table to JSON, restate an answer)")
    p.add_argument("--control", nargs="+", choices=tuple(CONTROLS), default=["free"],
                   help="output controls every request carries, swept: free (none), penalties (frequency, presence "
                        "and repetition), schema (a JSON schema); rows with a control also show its price per step "
                        "over the free run (ctl +ms) when free is swept too (default: free)")
    p.add_argument("--hybrid", metavar="DIR", help="also run minedraft with draft 'suffix+DIR' (the hybrid)")
    p.add_argument("--hybrid-threshold", type=float, default=1.0,
                   help="the hybrid's suffix score threshold (default: 1.0)")
    p.add_argument("--hf-prompts", type=int, default=8, help="prompts for the HF assisted run (default: 8)")
    p.add_argument("--kv-cache-tokens", type=int, default=65536, help="KV cache positions per model")
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


def main(argv=None) -> int:
    import sys
    argv = sys.argv[1:] if argv is None else list(argv)
    if _shared_prefix(argv):
        from .shared_prefix import main as shared_prefix_main
        return shared_prefix_main(argv)
    args = build_parser().parse_args(argv)
    try:
        if args.model:
            from ..cli.models import resolve_model
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
    print(headline(rows))  # the last line: minedraft against the best of everything else
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
