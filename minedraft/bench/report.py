"""The bench's report: the table, the ratios under it, and the merge of --control sweeps into one table."""

from __future__ import annotations

import statistics

from .baselines import IN_PROCESS_AR


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


LOADED = 0.75  # load average per usable core from which a host counts as busy with other work


def host_load_note(loads: list[float], cores: int) -> str | None:
    """A line for above the headline when the host was busy with other processes while the bench ran (the
    1-minute load average, sampled at its start and end, over LOADED per usable core): minedraft's workers and
    the in-process baselines then compete for the cores, and ratios measured so can be off by several times
    (docs/BENCHMARKS.md "Threads on a loaded host"). None on a quiet host."""
    worst = max(loads)
    if worst <= LOADED * cores:
        return None
    return (f"NOTE: this host was loaded while the bench ran (load average {min(loads):.1f}-{worst:.1f} on {cores} "
            f"usable core{'s' if cores != 1 else ''}): other processes took CPU time from the rows, so these ratios, "
            "the headline included, may not hold on a quiet host; rerun there before drawing conclusions.")
