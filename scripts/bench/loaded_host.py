"""Each mode's decode speed through `minedraft generate` with and without a competing CPU-bound process pinned to
one core, for one or two checkouts of the code run alternately (A/B on the same box, the same minute):

    python scripts/bench/loaded_host.py --root /path/to/old/checkout --root . [--model smollm2-135m]

For every mode (minedraft, sequential, autoregressive, and --draft suffix), hog off / on, and root, it runs
`minedraft generate` (default threads: what a user gets) on PROMPT and reads the tokens/s of its summary line
(output tokens over the request's latency) and the "first text ... after launch" figure. The hog is `while True:
pass` in a child process pinned (sched_setaffinity) to the first core this process may use. Prints one table."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

PROMPT = "The while statement is used for"
MODES = {"minedraft": ["--mode", "minedraft"], "sequential": ["--mode", "sequential"],
         "autoregressive": ["--mode", "autoregressive"], "suffix": ["--draft", "suffix"]}
SPEED = re.compile(r"\(([\d.]+) tokens/s\)")
FIRST = re.compile(r"first text ([\d.]+) s after launch")


def hog() -> subprocess.Popen:
    core = sorted(os.sched_getaffinity(0))[0]
    return subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])


def generate(root: str, extra: list[str], tokens: int, one_thread: bool = False) -> tuple[float, float | None]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(root))
    env.pop("MINEDRAFT_WORKER_THREADS", None)  # the defaults, as a user gets them
    if one_thread:
        env["MINEDRAFT_WORKER_THREADS"] = "1"
    cmd = [sys.executable, "-m", "minedraft", "generate", "--max-tokens", str(tokens), "--ignore-eos", *extra, PROMPT]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=os.path.abspath(root))
    m, first = SPEED.search(r.stderr), FIRST.search(r.stderr)
    if r.returncode != 0 or not m:
        raise RuntimeError(f"{cmd} failed: {r.stderr[-800:]}")
    return float(m.group(1)), float(first.group(1)) if first else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", action="append", required=True, help="a checkout to run (repeat: A/B alternately)")
    ap.add_argument("--model", default=None, help="a pulled pair (default: the bundled pair)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--one-thread", action="store_true",
                    help="also run each root with MINEDRAFT_WORKER_THREADS=1 (the yardstick: one thread per worker)")
    a = ap.parse_args()
    model = ["--model", a.model] if a.model else []
    rows = []
    for mode in a.modes:
        for with_hog in (False, True):
            for root, one in [(r, o) for r in a.root for o in ((False, True) if a.one_thread else (False,))]:
                h = hog() if with_hog else None
                try:
                    t0 = time.monotonic()
                    tps, first = generate(root, model + MODES[mode], a.max_tokens, one)
                finally:
                    if h is not None:
                        h.kill()
                        h.wait()
                rows.append((mode, "on" if with_hog else "off", root + (" 1 thread" if one else ""), tps, first,
                             time.monotonic() - t0))
                print(f"{mode:<15} hog {rows[-1][1]:<3} {rows[-1][2]:<30} {tps:8.1f} tok/s  first text "
                      f"{first if first is not None else float('nan'):6.1f} s  (run {rows[-1][5]:.0f} s, load "
                      f"{os.getloadavg()[0]:.1f})", flush=True)


if __name__ == "__main__":
    main()
