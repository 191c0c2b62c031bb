"""An asyncio client for `minedraft serve` (protocol: docs/PROTOCOL.md).

    async with Client("tcp://127.0.0.1:5555") as c:
        r = await c.generate("Hello", {"max_tokens": 16})
        async for d in c.stream("Hello", {"max_tokens": 16}):
            print(d.text, end="")

One DEALER socket carries any number of concurrent requests; replies are routed by request id. Error replies
raise the minedraft error of their code (InvalidRequestError, OverloadedError, EngineDeadError, and the
protocol's own in minedraft.serving.zmq.protocol). With CURVE, pass the server's public key (z85 text or a key file);
the client makes itself a throwaway keypair unless given one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import AsyncIterator

import zmq
import zmq.asyncio

from .serving.zmq import protocol as P
from .outputs import GenerationResult, StreamDelta
from .sampling_params import SamplingParams


def _params(params) -> dict:
    if params is None:
        return {}
    if isinstance(params, SamplingParams):
        return params.to_dict()
    if isinstance(params, dict):
        return dict(params)
    raise TypeError(f"params must be a dict or SamplingParams, got {type(params).__name__}")


class Client:
    def __init__(self, endpoint: str = "tcp://127.0.0.1:5555", *, server_public_key=None,
                 client_public_key=None, client_secret_key=None, timeout: float | None = None,
                 context: zmq.asyncio.Context | None = None):
        """timeout: seconds to wait for each reply (generate's result, each stream message, acks), the request's
        own send included; None waits forever. On timeout a generate/stream is cancelled on the server and
        TimeoutError is raised."""
        from .serving.zmq.access import coerce_key
        self.endpoint, self.timeout = endpoint, timeout
        self._server_key = coerce_key(server_public_key, "public") if server_public_key is not None else None
        if (client_public_key is None) != (client_secret_key is None):
            raise ValueError("give both client_public_key and client_secret_key, or neither")
        self._client_keys = None
        if client_secret_key is not None:
            if self._server_key is None:
                raise ValueError("client CURVE keys need server_public_key")
            self._client_keys = (coerce_key(client_public_key, "public"), coerce_key(client_secret_key, "secret"))
        self._own_ctx = context is None
        self._ctx = context
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._requests: dict[str, asyncio.Queue] = {}
        self._control: dict[tuple[str, str], asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._failure: BaseException | None = None

    async def __aenter__(self) -> "Client":
        self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def connect(self) -> "Client":
        if self._sock is not None:
            return self
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 0)  # never drop a reply
        if self.endpoint.startswith("tcp://["):
            s.setsockopt(zmq.IPV6, 1)
        if self._server_key is not None:
            public, secret = self._client_keys or zmq.curve_keypair()
            s.curve_serverkey = self._server_key
            s.curve_publickey = public
            s.curve_secretkey = secret
        s.connect(self.endpoint)
        self._sock = s
        self._reader = asyncio.ensure_future(self._read_loop())
        return self

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._reader:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
        self._fail_all(ConnectionError("client closed"))
        if self._sock is not None:
            self._sock.close(linger=0)
        if self._own_ctx and self._ctx is not None:
            self._ctx.term()

    # -- plumbing --------------------------------------------------------------------------------------------
    def _new_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids)}"

    async def send_message(self, msg: dict) -> None:
        """Send one raw protocol map (v is added if missing). Low level: replies go nowhere unless the id is
        registered; use the methods below."""
        if self._sock is None:
            self.connect()
        if self._closed:
            raise ConnectionError("client closed")
        msg = {"v": P.VERSION, **msg}
        await self._sock.send(P.encode(msg))

    async def _read_loop(self) -> None:
        try:
            while True:
                data = await self._sock.recv()
                try:
                    msg = P.decode(data)
                except P.BadMessageError:
                    continue
                if isinstance(msg, dict):
                    self._dispatch(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # socket closed under us
            self._fail_all(ConnectionError(f"connection failed: {e}"))

    def _dispatch(self, msg: dict) -> None:
        t, rid = msg.get("t"), msg.get("id")
        if t in ("result", "delta", "done"):
            self._to_request(rid, msg, final=t != "delta")
        elif t in ("cancelled", "health", "stats"):
            self._resolve((t if t != "cancelled" else "cancel", rid), msg)
        elif t == "error":
            re = msg.get("re")
            if re in ("cancel", "health", "stats"):
                self._resolve((re, rid), msg)
            elif rid in self._requests and msg.get("code") != P.DUPLICATE_ID:
                self._to_request(rid, msg, final=True)
            else:
                for kind in ("cancel", "health", "stats"):
                    if (kind, rid) in self._control:
                        return self._resolve((kind, rid), msg)

    def _to_request(self, rid, msg, final: bool) -> None:
        if rid not in self._requests:
            return
        q = self._requests[rid]
        if q is not None:
            q.put_nowait(msg)
        elif final:  # the last message of a request we gave up on: its id is free again
            del self._requests[rid]

    def _resolve(self, key, msg) -> None:
        fut = self._control.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def _fail_all(self, err: BaseException) -> None:
        self._failure = err
        for q in self._requests.values():
            if q is not None:
                q.put_nowait(err)
        for fut in self._control.values():
            if not fut.done():
                fut.set_exception(err)
        self._control.clear()

    def _check(self, msg) -> dict:
        if isinstance(msg, BaseException):
            raise msg
        if msg.get("t") == "error":
            raise P.error_from_reply(msg)
        return msg

    async def _exchange(self, msg: dict | None, reply, timeout, kind: str = ""):
        """Send msg (if any), then await reply() (a queue's get, a future), all within one deadline: a send can
        wait too (the socket's queue to an unreachable server fills up)."""
        async def both():
            if msg is not None:
                await self.send_message(msg)
            return await reply()
        try:
            return await asyncio.wait_for(both(), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no {kind}reply from {self.endpoint} within {timeout} s") from None

    async def _control_call(self, kind: str, rid: str, timeout) -> dict:
        if (kind, rid) in self._control:
            raise P.DuplicateIdError(f"a {kind} for id {rid!r} is already pending on this client")
        fut = self._control[(kind, rid)] = asyncio.get_running_loop().create_future()
        try:
            return self._check(await self._exchange({"t": kind, "id": rid}, lambda: asyncio.shield(fut),
                                                    self._timeout(timeout), kind + " "))
        finally:
            if self._control.get((kind, rid)) is fut:
                del self._control[(kind, rid)]

    def _timeout(self, timeout):
        return self.timeout if timeout is None else timeout

    def _register(self, request_id: str | None) -> tuple[str, asyncio.Queue]:
        if self._closed:
            raise ConnectionError("client closed")
        if self._failure is not None:
            raise self._failure
        rid = request_id if request_id is not None else self._new_id("r")
        if rid in self._requests:
            raise P.DuplicateIdError(f"request id {rid!r} is already in flight on this client (or still being "
                                     "cancelled)")
        q = self._requests[rid] = asyncio.Queue()
        return rid, q

    # -- API -------------------------------------------------------------------------------------------------
    async def _reply(self, prompt, params, request_id: str | None, timeout: float | None) -> tuple[str, dict]:
        """Send one generate and wait for its final reply: (request id, the checked reply message)."""
        rid, q = self._register(request_id)
        finished = False
        try:
            msg = self._check(await self._exchange(
                {"t": "generate", "id": rid, "prompt": prompt, "params": _params(params)}, q.get,
                self._timeout(timeout)))
            finished = True
            return rid, msg
        except P.MinedraftError:
            finished = True
            raise
        finally:
            self._release(rid, finished)

    async def generate_choices(self, prompt, params: dict | SamplingParams | None = None, *,
                               request_id: str | None = None, timeout: float | None = None
                               ) -> list[GenerationResult]:
        """A generate with params n > 1: the n completions of one prompt (the server shares its KV blocks)."""
        rid, msg = await self._reply(prompt, params, request_id, timeout)
        if "choices" in msg:
            return [P.result_from_reply({**c, "id": rid}) for c in msg["choices"]]
        return [P.result_from_reply(msg)]

    async def generate(self, prompt, params: dict | SamplingParams | None = None, *,
                       request_id: str | None = None, timeout: float | None = None) -> GenerationResult:
        """Run one request to completion. Cancelling the awaiting task cancels it on the server."""
        return P.result_from_reply((await self._reply(prompt, params, request_id, timeout))[1])

    async def stream(self, prompt, params: dict | SamplingParams | None = None, *,
                     request_id: str | None = None, timeout: float | None = None) -> AsyncIterator[StreamDelta]:
        """Yield a StreamDelta per `delta` message, then a last one with finished=True, finish_reason and
        stats (from `done`). Breaking out early cancels the request on the server."""
        rid, q = self._register(request_id)
        finished = False
        try:
            send = {"t": "stream", "id": rid, "prompt": prompt, "params": _params(params)}
            while True:
                try:
                    msg = self._check(await self._exchange(send, q.get, self._timeout(timeout)))
                    send = None
                except P.MinedraftError:
                    finished = True
                    raise
                d = P.delta_from_reply(msg)
                if d.finished:
                    finished = True
                yield d
                if finished:
                    return
        finally:
            self._release(rid, finished)

    async def cancel(self, request_id: str, *, timeout: float | None = None) -> None:
        """Cancel one of this client's requests. Returns once the server has ended it (its generate/stream has
        then received its final message, finish_reason "abort" unless it had just finished). Raises
        UnknownRequestError when the server has no such request running for this client."""
        await self._control_call("cancel", request_id, timeout)

    async def health(self, *, timeout: float | None = None) -> dict:
        return (await self._control_call("health", self._new_id("h"), timeout))["health"]

    async def stats(self, *, timeout: float | None = None) -> dict:
        return (await self._control_call("stats", self._new_id("s"), timeout))["stats"]

    def _release(self, rid: str, finished: bool) -> None:
        """Forget a request; one abandoned midway is cancelled on the server and its id stays reserved until
        the server's final message for it arrives (so a late reply never reaches a new request)."""
        if finished or self._closed or self._sock is None or self._failure is not None:
            self._requests.pop(rid, None)
            return
        self._requests[rid] = None
        fut = self._sock.send(P.encode(P.request("cancel", rid)), flags=zmq.NOBLOCK)
        if fut.done() and fut.exception() is not None:
            self._requests.pop(rid, None)
