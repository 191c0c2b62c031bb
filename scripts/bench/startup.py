"""Start-up as a user waits for it, for one or more checkouts run alternately (A/B on the same box):

    python scripts/bench/startup.py --root /path/to/old/checkout --root . [--repeats 3] [--model smollm2-135m]

Per root and repeat: `minedraft generate "The while statement is used for"` (the README's first command; its own
summary line gives the seconds from launch to the first streamed text) and `minedraft serve --http 127.0.0.1:0`
(seconds from launch to its 'listening on' line, then SIGTERM). Prints one line per run and the medians."""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time

FIRST = re.compile(r"first text ([\d.]+) s after launch")


def env_for(root: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(root))
    env.pop("MINEDRAFT_WORKER_THREADS", None)
    return env


def first_text(root: str, model: list[str]) -> float:
    r = subprocess.run([sys.executable, "-m", "minedraft", "generate", *model, "--max-tokens", "16",
                        "The while statement is used for"], env=env_for(root), capture_output=True, text=True,
                       timeout=600, cwd=os.path.abspath(root))
    m = FIRST.search(r.stderr)
    if not m:
        raise RuntimeError(r.stderr[-800:])
    return float(m.group(1))


def serve_ready(root: str, model: list[str]) -> float:
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "minedraft", "serve", *model, "--http", "127.0.0.1:0"],
                         env=env_for(root), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         cwd=os.path.abspath(root))
    try:
        line = p.stdout.readline()
        took = time.monotonic() - t0
        if not line.startswith("listening on"):
            raise RuntimeError(f"serve did not start: {line!r}")
        return took
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", action="append", required=True, help="a checkout to run (repeat: A/B alternately)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="a pulled pair (default: the bundled pair)")
    a = ap.parse_args()
    model = ["--model", a.model] if a.model else []
    got = {(r, w): [] for r in a.root for w in ("generate", "serve")}
    for rep in range(a.repeats):
        for root in a.root:
            for what, fn in (("generate", first_text), ("serve", serve_ready)):
                got[root, what].append(fn(root, model))
                print(f"repeat {rep} {root:<30} {what:<8} {got[root, what][-1]:6.1f} s (load "
                      f"{os.getloadavg()[0]:.1f})", flush=True)
    for (root, what), xs in got.items():
        print(f"median {root:<30} {what:<8} {statistics.median(xs):6.1f} s over {len(xs)}")


if __name__ == "__main__":
    main()
