"""`minedraft generate --chat` and `minedraft serve --http` as a user runs them (subprocesses): chat output equal
to Engine.chat's, non-loopback HTTP addresses refused before anything loads, and HTTP + ZeroMQ on one engine."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from minedraft.config import EngineConfig
from minedraft.engine.engine import Engine

try:  # the HTTP client the installed openai package is built on
    import httpx2 as httpx
except ImportError:
    import httpx

PROMPT = "The while statement is used for"


def test_system_needs_chat(capsys):
    from minedraft.cli import main as cli
    assert cli.main(["generate", "x", "--system", "s"]) == 2
    assert "--system needs the chat template" in capsys.readouterr().err  # a base model: add --chat


async def test_generate_chat_cli_matches_engine_chat():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What does pass do?"}]
    async with Engine(EngineConfig(max_batch_size=1)) as engine:
        ref = await engine.chat(msgs, {"max_tokens": 12})
    out = subprocess.run([sys.executable, "-m", "minedraft", "generate", "--chat", msgs[1]["content"],
                          "--system", msgs[0]["content"], "--max-tokens", "12", "--no-stats"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ref.text + "\n"


@pytest.mark.parametrize("addr", ["0.0.0.0:0", "192.168.1.10:8000", "example.com:80", "[::]:0"])
def test_non_loopback_http_refused_without_flag(addr, capsys):
    from minedraft.cli import main as cli
    from minedraft.serving.http.serve import HTTPBindError, bind_socket
    with pytest.raises(HTTPBindError, match="--allow-remote"):
        bind_socket(addr, allow_remote=False)
    assert cli.main(["serve", "--http", addr]) == 2  # refused before any model loads
    assert "not a loopback address" in capsys.readouterr().err
    if addr.startswith("0.0.0.0"):
        bind_socket(addr, allow_remote=True).close()  # the flag lets it through


@pytest.mark.parametrize("addr", ["127.0.0.1:0", "localhost:0", "[::1]:0"])
def test_loopback_http_addresses_bind(addr):
    from minedraft.serving.http.serve import bind_socket, url_of
    try:
        sock = bind_socket(addr, allow_remote=False)
    except Exception as e:  # a host without IPv6 loopback
        if "::1" in addr:
            pytest.skip(f"no IPv6 loopback here: {e}")
        raise
    with sock:
        assert url_of(sock).startswith(("http://127.0.0.1:", "http://[::1]:"))


def test_cli_serves_http_and_zeromq_together():
    """`minedraft serve --http ... --bind ...`: both servers on one engine, SIGTERM stops cleanly."""
    from minedraft.client import Client
    p = subprocess.Popen([sys.executable, "-m", "minedraft", "serve", "--http", "127.0.0.1:0", "--bind",
                          "tcp://127.0.0.1:*", "--max-batch-size", "2"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        lines = [p.stdout.readline().strip() for _ in range(2)]
        assert lines[0].startswith("listening on http://127.0.0.1:") and lines[1].startswith("listening on tcp://")
        url, endpoint = lines[0].split()[-1], lines[1].split()[-1]
        r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200

        async def via_zmq():
            async with Client(endpoint) as c:
                return await c.generate(PROMPT, {"max_tokens": 8})
        import asyncio
        assert asyncio.run(via_zmq()).text == r.json()["choices"][0]["text"]
        assert httpx.get(url + "/metrics").text.count('minedraft_requests_total{outcome="finished"} 2.0') == 1
    finally:
        p.send_signal(signal.SIGTERM)
        rc = p.wait(30)
    assert rc == 0, p.stderr.read()


def _children(pid: int) -> list[int]:
    import os
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_sigterm_ends_every_stream_and_answers_plain_requests_503():
    """SIGTERM with streams and plain requests in flight: every stream ends with a final event (an error object
    here) and [DONE], every plain request gets the JSON 503 engine_dead a worker death gives, and the process
    and its workers are gone within 5 s (uvicorn used to cut the streams and answer a plain-text 500, issue 35)."""
    import json
    import os
    import threading
    import time
    p = subprocess.Popen([sys.executable, "-m", "minedraft", "serve", "--http", "127.0.0.1:0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = p.stdout.readline().split()[-1]
        workers = _children(p.pid)
        body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "temperature": 0}
        streams: list[list[str]] = [[] for _ in range(4)]
        plain: list = [None, None]
        started = threading.Semaphore(0)

        def stream(i):
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                first = True
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        streams[i].append(line[6:])
                        if first:
                            started.release()
                            first = False

        def post(i):
            chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 500, "ignore_eos": True}
            plain[i] = httpx.post(url + ("/v1/completions", "/v1/chat/completions")[i], json=(body, chat)[i],
                                  timeout=60)
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        threads += [threading.Thread(target=post, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for _ in range(4):
            assert started.acquire(timeout=60)
        time.sleep(0.3)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(10)
        took = time.monotonic() - t0
        for t in threads:
            t.join(10)
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == 0 and took < 5, (rc, took, p.stderr.read())
    for s in streams:
        assert s[-1] == "[DONE]", s[-3:]
        last = json.loads(s[-2])
        assert last.get("error", {}).get("code") == "engine_dead" or last["choices"][0]["finish_reason"], last
    for r in plain:
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", (r.status_code, r.text)
    time.sleep(0.2)
    left = [w for w in workers if os.path.exists(f"/proc/{w}") and _state(w) != "Z"]  # zombies: nobody reaps
    assert not left, f"{left} outlived the server"
