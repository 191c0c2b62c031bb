#!/usr/bin/env python
"""Attacks on `minedraft serve --http` (issue 35), measured for README's reliability table. Traffic goes to
127.0.0.1 only, every loop is bounded.

    python scripts/reliability/attack_http.py                        # this tree, every attack
    python scripts/reliability/attack_http.py --root /tmp/before     # another checkout (the "before" figures)
    python scripts/reliability/attack_http.py --only stops chat

Attacks (each against a fresh `minedraft serve --http 127.0.0.1:0` subprocess, bundled models):
  stops     senders post completions with 10,000 non-matching 95-character stop strings (990 KB, max_tokens 512,
            ignore_eos) for --window s, then with 16 x 128-character ones (the limits), and the same flood without stop
            strings (the control): another client's 32-token greedy request latency (median, max) against its
            baseline with no flood
  chat      senders post chats of 12,000 one-character messages: the other client's latency as above; then the
            server's RSS before and after 300 such requests
  sigterm   SIGTERM with 32 SSE streams and 4 plain requests in flight: how each ended, seconds to exit, exit
            status, processes left
  idle      server under a 1,024 open-file limit; 1,100 connections send half a request and go idle; then 20
            normal requests: how many succeed and how fast, and how many idle connections the server closed
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time

try:  # the HTTP client the installed openai package is built on
    import httpx2 as httpx
except ImportError:
    import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "The while statement is used for"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def descendants(pid: int) -> list[int]:
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid and fields[0] != "Z":
                    kids.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return kids


class Serve:
    def __init__(self, root: str, nofile: int | None = None):
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}

        def limit():
            if nofile:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        self.proc = subprocess.Popen([sys.executable, "-m", "minedraft", "serve", "--http", "127.0.0.1:0",
                                      "--log-level", "error"], stdout=subprocess.PIPE, env=env, cwd=root,
                                     preexec_fn=limit)
        line = self.proc.stdout.readline().decode()
        if "listening on" not in line:
            raise RuntimeError(f"serve did not start: {line!r}")
        self.url = line.split()[-1]
        self.host, self.port = self.url.rsplit("/", 1)[-1].rsplit(":", 1)
        self.port = int(self.port)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


PROBE_TIMEOUT_S = 60.0


async def probe(url: str, seconds: float) -> list[float]:
    """Latencies of back-to-back 32-token greedy completions for `seconds` (at least 3 unless one times out:
    a timed-out request counts as PROBE_TIMEOUT_S)."""
    out = []
    t_end = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S) as c:
        while time.monotonic() < t_end or (len(out) < 3 and max(out, default=0) < PROBE_TIMEOUT_S):
            t0 = time.monotonic()
            try:
                r = await c.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 32,
                                                                "temperature": 0, "ignore_eos": True})
                r.raise_for_status()
                out.append(time.monotonic() - t0)
            except httpx.TimeoutException:
                out.append(PROBE_TIMEOUT_S)
    return out


def _probe_in_child(url: str, seconds: float) -> list[float]:
    return asyncio.run(probe(url, seconds))


async def other_client(url: str, seconds: float) -> list[float]:
    """The probe as another client: its own process (the flood's senders share one event loop, which would
    otherwise delay the probe's own sends and reads and charge that to the server)."""
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(1) as pool:
        return await asyncio.get_running_loop().run_in_executor(pool, _probe_in_child, url, seconds)


async def under_flood(url: str, body: dict, path: str, senders: int, seconds: float) -> tuple[list, dict]:
    """The other client's latencies while `senders` clients (one process) post `body` back to back; the flood's
    status counts."""
    raw = json.dumps(body).encode()
    statuses: dict = {}
    stop = False

    async def send():
        async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S) as c:
            while not stop:
                try:
                    r = await c.post(url + path, content=raw, headers={"content-type": "application/json"})
                    key = r.status_code
                except httpx.HTTPError as e:
                    key = type(e).__name__
                statuses[key] = statuses.get(key, 0) + 1
    tasks = [asyncio.ensure_future(send()) for _ in range(senders)]
    await asyncio.sleep(0.5)
    lat = await other_client(url, seconds)
    stop = True
    await asyncio.gather(*tasks, return_exceptions=True)
    return lat, statuses


def summary(lat: list[float]) -> dict:
    return {"median_s": round(statistics.median(lat), 3), "max_s": round(max(lat), 3), "n": len(lat)}


async def attack_stops(args, out: dict) -> None:
    srv = Serve(args.root)
    try:
        base = summary(await other_client(srv.url, args.window))
        res = {"baseline": base}
        for name, stops in (("none", []), ("10000x95", [f"{i:05d}" + "q" * 90 for i in range(10_000)]),
                            ("16x128", [f"{i:02d}" + "q" * 126 for i in range(16)])):
            body = {"prompt": PROMPT, "max_tokens": 512, "ignore_eos": True, "temperature": 0, "stop": stops}
            lat, st = await under_flood(srv.url, body, "/v1/completions", args.senders, args.window)
            res[name] = {**summary(lat), "flood_statuses": st}
            print(f"stop strings {name}, {args.senders} senders: other client's 32-token request median "
                  f"{res[name]['median_s']:.3f} s, max {res[name]['max_s']:.3f} s (baseline {base['median_s']:.3f} / "
                  f"{base['max_s']:.3f} s); flood answered {st}", flush=True)
        out["stops"] = res
    finally:
        srv.stop()


async def attack_chat(args, out: dict) -> None:
    srv = Serve(args.root)
    try:
        body = {"messages": [{"role": "user", "content": "x"}] * 12_000, "max_tokens": 16}
        raw = json.dumps(body).encode()
        async with httpx.AsyncClient(timeout=300) as c:
            async def one():
                r = await c.post(srv.url + "/v1/chat/completions", content=raw,
                                 headers={"content-type": "application/json"})
                return r.status_code
            await asyncio.gather(*[one() for _ in range(10)])  # warm-up
            before = rss_mb(srv.proc.pid)
            codes = []
            for _ in range(30):
                codes += await asyncio.gather(*[one() for _ in range(10)])
            after = rss_mb(srv.proc.pid)
        rss = {"requests": len(codes), "statuses": sorted(set(codes)), "before_mb": round(before),
               "after_mb": round(after), "growth_mb": round(after - before)}
        base = summary(await other_client(srv.url, args.window))
        lat, st = await under_flood(srv.url, body, "/v1/chat/completions", args.chat_senders, args.window)
        res = {"rss": rss, "baseline": base, "flood": {**summary(lat), "flood_statuses": st}}
        print(f"chat 12,000 messages, {args.chat_senders} senders: other client's median {res['flood']['median_s']:.3f}"
              f" s, max {res['flood']['max_s']:.3f} s (baseline {base['median_s']:.3f} / {base['max_s']:.3f} s); "
              f"flood answered {st}", flush=True)
        out["chat"] = res
        print(f"chat, {len(codes)} refused requests (statuses {sorted(set(codes))}): server RSS {before:.0f} -> "
              f"{after:.0f} MB ({after - before:+.0f})", flush=True)
    finally:
        srv.stop()


async def attack_sigterm(args, out: dict) -> None:
    srv = Serve(args.root)
    kids = descendants(srv.proc.pid)
    body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "temperature": 0}
    started = asyncio.Semaphore(0)

    async def stream(c):
        events = []
        try:
            async with c.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        if not events:
                            started.release()
                        events.append(line[6:])
        except httpx.HTTPError as e:
            return f"cut ({type(e).__name__})"
        if not events or events[-1] != "[DONE]":
            return "cut (no [DONE])"
        last = json.loads(events[-2]) if len(events) > 1 else {}
        if "error" in last:
            return f"error event {last['error'].get('code')} + [DONE]"
        return f"finish_reason {last['choices'][0]['finish_reason']} + [DONE]"

    async def plain(c):
        try:
            r = await c.post(srv.url + "/v1/completions", json=body)
        except httpx.HTTPError as e:
            return f"failed ({type(e).__name__})"
        try:
            return f"{r.status_code} {r.json()['error']['code']}"
        except (ValueError, KeyError, TypeError):
            return f"{r.status_code} {r.headers.get('content-type', '').split(';')[0]}"
    limits = httpx.Limits(max_connections=100)
    async with httpx.AsyncClient(timeout=60, limits=limits) as c:
        tasks = [asyncio.ensure_future(stream(c)) for _ in range(32)]
        await asyncio.wait_for(asyncio.gather(*[started.acquire() for _ in range(32)]), 120)
        tasks += [asyncio.ensure_future(plain(c)) for _ in range(4)]
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        rc = await asyncio.get_running_loop().run_in_executor(None, srv.proc.wait, 30)
        took = time.monotonic() - t0
        res = await asyncio.gather(*tasks)
    await asyncio.sleep(0.5)
    left = [k for k in kids if os.path.exists(f"/proc/{k}") and descendants(k) is not None
            and open(f"/proc/{k}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
    counts: dict = {}
    for r in res:
        counts[r] = counts.get(r, 0) + 1
    out["sigterm"] = {"exit_s": round(took, 2), "rc": rc, "outcomes": counts, "processes_left": len(left)}
    print(f"SIGTERM with 32 streams + 4 plain requests: exit in {took:.2f} s (status {rc}), {len(left)} processes "
          f"left; outcomes {counts}", flush=True)


async def attack_idle(args, out: dict) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))  # our side holds 1,100 sockets
    srv = Serve(args.root, nofile=1024)
    socks = []
    try:
        for _ in range(args.idle):
            try:
                s = socket.create_connection((srv.host, srv.port), timeout=5)
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
                s.setblocking(False)
                socks.append(s)
            except OSError:
                break
        await asyncio.sleep(1.0)
        ok, lat, errs = 0, [], {}
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as c:
            for _ in range(20):
                t0 = time.monotonic()
                try:
                    r = await c.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8,
                                                                         "temperature": 0})
                    if r.status_code == 200:
                        ok += 1
                        lat.append(time.monotonic() - t0)
                    else:
                        errs[r.status_code] = errs.get(r.status_code, 0) + 1
                except httpx.HTTPError as e:
                    errs[type(e).__name__] = errs.get(type(e).__name__, 0) + 1
        await asyncio.sleep(args.idle_wait)
        closed = 0
        for s in socks:
            try:
                closed += s.recv(4096, socket.MSG_PEEK) is not None
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
        res = {"idle_connections": len(socks), "ok": f"{ok}/20", "errors": errs,
               "median_s": round(statistics.median(lat), 3) if lat else None,
               "max_s": round(max(lat), 3) if lat else None,
               f"idle_closed_after_{args.idle_wait:g}s": closed, "server_alive": srv.proc.poll() is None}
        out["idle"] = res
        print(f"{len(socks)} idle half-requests under a 1,024-fd limit: {ok}/20 normal requests succeeded "
              f"(median {res['median_s']} s, max {res['max_s']} s; errors {errs}); {closed} idle connections "
              f"closed by the server after {args.idle_wait:g} s more", flush=True)
    finally:
        for s in socks:
            s.close()
        srv.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


ATTACKS = {"stops": attack_stops, "chat": attack_chat, "sigterm": attack_sigterm, "idle": attack_idle}


async def amain(args) -> int:
    out: dict = {"root": args.root, "load": os.getloadavg(), "cpus": os.cpu_count()}
    print(f"{args.root}: load average {out['load'][0]:.1f} on {out['cpus']} CPUs at the start", flush=True)
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
    ap.add_argument("--root", default=ROOT, help="the minedraft checkout to attack")
    ap.add_argument("--window", type=float, default=8.0, help="seconds the latency probe runs per phase")
    ap.add_argument("--senders", type=int, default=2, help="concurrent stop-string flood clients")
    ap.add_argument("--chat-senders", type=int, default=20, help="concurrent chat flood clients")
    ap.add_argument("--idle", type=int, default=1100, help="idle half-open connections")
    ap.add_argument("--idle-wait", type=float, default=12.0, help="seconds before counting closed idle ones")
    ap.add_argument("--json", help="also write the figures to this file")
    return asyncio.run(amain(ap.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
