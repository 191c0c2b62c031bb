#!/usr/bin/env python
"""Attacks on `minedraft serve` and the engine's liveness and shutdown, measured (README's reliability table).

    python scripts/reliability/attack.py                       # bundled models, every attack
    python scripts/reliability/attack.py --only flood stall --frames 200000

Attacks (each against a fresh `minedraft serve` subprocess unless said otherwise):
  flood     a client sends --frames one-byte frames and then --frames `stats` requests and never reads a reply:
            the server's RSS before/after and whether it dropped the client (stats: slow_clients_dropped)
  stall     a client streams greedy requests while another sends --stall-msgs `generate` messages whose prompt is
            a list of 1M token ids, then as many with 100k ids: the longest pause of the stream, before and during
  sigterm   SIGTERM to `serve`, idle and with streams in flight: seconds until it exits, and its exit status
  engine    in-process Engine: idle and under-load shutdown time and the workers' exit codes (0 = exited on
            their own, -9 = SIGKILLed); a SIGSTOPped verifier: seconds until every pending request failed

Prints one line per figure; --json writes them to a file too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import msgpack
import zmq
import zmq.asyncio

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """`minedraft serve` in a subprocess, ready once it prints 'listening on'."""

    def __init__(self, args):
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        models = [x for k in ("target", "draft") if getattr(args, k) for x in (f"--{k}", getattr(args, k))]
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen([sys.executable, "-m", "minedraft", "serve", "--bind", self.endpoint,
                                      "--log-level", "error", *models], stdout=subprocess.PIPE, env=env)
        line = self.proc.stdout.readline().decode()
        if "listening on" not in line:
            raise RuntimeError(f"serve did not start: {line!r}")

    def stop(self) -> tuple[float, int]:
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(60)
        return time.monotonic() - t0, rc


async def ask(endpoint: str, msg: dict, timeout=30.0) -> dict:
    ctx = zmq.asyncio.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        await s.send(msgpack.packb(msg))
        if not await s.poll(int(timeout * 1000)):
            raise TimeoutError(msg)
        return msgpack.unpackb(await s.recv())
    finally:
        s.close(0)
        ctx.term()


async def server_stats(endpoint: str) -> dict:
    return (await ask(endpoint, {"v": 1, "t": "stats", "id": "st"}))["stats"]["server"]


async def attack_flood(args, out: dict) -> None:
    srv = Serve(args)
    try:
        ep, pid = srv.endpoint, srv.proc.pid
        for kind, msg in (("one-byte frames", b"\x00"), ("stats requests", msgpack.packb({"v": 1, "t": "stats",
                                                                                          "id": "s"}))):
            base = rss_mb(pid)
            before = await server_stats(ep)
            ctx = zmq.asyncio.Context()
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVHWM, 1)
            s.setsockopt(zmq.SNDHWM, 0)
            s.connect(ep)
            t0 = time.monotonic()
            for _ in range(args.frames):
                await s.send(msg)
            while True:  # until the server has read them all
                st = await server_stats(ep)
                if st["received"] - before["received"] >= args.frames or time.monotonic() - t0 > 300:
                    break
                await asyncio.sleep(0.2)
            peak = rss_mb(pid)
            s.close(0)
            ctx.term()
            await asyncio.sleep(1.0)
            after = rss_mb(pid)
            key = "frames" if kind.startswith("one") else "stats"
            out[f"flood_{key}"] = {"sent": args.frames, "rss_before_mb": round(base, 1),
                                   "rss_peak_mb": round(peak, 1), "rss_after_leave_mb": round(after, 1),
                                   "slow_clients_dropped": st.get("slow_clients_dropped", 0)
                                   - before.get("slow_clients_dropped", 0),
                                   "replies_sent": st["replies"] - before["replies"] - 1}
            print(f"flood, {args.frames} {kind} never read: server RSS {base:.0f} -> {peak:.0f} MiB (+"
                  f"{peak - base:.0f}), {after:.0f} MiB after the client left; replies sent "
                  f"{out[f'flood_{key}']['replies_sent']}, clients dropped "
                  f"{out[f'flood_{key}']['slow_clients_dropped']}", flush=True)
    finally:
        srv.stop()


async def attack_stall(args, out: dict) -> None:
    from minedraft.client import Client
    srv = Serve(args)
    try:
        async with Client(srv.endpoint, timeout=60) as c:
            async def longest_gap(flood) -> float:
                gaps, last, done = [0.0], time.monotonic(), False

                async def streams():
                    nonlocal last
                    while not done:
                        async for _ in c.stream("The class statement", {"max_tokens": 64, "ignore_eos": True}):
                            now = time.monotonic()
                            gaps.append(now - last)
                            last = now
                reader = asyncio.ensure_future(streams())
                await asyncio.sleep(0.5)
                await flood()
                done = True
                await reader
                return max(gaps)

            async def idle():
                await asyncio.sleep(3.0)

            async def flood():
                ctx = zmq.asyncio.Context()
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(srv.endpoint)
                for n in (1_000_000, 100_000):
                    msg = msgpack.packb({"v": 1, "t": "generate", "id": "f", "prompt": [1] * n})
                    for _ in range(args.stall_msgs):
                        await s.send(msg)
                        await asyncio.sleep(0.01)
                await asyncio.sleep(1.0)
                s.close(0)
                ctx.term()
            base = await longest_gap(idle)
            under = await longest_gap(flood)
        out["stall"] = {"baseline_max_gap_ms": round(base * 1000), "flood_max_gap_ms": round(under * 1000),
                        "messages": 2 * args.stall_msgs}
        print(f"stall: longest pause of another client's stream {base * 1000:.0f} ms idle, {under * 1000:.0f} ms "
              f"under {args.stall_msgs} 1M-id + {args.stall_msgs} 100k-id prompt messages", flush=True)
    finally:
        srv.stop()


async def attack_sigterm(args, out: dict) -> None:
    from minedraft.client import Client
    srv = Serve(args)
    idle, rc = srv.stop()
    srv = Serve(args)
    async with Client(srv.endpoint, timeout=60) as c:
        streams = [asyncio.ensure_future(c.generate(f"The class statement {i}", {"max_tokens": 200,
                                                                               "ignore_eos": True}))
                   for i in range(16)]
        await asyncio.sleep(1.0)
        loaded, rc2 = await asyncio.get_running_loop().run_in_executor(None, srv.stop)
        res = await asyncio.gather(*streams, return_exceptions=True)
    codes = sorted({type(r).__name__ for r in res})
    out["sigterm"] = {"idle_s": round(idle, 2), "idle_rc": rc, "loaded_s": round(loaded, 2), "loaded_rc": rc2,
                      "inflight_outcomes": codes}
    print(f"serve SIGTERM: exits in {idle:.2f} s idle (status {rc}), {loaded:.2f} s with 16 requests in flight "
          f"(status {rc2}; they ended with {', '.join(codes)})", flush=True)


async def attack_engine(args, out: dict) -> None:
    from minedraft.config import EngineConfig
    from minedraft.engine.engine import Engine
    kw = {k: getattr(args, k) for k in ("target", "draft") if getattr(args, k)}
    if "heartbeat_timeout_s" in EngineConfig.__dataclass_fields__:  # absent before liveness existed
        kw["heartbeat_timeout_s"] = args.heartbeat
    cfg = EngineConfig(**kw, max_tokens_limit=256)
    e = await Engine.start(cfg)
    await e.generate("The class statement", {"max_tokens": 16})
    procs = list(e.procs)
    t0 = time.monotonic()
    await e.shutdown()
    idle = time.monotonic() - t0
    idle_codes = [p.exitcode for p in procs]
    e = await Engine.start(cfg)
    tasks = [asyncio.ensure_future(e.generate(f"The for statement {i}", {"max_tokens": 200, "ignore_eos": True}))
             for i in range(32)]
    await asyncio.sleep(1.0)
    procs = list(e.procs)
    t0 = time.monotonic()
    await e.shutdown()
    loaded = time.monotonic() - t0
    await asyncio.gather(*tasks, return_exceptions=True)
    loaded_codes = [p.exitcode for p in procs]
    e = await Engine.start(cfg)
    tasks = [asyncio.ensure_future(e.generate(f"The while statement {i}", {"max_tokens": 250, "ignore_eos": True}))
             for i in range(16)]
    await asyncio.sleep(1.0)
    os.kill(e.procs[1].pid, signal.SIGSTOP)
    t0 = time.monotonic()
    cap = args.heartbeat + 10
    done, pending = await asyncio.wait(tasks, timeout=cap)
    detect = time.monotonic() - t0
    for t in pending:
        t.cancel()
    res = [t.exception() if t.done() and not t.cancelled() else None for t in tasks]
    failed = sum(type(r).__name__ == "EngineDeadError" for r in res)
    health = e.health()
    with contextlib.suppress(ProcessLookupError):
        os.kill(e.procs[1].pid, signal.SIGCONT)  # (before liveness) so shutdown can stop it
    await e.shutdown()
    out["engine"] = {"idle_shutdown_s": round(idle, 2), "idle_exit_codes": idle_codes,
                     "loaded_shutdown_s": round(loaded, 2), "loaded_exit_codes": loaded_codes,
                     "sigstop_detect_s": round(detect, 2), "heartbeat_timeout_s": args.heartbeat,
                     "sigstop_failed": f"{failed}/{len(res)}", "health_ok_after": health["ok"]}
    print(f"engine shutdown: {idle:.2f} s idle (worker exit codes {idle_codes}), {loaded:.2f} s with 32 requests "
          f"running (exit codes {loaded_codes})", flush=True)
    print(f"SIGSTOPped verifier: {failed}/{len(res)} pending requests failed with EngineDeadError "
          f"{'within' if not pending else 'not all after'} {detect:.2f} s (heartbeat_timeout_s={args.heartbeat:g}); "
          f"health ok={health['ok']}", flush=True)



ATTACKS = {"flood": attack_flood, "stall": attack_stall, "sigterm": attack_sigterm, "engine": attack_engine}


async def amain(args) -> int:
    out: dict = {"load": os.getloadavg(), "cpus": os.cpu_count()}
    print(f"load average {out['load'][0]:.1f} on {out['cpus']} CPUs at the start", flush=True)
    for name in args.only:
        await ATTACKS[name](args, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=list(ATTACKS), default=list(ATTACKS))
    ap.add_argument("--target", help="target model dir (default: the bundled tiny-target)")
    ap.add_argument("--draft", help="draft model dir (default: the bundled tiny-draft)")
    ap.add_argument("--frames", type=int, default=200_000, help="messages per flood")
    ap.add_argument("--stall-msgs", type=int, default=20, help="oversize-prompt messages of each size")
    ap.add_argument("--heartbeat", type=float, default=2.0, help="heartbeat_timeout_s for the SIGSTOP attack")
    ap.add_argument("--json", help="also write the figures to this file")
    return asyncio.run(amain(ap.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
