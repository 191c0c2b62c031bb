"""The benchmark runs on a tiny setting and its figures are sane (speed itself is measured by scripts, not tests)."""

import asyncio
import json

from minedraft.bench import runner as bench
from minedraft.bench.baselines import headline
from minedraft.cores import available_cores, format_cores, threads_for
from minedraft.bench.trace import segments


def test_bench_tiny_run(tiny_pair, tmp_path, capsys):
    trace, plot = tmp_path / "t.json", tmp_path / "t.png"
    cores = available_cores()
    split = ["--split", str(len(cores) - 1)] if len(cores) > 1 else []  # drafter: all but the last core
    args = bench.build_parser().parse_args(
        ["--target", tiny_pair.target, "--draft", tiny_pair.draft, "--repeats", "1", "--batch", "4",
         "--k", "1", "3", "--max-tokens", "12", "--adaptive", "--trace", str(trace), "--plot", str(plot),
         "--kv-cache-tokens", "8192", *split])
    rows = asyncio.run(bench._bench(args))
    names = [n for n, _ in rows]
    n = threads_for(cores)  # the in-process rows use what a worker on all the cores would
    assert [n.split(" k=")[0].split(" B=")[0] for n in names] == [
        "autoregressive", "sequential", "sequential", "minedraft", "minedraft", "minedraft (adaptive k)",
        f"in-process target alone ({n} threads)", f"in-process sequential SD ({n} threads)",
        f"in-process sequential SD ({n} threads)"]
    if split:  # the swept split is in the minedraft rows' names: drafter cores + verifier cores
        assert f" cores={format_cores(cores[:-1])}+{cores[-1]} B=4" in names[3]
    for name, m in rows:
        assert m["tok_s"] > 0 and 0 < m["lat_p50"] <= m["lat_p99"]
        assert 0 <= m["accept"] <= 1
        k = 0 if "target alone" in name or name.startswith("autoregressive") else (
            3 if "adaptive" in name else int(name.split("k=")[1][0]))
        assert 1 <= m["mean_len"] <= k + 1 + 1e-9
        if not name.startswith("in-process"):
            assert m["td_ms"] >= 0 and m["tv_ms"] > 0
            assert 0 < m["overlap"] <= 1.05  # max(Td, Tv) can never exceed the measured step time (plus noise)
        if not name.startswith("autoregressive"):
            assert m["same"] == 1.0  # greedy float32: every request is the target-alone output
    seq = [m for n, m in rows if "sequential" in n]
    assert len(seq) == 4 and all(0 < m["accept"] < 1 for m in seq)  # the tiny pair agrees partially
    # the trace has both lanes with draft and verify work of both batches, and the plot was drawn
    events = json.loads(trace.read_text())["traceEvents"]
    work = {(e["tid"], e["cat"], e["args"]["batch"]) for e in events if e.get("ph") == "X"}
    assert {(1, "draft", 0), (1, "draft", 1), (2, "verify", 0), (2, "verify", 1)} <= work
    assert plot.stat().st_size > 10_000
    table = bench.format_table(rows)
    assert "overlap" in table and len(table.splitlines()) == len(rows) + 3  # header, rule, rows, legend
    lines = bench.ratios(rows)
    assert any("x sequential SD at the same k" in line for line in lines)
    assert any("best fixed-k minedraft" in line for line in lines)


def test_segments_mark_handover_between_draft_and_verify():
    from minedraft.engine.scheduler import TraceEvent
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
    rows = {n: m for n, m in asyncio.run(bench._bench(args)) if not n.startswith("in-process")}
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


def _m(tok_s):
    return {"tok_s": tok_s}


def test_headline_compares_best_minedraft_with_best_of_everything_else():
    rows = [("autoregressive B=16", _m(100)), ("sequential k=3 B=16", _m(120)), ("minedraft k=3 B=16", _m(150)),
            ("minedraft k=4 B=16", _m(140)), ("in-process target alone (2 threads) B=16", _m(200)),
            ("in-process sequential SD (2 threads) k=3 B=16", _m(180)),
            ("autoregressive B=1", _m(20)), ("minedraft k=3 B=1", _m(30)), ("hf assisted (2 threads) B=1", _m(60)),
            ("autoregressive B=8", _m(50)), ("minedraft k=3 B=8", _m(60)), ("sequential (adaptive k) k=auto B=8",
                                                                          _m(80))]
    line = headline(rows)
    assert line.startswith("headline:")
    # B=16: best speculative engine row (minedraft k=3, 150) over the best row run instead (in-process target
    # alone, 200); the engine's sequential SD is minedraft's own, not an alternative
    assert "[B=16] 0.75x (minedraft k=3 150 tok/s vs in-process target alone (2 threads) 200 tok/s)" in line
    # B=8: the engine's best may be a sequential row (the default mode for suffix drafts)
    assert "[B=8] 1.60x (sequential (adaptive k) k=auto 80 tok/s vs autoregressive 50 tok/s)" in line
    # the batch-1 HF row is compared at B=1 only
    assert "[B=1] 0.50x (minedraft k=3 30 tok/s vs hf assisted (2 threads) 60 tok/s)" in line


def test_headline_is_the_last_line_printed(monkeypatch, capsys):
    rows = [("autoregressive B=4", _m(100)), ("minedraft k=3 B=4", _m(130))]

    async def fake(args, control="free"):
        return rows
    monkeypatch.setattr(bench, "_bench", fake)
    assert bench.main([]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == headline(rows) and "1.30x" in out[-1]


def test_bad_split_is_one_line_error(capsys):
    assert bench.main(["--split", str(len(available_cores()))]) == 2
    assert "--split" in capsys.readouterr().out


def test_table_shows_a_dash_for_rows_that_never_draft_and_a_legend():
    from minedraft.bench.runner import format_table
    m = {"tok_s": 1.0, "accept": 0.0, "mean_len": 1.0}
    lines = format_table([("autoregressive B=4", m), ("sequential k=2 B=4", m)]).splitlines()
    assert lines[2].split()[3] == "-" and lines[3].split()[4] == "0.00"
    assert lines[-1].startswith("accept: accepted / drafted tokens") and "ver/step" in lines[-1]


def test_bench_takes_model_like_generate(capsys):
    from minedraft.bench.runner import main
    assert main(["--model", "nosuch"]) == 2
    out = capsys.readouterr().out
    assert "unknown model 'nosuch'; known: " in out and "tiny" in out


def test_control_sweep_prices_each_control_against_the_free_run(tiny_pair):
    """--control free schema: every mode runs under each control, outputs still equal the target alone
    with the same control (greedy), and controlled rows carry ctl_ms over the free row."""
    args = bench.build_parser().parse_args(
        ["--target", tiny_pair.target, "--draft", tiny_pair.draft, "--repeats", "1", "--batch", "2", "--k", "3",
         "--max-tokens", "24", "--kv-cache-tokens", "8192", "--modes", "autoregressive", "minedraft",
         "--control", "free", "schema", "--no-dynamic"])
    rows = bench.price_controls({c: asyncio.run(bench._bench(args, c)) for c in args.control})
    by = dict(rows)
    md = by["minedraft k=3 B=2 control=schema"]
    assert md["same"] == 1.0 and md["ctl_ms"] == md["step_ms"] - by["minedraft k=3 B=2"]["step_ms"]
    assert "ctl_ms" not in by["minedraft k=3 B=2"]
    assert {bench._group(n) for n, _ in rows} == {"B=2", "B=2 control=schema"}
    assert "ctl +ms" in bench.format_table(rows)
    assert bench.price_controls({"free": rows[:1]}) == rows[:1]  # free alone: the table as before


def test_each_batch_size_repeat_and_the_warm_up_get_prompts_of_their_own():
    """A suffix index learns from every answer its engine gives, so within one row no run may meet a prompt an
    earlier run (or the warm-up) answered; every row still gets the same prompts for the same (B, repeat)."""
    from minedraft.bench.runner import WARM_UP, _disjoint
    draw = lambda n, seed: [f"p{seed}-{i}" for i in range(n)]  # noqa: E731  (a pool larger than the draw)
    prompts_for = _disjoint(draw, [1, 4, 16], waves=1, repeats=2)
    runs = [prompts_for(b, rep) for b in (1, 4, 16) for rep in range(2)] + [prompts_for(*WARM_UP)]
    seen = [p for run in runs for p in run]
    assert len(seen) == len(set(seen)) == 2 * (1 + 4 + 16) + WARM_UP[0]
    assert prompts_for(4, 1) == prompts_for(4, 1) and [len(r) for r in runs[:2]] == [1, 1]


def test_repeats_run_outermost_in_alternating_order_and_merge_into_medians(monkeypatch):
    """Every row family runs once per repeat, the order reversed every other repeat (drift on a shared host then
    hits every row alike), and each row is the median of its repeats; "same" compares each repeat's outputs with
    the target alone's for the same prompts, whichever ran first."""
    calls = []

    async def engine_rows(args, variant, points, prompts_for, params, rep, bar, trace):
        calls.append((variant[0], variant[1], rep))
        tok = {"autoregressive": 10, "sequential": 20, "minedraft": 30}[variant[0]] + rep
        outs = [[1, 2]] if variant[0] != "minedraft" or rep == 0 else [[9]]  # minedraft differs in repeat 1
        name = variant[0] + ("" if variant[0] == "autoregressive" else (
            " (adaptive k) k=auto" if variant[1] == "dynamic" else " k=2")) + " B=1"
        m = {"tok_s": tok, **({"k_auto": 1 + 2 * rep} if variant[1] == "dynamic" else {})}
        return [(name, (1, None, rep), m, outs)], None

    def local_row(args, variant, points, prompts_for, params, rep, bar):
        calls.append(("in-process", variant[0], rep))
        return [(f"in-process {variant[0]} B=1", (1, None, rep), {"tok_s": 5 + rep}, [[1, 2]])]
    monkeypatch.setattr(bench, "_engine_rows", engine_rows)
    monkeypatch.setattr(bench, "in_process_row", local_row)
    args = bench.build_parser().parse_args(["--repeats", "3", "--batch", "1", "--k", "2", "--modes",
                                            "autoregressive", "minedraft"])
    rows = asyncio.run(bench._bench(args))
    first = [c[:2] for c in calls if c[2] == 0]
    assert first == [("autoregressive", "fixed"), ("minedraft", "fixed"), ("minedraft", "dynamic"),
                     ("in-process", "autoregressive")]
    assert [c[:2] for c in calls if c[2] == 1] == first[::-1]
    assert [c[:2] for c in calls if c[2] == 2] == first
    by = dict(rows)
    assert list(by) == ["autoregressive B=1", "minedraft k=2 B=1", "minedraft (adaptive k) k=auto(~3.0) B=1",
                        "in-process autoregressive B=1"]
    assert by["autoregressive B=1"]["tok_s"] == 11 and "same" not in by["autoregressive B=1"]
    assert by["minedraft k=2 B=1"]["same"] == 1 / 3 and by["in-process autoregressive B=1"]["same"] == 1.0


def test_open_chat_questions_are_unseen_and_enough_for_a_full_sweep():
    """The open-chat workload (the control for suffix drafts) gives every B of 1..32 and two repeats questions of
    their own, on topics the trained draft never saw."""
    from minedraft.bench.prompts import TRAIN_TOPICS, _topics, held_out_prompts, open_chat_prompts
    from minedraft.bench.runner import WARM_UP
    pool = open_chat_prompts()
    assert len(set(pool)) == len(pool) >= 2 * (1 + 2 + 4 + 8 + 16 + 32) + WARM_UP[0]
    assert pool[:len(held_out_prompts())] == held_out_prompts()
    assert not any(f" {t}" in p for p in pool for t in _topics(TRAIN_TOPICS) if len(t) > 8)


def test_waves_keep_b_requests_in_flight():
    """--batch B --waves W sends B x W requests but keeps at most B in flight (the engine itself admits up to the
    sweep's largest B): a B = 1 row with waves is one request at a time, not W at once."""
    from types import SimpleNamespace

    class Engine:
        def __init__(self):
            self.live = self.peak = 0

        def stats(self):
            return dict.fromkeys(("steps", "output_tokens", "draft_tokens", "accepted_tokens", "verified_tokens",
                                  "draft_time_s", "verify_time_s"), 0)

        async def generate(self, prompt, params):
            self.live += 1
            self.peak = max(self.peak, self.live)
            await asyncio.sleep(0.01)
            self.live -= 1
            return SimpleNamespace(token_ids=[1, 2], stats=SimpleNamespace(latency_s=0.01, ttft_s=0.005, steps=2))

    for b, expected in ((1, 1), (3, 3), (None, 8)):
        engine = Engine()
        metrics, outs = asyncio.run(bench.run_workload(engine, [[1]] * 8, None, None, concurrency=b))
        assert engine.peak == expected and len(outs) == 8
