"""`minedraft serve` when a worker is killed (kill -9, as the out-of-memory killer does): one ERROR line names the
worker, the signal and the likely cause; requests in flight end with engine_dead; the server then exits with
status 3 so a supervisor restarts it, for HTTP and ZeroMQ alike. --stay-up-on-worker-death keeps it up (503)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

try:  # the HTTP client the other server tests use
    import httpx2 as httpx
except ImportError:
    import httpx

PROMPT = "The while statement is used for"


def _workers(pid: int) -> list[int]:
    """The engine's worker processes among pid's children (not multiprocessing's resource tracker)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            out.append(int(d))
    return out


def _serve(*args) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-m", "minedraft", "serve", "--max-batch-size", "2", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.startswith("listening on "), (line, p.stderr.read() if p.poll() is not None else "")
    deadline = time.monotonic() + 30
    while len(_workers(p.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    return p, line.split()[-1]


def _error_lines(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if " ERROR " in x]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_http_server_exits_3_after_a_worker_is_killed():
    p, url = _serve("--http", "127.0.0.1:0")
    events: list[str] = []
    started = threading.Event()

    def stream():
        body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
    t = threading.Thread(target=stream)
    try:
        t.start()
        assert started.wait(60)
        victim = _workers(p.pid)[0]
        os.kill(victim, signal.SIGKILL)
        rc = p.wait(30)
        t.join(10)
    finally:
        if p.poll() is None:
            p.kill()
    err = p.stderr.read()
    assert rc == 3, (rc, err)
    assert events[-1] == "[DONE]" and "engine_dead" in events[-2], events[-3:]  # the request in flight failed
    lines = _error_lines(err)
    assert len(lines) == 1, err
    assert f"(pid {victim})" in lines[0] and "SIGKILL" in lines[0] and "--kv-cache" in lines[0], lines[0]
    assert "minedraft-drafter" in lines[0] or "minedraft-verifier" in lines[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_zeromq_server_exits_3_after_a_worker_is_killed():
    p, _ = _serve("--bind", "tcp://127.0.0.1:*")
    try:
        os.kill(_workers(p.pid)[1], signal.SIGKILL)
        rc = p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
    err = p.stderr.read()
    assert rc == 3 and len(_error_lines(err)) == 1 and "SIGKILL" in err, (rc, err)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_stay_up_option_keeps_answering_503():
    p, url = _serve("--http", "127.0.0.1:0", "--stay-up-on-worker-death")
    try:
        os.kill(_workers(p.pid)[0], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while httpx.get(url + "/health", timeout=10).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        assert p.poll() is None
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        p.send_signal(signal.SIGTERM)
        rc = p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == 0, p.stderr.read()
