"""The HTTP server's connection limits (minedraft/serving/http/guard.py) over raw sockets: header and body deadlines, the
connection cap, uvicorn's own errors as JSON, Transfer-Encoding + Content-Length
refused. A small ASGI app stands in for the engine's: these are properties of the server, not of a route."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from minedraft.serving.http.guard import ConnectionLimits
from minedraft.serving.http.serve import HTTPServer, bind_socket


class _App:
    """/slow waits until `release` is set; anything else reads the body and answers its length as JSON."""

    def __init__(self):
        self.release = threading.Event()

    async def __call__(self, scope, receive, send):
        if scope["path"] == "/slow":
            while not self.release.is_set():
                await asyncio.sleep(0.02)
        body = b""
        while True:
            m = await receive()
            if m["type"] == "http.disconnect":
                return
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        out = json.dumps({"got": len(body)}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})


@pytest.fixture
def server():
    made = {}

    def start(app=None, **kw):
        limits = ConnectionLimits(**{"header_timeout_s": 0.5, "body_timeout_s": 0.5, **kw})
        ready = threading.Event()
        loop = asyncio.new_event_loop()
        app = app or _App()

        def run():
            asyncio.set_event_loop(loop)
            srv = HTTPServer(app, bind_socket("127.0.0.1:0", False), limits=limits)
            loop.run_until_complete(srv.start())
            made["srv"] = srv
            ready.set()
            loop.run_forever()
            loop.run_until_complete(srv.stop())
            loop.close()
        t = threading.Thread(target=run, daemon=True)
        t.start()
        assert ready.wait(30)
        made.update(loop=loop, thread=t, app=app)
        host, port = made["srv"].sock.getsockname()[:2]
        return (host, port), limits, app
    yield start
    if "loop" in made:
        made["app"].release.set() if isinstance(made["app"], _App) else None
        made["loop"].call_soon_threadsafe(made["loop"].stop)
        made["thread"].join(10)


def connect(addr) -> socket.socket:
    s = socket.create_connection(addr, timeout=5)
    return s


def read_all(s: socket.socket, timeout: float = 5.0) -> bytes:
    s.settimeout(timeout)
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not chunk:
            break
        out += chunk
    return out


def status_and_json(raw: bytes):
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def get(addr, path="/", body=b"") -> tuple[int, dict]:
    s = connect(addr)
    with s:
        s.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
                  % (path.encode(), len(body), body))
        return status_and_json(read_all(s))


def test_headers_not_complete_in_time_get_408_and_silent_connections_are_closed(server):
    addr, limits, _ = server()
    partial, silent = connect(addr), connect(addr)
    partial.sendall(b"POST / HTTP/1.1\r\nhost: x\r\n")  # slowloris: headers never finished
    t0 = time.monotonic()
    status, body = status_and_json(read_all(partial))
    assert status == 408 and body["error"]["code"] == "request_timeout" and "headers" in body["error"]["message"]
    assert read_all(silent) == b""  # closed, nothing said to a connection that said nothing
    assert time.monotonic() - t0 < 3
    assert get(addr, body=b"abc") == (200, {"got": 3})


def test_body_not_complete_in_time_gets_408(server):
    addr, _, _ = server()
    s = connect(addr)
    s.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000\r\n\r\n" + b"x" * 100)
    status, body = status_and_json(read_all(s))
    assert status == 408 and "body" in body["error"]["message"]


def test_connection_cap_evicts_idle_connections_so_requests_still_succeed(server):
    addr, limits, app = server(max_connections=8, header_timeout_s=30)
    idle = [connect(addr) for _ in range(20)]
    for s in idle:
        s.sendall(b"GET / HT")
    for _ in range(5):  # each request evicts the oldest connection still waiting for its headers
        assert get(addr, body=b"hello") == (200, {"got": 5})
    assert limits.evicted >= 20 + 1 - 8  # 12 while the idle ones connected, then room for the first request
    # every connection busy with a request: a new one is answered 503 at once
    busy = [connect(addr) for _ in range(8)]
    for s in busy:
        s.sendall(b"POST /slow HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
    time.sleep(0.5)
    status, body = get(addr)
    assert status == 503 and body["error"]["code"] == "overloaded" and "max_connections" in body["error"]["message"]
    app.release.set()
    for s in busy:
        assert status_and_json(read_all(s, 1.0))[0] == 200
    for s in idle + busy:
        s.close()


def test_half_close_is_a_hang_up(server):
    """A client that shuts its side after a complete request cannot be told from one that closed: TCP shows both
    as EOF. The request is dropped (test_http_api: its engine request aborted, its KV freed), as Go's net/http
    does, rather than computing answers nobody may read."""
    addr, _, _ = server()
    s = connect(addr)
    s.sendall(b"POST /slow HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n\r\nabcd")
    s.shutdown(socket.SHUT_WR)
    assert read_all(s) == b""


@pytest.mark.parametrize("head", [b"content-length: abc\r\n\r\n", b"x-big: " + b"a" * 70000,  # headers > 16 KiB
                                  b"content-length: 1\r\ncontent-length: 2\r\n\r\n"])
def test_uvicorn_framing_errors_are_json(server, head):
    addr, _, _ = server()
    s = connect(addr)
    s.sendall(b"POST / HTTP/1.1\r\nhost: x\r\n" + head)
    status, body = status_and_json(read_all(s))
    assert status == 400 and body["error"]["code"] == "invalid_http"
