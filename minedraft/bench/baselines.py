"""The bench's fair baselines and its headline.

A user who does not run minedraft would run the target alone (or standard speculative decoding) in one process on
every core the machine gives them, so those are the rows minedraft has to beat: `LocalEngine` in this process with
one torch thread per core the engine may use. The headline compares minedraft's best row with the best row of any
other kind in the same workload (same batch size and arrival rate), not only with SD through the same processes.
"""

from __future__ import annotations

import statistics
import time

from ..config import EngineConfig
from ..cores import available_cores, threads_for

IN_PROCESS_AR = "in-process target alone"
IN_PROCESS_SD = "in-process sequential SD"


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else 0.0


def _metrics(results, wall: float) -> dict:
    st = [r.stats for r in results]
    out = sum(len(r.token_ids) for r in results)
    drafted = sum(s.draft_tokens for s in st)
    return {"tok_s": out / wall, "lat_p50": _pct([s.latency_s for s in st], 0.5),
            "lat_p99": _pct([s.latency_s for s in st], 0.99), "ttft_p50": _pct([s.ttft_s for s in st], 0.5),
            "accept": sum(s.accepted_tokens for s in st) / drafted if drafted else 0.0,
            "mean_len": out / max(sum(s.steps for s in st), 1)}


WARM_UP = (2, 99)  # (prompts, key) of the warm-up every engine row and in-process row runs first


def in_process_variants(args, points) -> list[tuple[str, int | None]]:
    """(mode, k) of each in-process row family: the target alone, then sequential SD at each swept k."""
    out = [("autoregressive", None)] if "autoregressive" in args.modes else []
    if "sequential" in args.modes:
        out += [("sequential", k) for k in sorted({k for k, _, _ in points})]
    return out


def in_process_row(args, variant, points, prompts_for, params, rep: int, bar) -> list[tuple]:
    """One repeat of one in-process row family over every B: `LocalEngine` in this process on all the engine's
    cores, warmed up first, as the engine rows are. Arrival rates do not apply to a synchronous loop, so each B is
    run once with every request submitted at once and keyed as the engine's rows of that B without a rate.
    prompts_for(B, rep) gives the same prompts the engine rows got.

    Returns [(name, (B, None, rep), metrics, outputs)] as the engine rows (runner._engine_rows)."""
    import torch

    from ..engine.local_engine import LocalEngine
    mode, k = variant
    threads = threads_for(available_cores())  # what the engine's workers would use on all these cores
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    kw = dict(target=args.target, draft=args.draft, max_batch_size=max(b for _, b, _ in points),
              max_tokens_limit=max(args.max_tokens, 16), kv_cache_tokens=args.kv_cache_tokens, dtype=args.dtype)
    name = f"{IN_PROCESS_AR if mode == 'autoregressive' else IN_PROCESS_SD} ({threads} threads)" + (
        f" k={k}" if k else "")
    out = []
    try:
        engine = LocalEngine(EngineConfig(mode=mode, k=k or 1, **kw))
        engine.generate(prompts_for(*WARM_UP), params)  # a suffix index learns what it sees: as the engine rows
        for b in sorted({b for _, b, _ in points}):
            prompts = prompts_for(b * args.waves, rep)
            engine.config.max_batch_size = b  # B in flight, as the engine rows (--waves > 1 sends B x waves)
            t0 = time.perf_counter()
            res = engine.generate(prompts, params)
            out.append((f"{name} B={b}", (b, None, rep), _metrics(res, time.perf_counter() - t0),
                        [r.token_ids for r in res]))
            bar.update(1)
    finally:
        torch.set_num_threads(before)
    return out


def in_process_runs(args, points) -> int:
    """How many timed runs in_process_rows will make (for the progress bar)."""
    n_b = len({b for _, b, _ in points})
    per = (1 if "autoregressive" in args.modes else 0) + (len({k for k, _, _ in points})
                                                          if "sequential" in args.modes else 0)
    return per * n_b * args.repeats


def _group(name: str) -> str:
    return name[name.index(" B=") + 1:] if " B=" in name else ""


def _speculative_engine_row(name: str) -> bool:
    """A row of minedraft speculating (any mode of the engine but autoregressive), as opposed to what a user
    would run instead: the target alone (the engine's or in one process), in-process SD, HF assisted."""
    return name.startswith(("minedraft", "sequential"))


def headline(rows: list[tuple[str, dict]]) -> str:
    """One line: per workload, minedraft's best speculative row over the best row a user would run instead."""
    parts = []
    for g in dict.fromkeys(_group(n) for n, _ in rows if _group(n)):
        grp = [(n, m) for n, m in rows if _group(n) == g]
        md = [(n, m) for n, m in grp if _speculative_engine_row(n)]
        other = [(n, m) for n, m in grp if not _speculative_engine_row(n)]
        if not md or not other:
            continue
        bn, bm = max(md, key=lambda x: x[1]["tok_s"])
        on, om = max(other, key=lambda x: x[1]["tok_s"])
        strip = lambda n: n[:n.index(" B=")]  # noqa: E731
        parts.append(f"[{g}] {bm['tok_s'] / om['tok_s']:.2f}x ({strip(bn)} {bm['tok_s']:.0f} tok/s vs "
                     f"{strip(on)} {om['tok_s']:.0f} tok/s)")
    if not parts:
        return "headline: no workload has both a minedraft row and another row to compare"
    return ("headline: minedraft's best speculative row (any mode) over the best row you would run instead "
            "(target alone, in-process SD, HF assisted), same hardware (above 1x minedraft is faster, below 1x "
            "slower): " + "; ".join(parts))


def hf_assisted(target: str, draft: str, prompts, max_tokens: int, repeats: int, bar=None,
                dtype="float32", threads: int = 1) -> dict:
    """transformers' assisted generation (assistant_model), batch 1 (its only mode), greedy, `threads` threads."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype)
    tok = AutoTokenizer.from_pretrained(target, local_files_only=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tm = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, local_files_only=True).to(dev).eval()
    from ..config import self_scheme
    scheme = self_scheme(draft)
    if scheme is not None:  # the same self-draft the engine builds, as a transformers model
        from ..drafting.self_draft import convert
        dm = convert(AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, local_files_only=True)
                     .to(dev), scheme)
    else:
        dm = AutoModelForCausalLM.from_pretrained(draft, dtype=dtype, local_files_only=True).to(dev).eval()
    runs = []
    for _ in range(repeats):
        lat, n = [], 0
        t0 = time.perf_counter()
        for p in prompts:
            ids = (torch.tensor([p]) if isinstance(p, list) else tok(p, return_tensors="pt").input_ids).to(dev)
            s = time.perf_counter()
            with torch.no_grad():
                out = tm.generate(ids, assistant_model=dm, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                  do_sample=False, pad_token_id=tok.eos_token_id)
            lat.append(time.perf_counter() - s)
            n += out.shape[1] - ids.shape[1]
        wall = time.perf_counter() - t0
        runs.append({"tok_s": n / wall, "lat_p50": _pct(lat, 0.5), "lat_p99": _pct(lat, 0.99)})
        if bar:
            bar.update(1)
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}
