"""The HTTP front end's server: uvicorn on the caller's loop (uvloop under the CLI), on a socket checked and
bound before the models load, so a bad or busy address fails at once; serve_http runs it through the one
launcher (serving/launch.py), optionally beside the ZeroMQ server on the same engine."""

from __future__ import annotations

import asyncio
import contextlib
import socket

from ..launch import is_loopback

class HTTPBindError(ValueError):
    """The --http address is malformed or not allowed (non-loopback without allow_remote)."""


def parse_address(addr: str) -> tuple[str, int]:
    """'127.0.0.1:8000', '[::1]:8000', 'localhost:0' (0 = a free port) -> (host, port)."""
    a = addr.strip()
    for scheme in ("http://", "https://"):
        if a.startswith(scheme):
            a = a[len(scheme):].rstrip("/")
    host, sep, port = a.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise HTTPBindError(f"cannot parse HTTP address {addr!r}; expected HOST:PORT, e.g. 127.0.0.1:8000 or "
                            "[::1]:8000")
    return host, int(port)


def bind_socket(addr: str, allow_remote: bool) -> socket.socket:
    host, port = parse_address(addr)
    if not is_loopback(host) and not allow_remote:
        raise HTTPBindError(f"refusing to serve HTTP on {addr!r}: it is not a loopback address, so other machines "
                            "could reach the server. Pass --allow-remote to do it anyway (ideally with "
                            "--api-key), or use 127.0.0.1:PORT.")
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as e:
        raise HTTPBindError(f"cannot bind HTTP address {addr!r}: {e}") from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class HTTPServer:
    """uvicorn serving `app` on a pre-bound socket, started and stopped on the running loop."""

    def __init__(self, app, sock: socket.socket, log_level: str = "warning", limits=None):
        import uvicorn

        from .guard import ConnectionLimits, protocol_class

        class _Server(uvicorn.Server):
            def capture_signals(self):  # the caller's loop owns SIGINT/SIGTERM (engine shutdown comes first)
                return contextlib.nullcontext()

        self.sock = sock
        self.limits = limits if limits is not None else ConnectionLimits()
        self.server = _Server(uvicorn.Config(app, lifespan="off", log_level=log_level, access_log=False,
                                             timeout_graceful_shutdown=2, http=protocol_class(self.limits)))
        self.task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return url_of(self.sock)

    async def start(self) -> None:
        self.task = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises what stopped it
                raise RuntimeError("HTTP server exited during start-up")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self.task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.task = None


class HTTPFrontEnd:
    """The HTTP front end for serving/launch.py: the app on a socket bound beforehand."""

    def __init__(self, sock: socket.socket, app_kw: dict, log_level: str = "warning", limits=None):
        self.sock, self.app_kw, self.log_level, self.limits = sock, app_kw, log_level, limits
        self.server: HTTPServer | None = None

    async def start_with(self, engine) -> str:
        from .app import create_app
        refusal = {} if self.limits is None else {"refusal_rate": self.limits.refusal_rate}
        self.server = HTTPServer(create_app(engine, **self.app_kw, **refusal), self.sock, self.log_level, self.limits)
        await self.server.start()
        return f"listening on {self.server.url}"

    async def close(self) -> None:
        if self.server is not None:
            await self.server.stop()
        self.sock.close()


async def serve_http(engine_config, http: str, *, zmq_bind: str | None = None, api_key: str | None = None,
                     model_name: str | None = None, allow_remote: bool = False, ready=None,
                     max_body_bytes: int | None = None, log_level: str = "warning", limits=None,
                     stay_up_when_dead: bool = False, **zmq_kw) -> int | str | None:
    """Serve HTTP on `http` and (with zmq_bind) ZeroMQ, on one Engine, until SIGINT/SIGTERM (serving/launch.py;
    returns the signal, or launch.ENGINE_DIED after a worker died unless stay_up_when_dead). `ready(lines)` gets one 'listening on ...' line per server once both serve; `limits`
    (guard.ConnectionLimits) sets the header and body deadlines and the connection cap."""
    from ..launch import launch
    front_ends = [HTTPFrontEnd(bind_socket(http, allow_remote), dict(model_name=model_name, api_key=api_key,
                                                                     max_body_bytes=max_body_bytes),
                               log_level, limits)]
    try:
        if zmq_bind is not None:
            from ..zmq.server import Server
            if zmq_kw.get("max_message_bytes") is None:  # sized to the prompt limit, as `serve` does
                from ..zmq.protocol import message_limit_for
                zmq_kw["max_message_bytes"] = message_limit_for(engine_config.max_prompt_tokens)
            zserver = Server(None, zmq_bind, allow_remote=allow_remote, **zmq_kw)
            front_ends.append(zserver)
            zserver.bind()
    except BaseException:
        for fe in front_ends:
            await fe.close()
        raise
    return await launch(engine_config, front_ends, ready=ready, stay_up_when_dead=stay_up_when_dead)
