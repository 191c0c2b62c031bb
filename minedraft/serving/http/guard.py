"""Connection limits for the HTTP server: uvicorn's h11 protocol with a header deadline, a body deadline and a
cap on open connections, and its own plain-text errors as OpenAI-style JSON.

uvicorn bounds only the idle time between keep-alive requests. Without these, a client sending one header byte a
second, or a body trickled under a large Content-Length, holds a connection (and a file descriptor) forever, and
some hundred of them exhaust a 1,024-descriptor limit so that accept() fails for everyone (issue 35).

- header deadline: a connection must deliver a request's complete headers within header_timeout_s of opening
  (or of its first byte after a keep-alive pause), else it gets a 408 (or, silent so far, is just closed);
- body deadline: the body must be complete within body_timeout_s of its headers, else 408;
- cap: at max_connections open, a new connection evicts the oldest one still waiting for a request (headers not
  complete, or idle between keep-alive requests); when every connection is busy with a request, the new one is
  answered 503 and closed. The default leaves room under the process's open-file limit for everything else.
"""

from __future__ import annotations

import json
import resource
from collections import OrderedDict
from dataclasses import dataclass, field

DEFAULT_REFUSAL_RATE = 50.0     # refusals (4xx) answered per second on average, bursts of one second's worth
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
FD_RESERVE = 128        # descriptors kept for the engine, its sockets and libraries, below the open-file limit
MAX_CONNECTIONS_CEILING = 4096


def default_max_connections() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS_CEILING
    return max(16, min(MAX_CONNECTIONS_CEILING, soft - FD_RESERVE))


def error_bytes(status: int, reason: str, message: str, code: str, type_: str = "invalid_request_error") -> bytes:
    """A complete HTTP/1.1 response with OpenAI's error body that closes the connection, written raw: h11 cannot
    send a response before it has parsed a request."""
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


class RefusalPacer:
    """Answers refusals (a 4xx the app produces: a bad body, too many messages, a wrong key, overloaded) at most
    `rate` per second on average, bursts of `rate` at once; past that, each waits its turn before its reply goes.

    A refusal is cheap but not free (a 12,000-message chat body: ~2 ms of the one event loop to read and skim),
    and clients that send the next bad request as soon as the last is refused can fill the loop with that work:
    20 of them slowed another client's 32-token request 2.3x. Paced, they get their errors late and the loop does at
    most `rate` refusals' work a second; valid requests are never paced. Requests held waiting keep their
    connection, which the connection cap bounds."""

    def __init__(self, rate: float = DEFAULT_REFUSAL_RATE):
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
            raise ValueError(f"refusal rate must be a number > 0, got {rate!r}")
        self.rate = float(rate)
        self._due = 0.0      # when the refusals answered so far have used up their budget (monotonic seconds)
        self.paced = 0       # refusals that had to wait

    def delay(self, now: float) -> float:
        """Seconds the refusal arriving at `now` waits (a virtual-scheduling leaky bucket, one second deep)."""
        self._due = max(self._due, now) + 1.0 / self.rate
        wait = self._due - now - 1.0
        if wait > 0:
            self.paced += 1
        return max(0.0, wait)


@dataclass
class ConnectionLimits:
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_connections: int = field(default_factory=default_max_connections)
    refusal_rate: float = DEFAULT_REFUSAL_RATE   # the app's RefusalPacer (serve_http hands it to create_app)
    waiting: OrderedDict = field(default_factory=OrderedDict)  # connections waiting for a request, oldest first
    evicted: int = 0
    refused: int = 0
    timed_out: int = 0

    def __post_init__(self):
        for name in ("header_timeout_s", "body_timeout_s", "refusal_rate"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        m = self.max_connections
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"max_connections must be an int >= 1, got {m!r}")


def protocol_class(limits: ConnectionLimits):
    """uvicorn's H11Protocol with `limits` applied (pass as uvicorn.Config(http=...))."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self._deadline = None     # the TimerHandle of the header or body deadline running now
            self._phase = None        # "headers" | "body" | None
            self._got_bytes = False   # of the request being waited for

        # -- the connection's phases -------------------------------------------------------------------
        def _cancel(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            self._phase = None
            limits.waiting.pop(self, None)

        def _arm(self, phase: str, seconds: float) -> None:
            self._cancel()
            self._phase = phase
            self._deadline = self.loop.call_later(seconds, self._expired)

        def _wait_for_request(self, timed: bool) -> None:
            """Between requests: evictable; with timed, the header deadline runs (else uvicorn's keep-alive)."""
            if timed:
                self._arm("headers", limits.header_timeout_s)
            else:
                self._cancel()
            self._got_bytes = False
            limits.waiting[self] = None

        def _follow(self) -> None:
            """Track h11's view of the client after bytes arrived or a response ended."""
            if self.transport.is_closing():
                return self._cancel()
            state = self.conn.their_state
            if state is h11.IDLE:
                if self._phase != "headers" and self._got_bytes:  # a request begun after a keep-alive pause
                    self._arm("headers", limits.header_timeout_s)
                    limits.waiting[self] = None
            elif state is h11.SEND_BODY:
                if self._phase != "body":
                    self._arm("body", limits.body_timeout_s)
            else:
                self._cancel()

        def _expired(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            limits.timed_out += 1
            phase, self._phase = self._phase, None
            limits.waiting.pop(self, None)
            cycle = self.cycle if phase == "body" else None
            if cycle is not None and cycle.response_started:
                self.transport.close()
                return
            if cycle is not None:
                cycle.disconnected = True  # the app's reply, if it comes, is dropped: ours is already written
                cycle.message_event.set()
            if phase == "body" or self._got_bytes:
                what = "body" if phase == "body" else "headers"
                limit = limits.body_timeout_s if phase == "body" else limits.header_timeout_s
                self.transport.write(error_bytes(408, "Request Timeout", f"the request {what} did not arrive "
                                                 f"within {limit:g} s (the server's {what} timeout)",
                                                 "request_timeout"))
            self.transport.close()

        def _evict(self) -> None:
            limits.evicted += 1
            self._cancel()
            if not self.transport.is_closing():
                self.transport.close()

        # -- uvicorn's protocol ------------------------------------------------------------------------
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                victim = next(iter(limits.waiting), None)
                if victim is None:
                    limits.refused += 1
                    transport.write(error_bytes(503, "Service Unavailable", f"the server has "
                                                f"{limits.max_connections} connections open, every one busy with "
                                                "a request (max_connections); retry later", "overloaded",
                                                "server_error"))
                    transport.close()
                    return
                victim._evict()
            self._wait_for_request(timed=True)

        def data_received(self, data: bytes) -> None:
            self._got_bytes = True
            super().data_received(data)
            self._follow()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.transport.is_closing():
                return self._cancel()
            if self.conn.their_state is h11.IDLE:
                self._wait_for_request(timed=False)  # uvicorn's keep-alive timeout closes it if nothing comes
            self._follow()

        def connection_lost(self, exc) -> None:
            self._cancel()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            """h11 refused the bytes (a malformed request line, header or Content-Length, headers over the size
            limit): the same 400, as OpenAI's JSON error instead of uvicorn's plain text."""
            self._cancel()
            self.transport.write(error_bytes(400, "Bad Request", f"{msg} (the HTTP framing could not be parsed)",
                                             "invalid_http"))
            self.transport.close()

    return GuardedH11Protocol
