"""The benchmark runs on a tiny setting and its figures are sane (speed itself is measured by scripts, not tests)."""

import asyncio
import json

from minedraft import bench
from minedraft.trace import segments


def test_bench_tiny_run(tiny_pair, tmp_path, capsys):
    trace, plot = tmp_path / "t.json", tmp_path / "t.png"
    args = bench.build_parser().parse_args(
        ["--target", tiny_pair.target, "--draft", tiny_pair.draft, "--repeats", "1", "--batch", "4",
         "--k", "1", "3", "--max-tokens", "12", "--adaptive", "--trace", str(trace), "--plot", str(plot),
         "--kv-cache-tokens", "8192"])
    rows = asyncio.run(bench._bench(args))
    names = [n for n, _ in rows]
    assert [n.split(" k=")[0].split(" B=")[0] for n in names] == [
        "autoregressive", "sequential", "sequential", "minedraft", "minedraft", "minedraft (adaptive k)"]
    for name, m in rows:
        assert m["tok_s"] > 0 and 0 < m["lat_p50"] <= m["lat_p99"]
        assert 0 <= m["accept"] <= 1
        k = 0 if name.startswith("autoregressive") else (3 if "adaptive" in name else int(name.split("k=")[1][0]))
        assert 1 <= m["mean_len"] <= k + 1 + 1e-9
        assert m["td_ms"] >= 0 and m["tv_ms"] > 0
        assert 0 < m["overlap"] <= 1.05  # max(Td, Tv) can never exceed the measured step time (plus noise)
        if not name.startswith("autoregressive"):
            assert m["same"] == 1.0  # greedy float32: every request is the target-alone output
    seq = [m for n, m in rows if n.startswith("sequential")]
    assert all(0 < m["accept"] < 1 for m in seq)  # the tiny pair agrees partially
    # the trace has both lanes with draft and verify work of both batches, and the plot was drawn
    events = json.loads(trace.read_text())["traceEvents"]
    work = {(e["tid"], e["cat"], e["args"]["batch"]) for e in events if e.get("ph") == "X"}
    assert {(1, "draft", 0), (1, "draft", 1), (2, "verify", 0), (2, "verify", 1)} <= work
    assert plot.stat().st_size > 10_000
    table = bench.format_table(rows)
    assert "overlap" in table and len(table.splitlines()) == len(rows) + 2
    lines = bench.ratios(rows)
    assert any("x sequential SD at the same k" in line for line in lines)
    assert any("best fixed-k minedraft" in line for line in lines)


def test_segments_mark_handover_between_draft_and_verify():
    from minedraft.async_scheduler import TraceEvent
    ev = [TraceEvent("drafter", "draft", 0, 0.0, 1.0, 0), TraceEvent("verifier", "verify", 0, 1.5, 3.0, 0),
          TraceEvent("drafter", "draft", 1, 1.0, 2.0, 1), TraceEvent("drafter", "draft", 0, 3.2, 4.0, 2)]
    segs = segments(ev)
    assert ("drafter", "broadcast", 0, 1.0, 1.5) in segs
    assert ("verifier", "return", 0, 3.0, 3.2) in segs


def test_bench_tetris_and_dynamic_rows(tiny_pair):
    """--tetris both --dynamic adds the Tetris and dynamic rows; the verifier-work columns add up."""
    args = bench.build_parser().parse_args(
        ["--target", tiny_pair.target, "--draft", tiny_pair.draft, "--repeats", "1", "--batch", "4", "--k", "2",
         "--max-tokens", "10", "--modes", "autoregressive", "minedraft", "--tetris", "both", "--dynamic",
         "--kv-cache-tokens", "8192"])
    rows = dict(asyncio.run(bench._bench(args)))
    names = [n.split(" k=")[0].split(" B=")[0] for n in rows]
    assert names == ["autoregressive", "minedraft", "minedraft (adaptive k)", "minedraft tetris",
                     "minedraft tetris (adaptive k)"]
    ar = next(m for n, m in rows.items() if n.startswith("autoregressive"))
    assert ar["out_ver"] == 1.0 and 1 <= ar["ver_step"] <= 4  # one token scored per request, all emitted
    for n, m in rows.items():
        assert n.startswith("autoregressive") or m["same"] == 1.0
        assert 0 < m["out_ver"] <= 1
        # each request scores its drafts plus one token; a step holds at most one batch's 4 requests
        assert m["ver_step"] <= 4 * (1 + 2 + (2 if "tetris" in n else 0)) + 1e-9
    plain = rows[next(n for n in rows if n.startswith("minedraft k=2"))]
    assert plain["out_ver"] < 1  # some drafts were rejected: verify work was wasted
    assert any("x plain minedraft at the same k" in line for line in bench.ratios(list(rows.items())))
