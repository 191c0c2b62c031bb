"""Draft/verify timeline: Chrome/Perfetto trace JSON and a matplotlib picture of the same lanes.

Lanes: drafter (draft, broadcast) and verifier (verify, return); gaps are idle. "broadcast" is the time from a
batch's drafts being ready to the verifier starting on them (transfer plus waiting for the verifier); "return"
is from the verdict to the drafter's next draft of that batch.
"""

from __future__ import annotations

import json

from ..engine.scheduler import TraceEvent

COLORS = {0: "#4C72B0", 1: "#DD8452"}


def segments(events: list[TraceEvent]) -> list[tuple[str, str, int, float, float]]:
    """(lane, name, batch, t0, t1) for work and hand-over segments, times relative to the first event."""
    if not events:
        return []
    t_base = min(e.t0 for e in events)
    drafts = sorted((e for e in events if e.lane == "drafter"), key=lambda e: e.t0)
    verifies = sorted((e for e in events if e.lane == "verifier"), key=lambda e: e.t0)
    out = [(e.lane, e.name, e.batch, e.t0 - t_base, e.t1 - t_base) for e in events]
    by_step: dict = {}   # a leased batch (plain decoding) runs several verify steps on one drafts message
    for v in verifies:
        by_step.setdefault(v.step, v)
    last = {(v.batch, v.step): v for v in verifies}  # sorted: the step's last verify hands the batch back
    for d in drafts:
        v = by_step.get(d.step)
        if v and v.t0 > d.t1:
            out.append(("drafter", "broadcast", d.batch, d.t1 - t_base, v.t0 - t_base))
    for v in last.values():
        nxt = next((d for d in drafts if d.batch == v.batch and d.t0 >= v.t1), None)
        if nxt:
            out.append(("verifier", "return", v.batch, v.t1 - t_base, nxt.t0 - t_base))
    return sorted(out, key=lambda s: s[3])


def write_chrome_trace(events: list[TraceEvent], path: str) -> None:
    tids = {"drafter": 1, "verifier": 2}
    rows = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": t, "args": {"name": lane}} for lane, t in tids.items()]
    for lane, name, batch, t0, t1 in segments(events):
        rows.append({"name": f"{name} b{batch}", "cat": name, "ph": "X", "pid": 1, "tid": tids[lane],
                     "ts": t0 * 1e6, "dur": max(t1 - t0, 0) * 1e6, "args": {"batch": batch}})
    with open(path, "w") as f:
        json.dump({"traceEvents": rows, "displayTimeUnit": "ms"}, f)


def plot_timeline(events: list[TraceEvent], path: str, title: str = "", max_s: float | None = None) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'minedraft[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    segs = segments(events)
    if max_s is not None:
        segs = [s for s in segs if s[3] < max_s]
    fig, ax = plt.subplots(figsize=(11, 2.6))
    lanes = {"verifier": 0, "drafter": 1}
    for lane, name, batch, t0, t1 in segs:
        y = lanes[lane]
        if name in ("draft", "verify"):
            ax.broken_barh([(t0 * 1e3, (t1 - t0) * 1e3)], (y - 0.35, 0.7), color=COLORS[batch % 2],
                           edgecolor="black", linewidth=0.4)
        else:  # hand-over: thin hatched bar
            ax.broken_barh([(t0 * 1e3, (t1 - t0) * 1e3)], (y - 0.08, 0.16), color="#999999")
    ax.set_yticks([0, 1], ["verifier", "drafter"])
    ax.set_xlabel("time (ms)")
    ax.set_title(title or "draft/verify timeline (colour = batch; grey = hand-over; blank = idle)")
    ax.legend(handles=[Patch(color=COLORS[0], label="batch 0"), Patch(color=COLORS[1], label="batch 1"),
                       Patch(color="#999999", label="broadcast / return")], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
