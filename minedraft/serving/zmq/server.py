"""The network front end: a ZeroMQ ROUTER speaking the msgpack protocol of docs/PROTOCOL.md.

It runs on the same asyncio loop as the Engine (zmq.asyncio). This module is the transport: the socket, framing,
limits, and which clients are connected (serving/zmq/peers.py); the requests themselves, one task each that awaits the
engine and sends its replies, live in serving/zmq/requests.py. Nothing a client sends can crash the loop or touch
another client's requests; request ids are scoped per ROUTER identity (each DEALER connection).

    async with Engine(cfg) as engine, Server(engine, "tcp://127.0.0.1:5555") as server:
        await server.wait_closed()

`minedraft serve` (minedraft/cli/serve.py) wraps exactly this, under uvloop when it is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from . import protocol as P
from .access import BindError, check_bind, curve_keys, start_authenticator
from .peers import Peers
from .requests import Requests

log = logging.getLogger("minedraft.server")

YIELD_EVERY = 32      # messages handled back to back before the receive loop yields to other tasks...
YIELD_AFTER_S = 0.005  # ...or sooner, once a burst has taken this long
DEFAULT_MAX_QUEUED_REPLIES = P.DEFAULT_MAX_QUEUED_REPLIES
MONITOR_POLL_MS = 1000  # the monitor is also read before every message; this only bounds an idle wait
HEARTBEAT_IVL_MS = 5000
HEARTBEAT_TIMEOUT_MS = 30000
HANDSHAKE_IVL_MS = 10000  # a connection that has not completed the ZeroMQ handshake by then is closed (libzmq: 30 s)


# -- the server -------------------------------------------------------------------------------------------------
@dataclass
class _ServerStats:
    received: int = 0
    replies: int = 0
    errors: Counter = field(default_factory=Counter)
    clients_dropped: int = 0
    slow_clients_dropped: int = 0
    discarded: int = 0


class Server:
    """ROUTER front end for one Engine. Start with `await server.start()` or `async with`."""

    def __init__(self, engine, bind: str = "tcp://127.0.0.1:5555", *, allow_remote: bool = False,
                 curve_secret_key=None, curve_public_key=None, curve_client_keys=None,
                 max_message_bytes: int | None = None, max_inflight_per_client: int = 256,
                 max_queued_replies: int = DEFAULT_MAX_QUEUED_REPLIES):
        check_bind(bind, allow_remote)
        if max_message_bytes is None:  # sized to the longest prompt the engine accepts (protocol.message_limit_for)
            cfg = getattr(engine, "config", None)
            max_message_bytes = (P.message_limit_for(cfg.max_prompt_tokens) if cfg is not None
                                 else P.DEFAULT_MAX_MESSAGE_BYTES)
        if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int) or max_message_bytes < 64:
            raise ValueError(f"max_message_bytes must be an int >= 64, got {max_message_bytes!r}")
        if max_inflight_per_client < 1:
            raise ValueError("max_inflight_per_client must be >= 1")
        if isinstance(max_queued_replies, bool) or not isinstance(max_queued_replies, int) or max_queued_replies < 1:
            raise ValueError(f"max_queued_replies must be an int >= 1, got {max_queued_replies!r}")
        self.max_queued_replies = max_queued_replies
        self.peers = Peers()  # connections and the identities on them; slow readers dropped
        self._monitor_task: asyncio.Task | None = None
        self._mon = None
        self._mon_now = None  # the same monitor socket, read without waiting (see _read_monitor)
        self.bind_endpoint = bind
        self.max_message_bytes = max_message_bytes
        self.hard_limit = max_message_bytes * P.HARD_LIMIT_FACTOR
        self._secret, self._public, self._client_keys = curve_keys(curve_secret_key, curve_public_key,
                                                                   curve_client_keys)
        self.ctx: zmq.asyncio.Context | None = None
        self.sock: zmq.asyncio.Socket | None = None
        self.endpoint: str | None = None
        self._auth = None
        self.requests = Requests(self._send, max_inflight_per_client)
        self.engine = engine
        self._loop_task: asyncio.Task | None = None
        self._closed = asyncio.Event()
        self._closing = False
        self.stats = _ServerStats()
        self.started_at = time.time()

    @property
    def engine(self):
        return self.requests.engine

    @engine.setter
    def engine(self, engine) -> None:  # serve() binds before the engine has started
        self.requests.engine = engine

    @property
    def public_key(self) -> str | None:
        """The server's z85 CURVE public key (what clients pass), or None without CURVE."""
        return self._public.decode("ascii") if self._public else None

    # -- life-cycle ------------------------------------------------------------------------------------------
    async def __aenter__(self) -> "Server":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def bind(self) -> str:
        """Create and bind the ROUTER (no loop needed yet); returns the actual endpoint (ports resolved)."""
        if self.sock is not None:
            return self.endpoint
        self.ctx = zmq.asyncio.Context()
        if self._client_keys is not None:
            self._auth = start_authenticator(self.ctx, self._client_keys)
        s = self.ctx.socket(zmq.ROUTER)
        try:
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a send to a vanished client raises EHOSTUNREACH
            # at most this many unread replies per client (libzmq's HWM is per peer); one more and the send
            # fails with EAGAIN (ROUTER_MANDATORY), and the server drops that client (see _send)
            s.setsockopt(zmq.SNDHWM, self.max_queued_replies)
            s.setsockopt(zmq.MAXMSGSIZE, self.hard_limit)
            s.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            s.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            s.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
            if self.bind_endpoint.startswith("tcp://["):
                s.setsockopt(zmq.IPV6, 1)
            if self._secret is not None:
                s.curve_secretkey = self._secret
                s.curve_publickey = self._public
                s.curve_server = True
            # connection events, watched from before the bind so none is missed (serving/zmq/peers.py)
            self._mon = s.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
            self._mon_now = zmq.Socket.shadow(self._mon.underlying)
            s.bind(self.bind_endpoint)
        except zmq.ZMQError as e:
            if self._mon is not None:
                s.disable_monitor()
                self._mon.close(linger=0)
                self._mon = self._mon_now = None
            s.close(linger=0)
            self.sock = None
            self._term()
            raise BindError(f"cannot bind {self.bind_endpoint!r}: {e}") from None
        self.sock = s
        self.endpoint = s.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.endpoint

    async def start(self) -> "Server":
        self.bind()
        if self._loop_task is None:
            self._loop_task = asyncio.ensure_future(self._recv_loop())
            self._monitor_task = asyncio.ensure_future(self._monitor())
        log.info("serving on %s%s", self.endpoint, " (CURVE)" if self._secret else "")
        return self

    async def start_with(self, engine) -> str:
        """Serve `engine` (serving/launch.py); returns the 'listening on ...' line."""
        self.engine = engine
        await self.start()
        return f"listening on {self.endpoint}" + (f" (CURVE, server public key {self.public_key})"
                                                  if self.public_key else "")

    async def wait_closed(self) -> None:
        await self._closed.wait()

    async def close(self) -> None:
        """Answer every in-flight request with engine_dead ("server shutting down"), then stop."""
        if self._closing:
            await self._closed.wait()
            return
        self._closing = True
        if self._loop_task:
            self._loop_task.cancel()
        if self._monitor_task:
            self._monitor_task.cancel()
        await self.requests.close()
        await asyncio.gather(*[t for t in (self._loop_task, self._monitor_task) if t], return_exceptions=True)
        self._term()
        self._closed.set()

    def _term(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            self.sock.close(linger=0)
        if self._mon is not None:
            self._mon.close(linger=0)  # also when the monitor task never ran (bound, never started)
            self._mon = self._mon_now = None
        if self._auth is not None:
            with contextlib.suppress(Exception):
                self._auth.stop()
            self._auth = None
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None

    # -- I/O -------------------------------------------------------------------------------------------------
    def _send(self, ident: bytes, msg: dict, delimiter: bool = False) -> bool:
        """Send one reply now. False when the client is gone (then its requests are cancelled). delimiter: put an
        empty frame before it, as a REQ socket needs (only for the error that says REQ is not supported)."""
        if self.sock is None or self.sock.closed:
            return False
        try:
            data = P.encode(msg)
        except Exception as e:  # cannot happen for our own replies; never let it escape
            log.exception("cannot encode reply")
            data = P.encode(P.error_reply(P.echo_id(msg.get("id")), P.INTERNAL, f"cannot encode reply: {e}"))
        fut = self.sock.send_multipart([ident, b"", data] if delimiter else [ident, data], flags=zmq.NOBLOCK)
        err = fut.exception() if fut.done() else None
        if err is None:
            self.stats.replies += 1
            if msg.get("t") == "error":
                self.stats.errors[msg.get("code")] += 1
            return True
        if isinstance(err, zmq.ZMQError) and err.errno == errno.EHOSTUNREACH:
            self._drop_client(ident)
        elif isinstance(err, zmq.Again):
            # max_queued_replies replies wait unread: a client that sends but does not read. Holding more for
            # it would let it grow the server without bound, so it is dropped: its requests are cancelled and
            # its messages discarded for DROP_S (what is already queued is freed when it reads or disconnects).
            self._drop_client(ident, slow=True)
        else:
            log.warning("send to client failed: %s", err)
        return False

    def _error(self, ident: bytes, id, code: str, message: str, re: str | None = None,
               delimiter: bool = False) -> None:
        log.debug("client %s: %s: %s", ident.hex(), code, message)
        self._send(ident, P.error_reply(id, code, message, re), delimiter)

    def _drop_client(self, ident: bytes, slow: bool = False) -> None:
        if slow:
            if not self.peers.ban(ident):
                return
            self.stats.slow_clients_dropped += 1
            log.warning("client %s has %d unread replies queued (max_queued_replies); dropping it", ident.hex(),
                        self.max_queued_replies)
        n = self.requests.drop(ident)
        if n:
            self.stats.clients_dropped += 1
            log.info("client %s went away; cancelled its %d request(s)", ident.hex(), n)

    async def _recv_loop(self) -> None:
        burst = 0
        t_burst = time.perf_counter()
        while True:
            burst += 1
            if burst >= YIELD_EVERY or time.perf_counter() - t_burst > YIELD_AFTER_S:
                # a recv that finds a message ready does not yield: let the engine and other tasks run, so
                # one flooding client cannot starve everyone else
                burst = 0
                await asyncio.sleep(0)
                t_burst = time.perf_counter()
            try:
                frames = await self.sock.recv_multipart(copy=False)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                if e.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                log.warning("recv failed: %s", e)
                await asyncio.sleep(0.01)
                continue
            self._read_monitor()  # first: a connection's close is queued before its fd can carry a new one
            data = [f.bytes for f in frames]
            if not self.peers.seen(data[0], _source_fd(frames[-1])):
                self.stats.discarded += 1  # sent just before its connection closed: no one can read a reply
                continue
            try:
                self._on_message(data)
            except Exception:  # a bug in a handler must never stop the server
                log.exception("unhandled error while handling a message")
                with contextlib.suppress(Exception):
                    self._error(data[0], None, P.INTERNAL, "internal error while handling the message")

    async def _monitor(self) -> None:
        """Read connection events as they come, so a client that disconnects has its requests aborted at once
        (the receive loop also reads them, before each message)."""
        try:
            while self._mon is not None:
                await self._mon.poll(MONITOR_POLL_MS)
                self._read_monitor()
        except (asyncio.CancelledError, zmq.ZMQError):
            pass

    def _read_monitor(self) -> None:
        mon = self._mon_now
        while mon is not None:
            try:
                if not mon.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # cheaper than a recv that raises Again
                    return
                ev = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))
            except zmq.ZMQError:  # Again, or the socket closed under us
                return
            if ev["event"] == zmq.EVENT_ACCEPTED:
                self.peers.accepted(int(ev["value"]))
            elif ev["event"] == zmq.EVENT_DISCONNECTED:
                for ident in self.peers.disconnected(int(ev["value"])):
                    self._drop_client(ident)

    # -- dispatch --------------------------------------------------------------------------------------------
    def _on_message(self, frames: list[bytes]) -> None:
        self.stats.received += 1
        ident, payload = frames[0], frames[1:]
        if self.peers.banned(ident):
            self.stats.discarded += 1
            return
        if len(payload) != 1:
            # the id of the first frame that holds one; a REQ socket (["", payload]) gets the reply in its own
            # envelope, so that it can read it at all
            peek = next((p for p in map(P.peek_fields, (f for f in payload if len(f) <= self.hard_limit))
                         if "id" in p), {})
            return self._error(ident, peek.get("id"), P.BAD_MESSAGE,
                               f"a message must be exactly one frame after the routing identity, got "
                               f"{len(payload)} (DEALER clients send the msgpack map alone, with no empty "
                               "delimiter frame)", _re(peek), delimiter=len(payload) == 2 and payload[0] == b"")
        data = payload[0]
        if len(data) > self.max_message_bytes:
            peek = P.peek_fields(data)
            return self._error(ident, peek.get("id"), P.TOO_LARGE,
                               f"message is {len(data)} bytes; the limit is {self.max_message_bytes}", _re(peek))
        try:
            obj = P.decode(data, str_keys=True)
        except P.BadMessageError as e:
            peek = P.peek_fields(data)
            return self._error(ident, peek.get("id"), P.BAD_MESSAGE, str(e), _re(peek))
        try:
            req = P.parse_request(obj, getattr(getattr(self.engine, "config", None), "max_prompt_tokens", None))
        except P.RequestError as e:
            return self._error(ident, e.id, e.code, e.message, e.t)
        if req.t in ("generate", "stream"):
            self.requests.submit(ident, req, closing=self._closing)
        elif req.t == "cancel":
            self.requests.cancel(ident, req)
        elif req.t == "health":
            self._send(ident, {"v": P.VERSION, "t": "health", "id": req.id, "health": self._health()})
        elif req.t == "stats":
            self._send(ident, {"v": P.VERSION, "t": "stats", "id": req.id, "stats": self._stats()})

    def _health(self) -> dict:
        try:
            h = dict(self.engine.health())
        except Exception as e:
            h = {"ok": False, "error": f"health check failed: {e}"}
        if self._closing:
            h["ok"] = False
        return h

    def _stats(self) -> dict:
        try:
            s = dict(self.engine.stats())
        except Exception as e:
            s = {"error": f"engine stats unavailable: {e}"}
        st = self.stats
        s["server"] = {"connections": self.peers.open, "clients": self.requests.clients,
                       "inflight": self.requests.inflight,
                       "received": st.received, "replies": st.replies, "requests": self.requests.submitted,
                       "errors": {c: st.errors.get(c, 0) for c in P.ERROR_CODES},
                       "clients_dropped": st.clients_dropped,
                       "slow_clients_dropped": st.slow_clients_dropped, "discarded": st.discarded,
                       "uptime_s": time.time() - self.started_at, "max_message_bytes": self.max_message_bytes,
                       "max_inflight_per_client": self.requests.max_inflight, "max_queued_replies": self.max_queued_replies}
        return s


def _source_fd(frame: zmq.Frame) -> int | None:
    """The descriptor libzmq read this message from (ZMQ_SRCFD; deprecated in libzmq but still served)."""
    try:
        return frame.get(zmq.SRCFD)
    except (zmq.ZMQError, AttributeError, ValueError):
        return None


def _re(peek: dict) -> str | None:
    t = peek.get("t")
    return t if t in P.REQUEST_TYPES else None


async def serve(engine_config, bind: str, *, ready=None, stay_up_when_dead: bool = False,
                **server_kw) -> int | str | None:
    """Serve ZeroMQ on `bind` until SIGINT/SIGTERM (serving/launch.py; returns the signal, None when cancelled,
    or launch.ENGINE_DIED after a worker died unless stay_up_when_dead).
    The address is bound before the models load, so a bad --bind fails at once. `ready(lines)` gets the
    'listening on ...' line once requests are being served."""
    from ..launch import launch
    if server_kw.get("max_message_bytes") is None:
        server_kw["max_message_bytes"] = P.message_limit_for(engine_config.max_prompt_tokens)
    server = Server(None, bind, **server_kw)
    try:
        server.bind()  # errors (address in use, ...) surface before the models load, and before torch loads
    except BaseException:
        await server.close()
        raise
    return await launch(engine_config, [server], ready=ready, stay_up_when_dead=stay_up_when_dead)
