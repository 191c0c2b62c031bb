"""The requests the ZeroMQ server is running: per-client id tables, one task per request that awaits the engine
and sends its replies, cancellation, and the final message of each request (exactly one).

The transport (minedraft/serving/zmq/server.py) hands it parsed requests and a `send(ident, msg) -> bool` callable, and tells
it when a client is gone (`drop`). Request ids are scoped per client identity.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from dataclasses import dataclass
from typing import Callable

from . import protocol as P
from ...errors import MinedraftError
from ...outputs import RequestStats

log = logging.getLogger("minedraft.server")

CANCEL_WAIT_S = 10.0   # how long a cancel waits for the request's final message before forcing it


@dataclass
class _Entry:
    id: str
    t: str
    name: str                       # the engine's request id (unique across clients)
    task: asyncio.Task | None = None
    started: bool = False           # the engine has been handed the request
    cancel_requested: bool = False
    done: bool = False              # its final message (result/done/error) has been sent


class Requests:
    def __init__(self, send: Callable[[bytes, dict], bool], max_inflight: int):
        self.engine = None            # set by the server (it may get its engine after it is built)
        self.max_inflight = max_inflight
        self.submitted = 0
        self._send = send
        self._clients: dict[bytes, dict[str, _Entry]] = {}
        self._names = itertools.count()
        self._side_tasks: set[asyncio.Task] = set()

    @property
    def clients(self) -> int:
        return len(self._clients)

    @property
    def inflight(self) -> int:
        return sum(map(len, self._clients.values()))

    def _error(self, ident: bytes, id, code: str, message: str, re: str | None) -> None:
        self._send(ident, P.error_reply(id, code, message, re))

    # -- from the transport ----------------------------------------------------------------------------------
    def submit(self, ident: bytes, req: P.Request, closing: bool = False) -> None:
        table = self._clients.get(ident, {})
        if req.id in table:
            return self._error(ident, req.id, P.DUPLICATE_ID,
                               f"request id {req.id!r} is already running for this client; ids must be unique "
                               "among a client's in-flight requests", req.t)
        if closing:
            return self._error(ident, req.id, P.ENGINE_DEAD, "server shutting down", req.t)
        if len(table) >= self.max_inflight:
            return self._error(ident, req.id, P.OVERLOADED,
                               f"this client already has {len(table)} requests in flight (limit "
                               f"{self.max_inflight}); wait for some to finish", req.t)
        self._clients[ident] = table
        self.submitted += 1
        e = _Entry(req.id, req.t, f"srv-{next(self._names)}")
        table[req.id] = e
        run = self._run_generate if req.t == "generate" else self._run_stream
        e.task = asyncio.ensure_future(run(ident, e, req))

    def cancel(self, ident: bytes, req: P.Request) -> None:
        e = self._clients.get(ident, {}).get(req.id)
        if e is None or e.done:
            return self._error(ident, req.id, P.UNKNOWN_REQUEST,
                               f"no request {req.id!r} is running for this client (finished, never sent, or "
                               "sent by another client)", "cancel")
        t = asyncio.ensure_future(self._cancel(ident, e))
        self._side_tasks.add(t)
        t.add_done_callback(self._side_tasks.discard)

    def drop(self, ident: bytes) -> int:
        """The client is gone: cancel its requests without replying. Returns how many it had."""
        table = self._clients.pop(ident, None)
        if not table:
            return 0
        me = asyncio.current_task()
        for e in table.values():
            e.done = True
            if e.task is not None and e.task is not me:
                e.task.cancel()
        return len(table)

    async def close(self) -> None:
        """Answer every in-flight request with engine_dead ("server shutting down") and end its task."""
        tasks = []
        for ident, table in list(self._clients.items()):
            for e in list(table.values()):
                self._finish(ident, e, P.error_reply(e.id, P.ENGINE_DEAD, "server shutting down", e.t))
                if e.task:
                    e.task.cancel()
                    tasks.append(e.task)
        tasks += list(self._side_tasks)
        for t in self._side_tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- one request ------------------------------------------------------------------------------------------
    async def _cancel(self, ident: bytes, e: _Entry) -> None:
        e.cancel_requested = True
        if e.started:
            with contextlib.suppress(Exception):
                await self.engine.abort(e.name)
        # The request's own final message (finish_reason "abort" unless it had just finished) goes out first.
        if e.task is not None and not e.task.done():
            _, pending = await asyncio.wait({e.task}, timeout=CANCEL_WAIT_S)
            if pending:
                log.warning("request %s did not end %.0f s after abort; cancelling its task", e.name,
                            CANCEL_WAIT_S)
                e.task.cancel()
                await asyncio.wait({e.task})
        if not e.done:  # the task was forced
            self._finish(ident, e, P.error_reply(e.id, P.INTERNAL, "request was force-cancelled", e.t))
        self._send(ident, {"v": P.VERSION, "t": "cancelled", "id": e.id})

    def _finish(self, ident: bytes, e: _Entry, msg: dict) -> None:
        """Send a request's final message and free its id, in one step (so the id is reusable at once)."""
        if e.done:
            return
        self._forget(ident, e)
        self._send(ident, msg)

    def _forget(self, ident: bytes, e: _Entry) -> None:
        e.done = True
        table = self._clients.get(ident)
        if table is not None and table.get(e.id) is e:
            del table[e.id]
            if not table:
                del self._clients[ident]

    def _failure(self, e: _Entry, exc: BaseException) -> dict:
        if isinstance(exc, MinedraftError):
            code = exc.code if exc.code in P.ERROR_CODES else P.INTERNAL
            return P.error_reply(e.id, code, str(exc), e.t)
        log.exception("request %s failed", e.name, exc_info=exc)
        return P.error_reply(e.id, P.INTERNAL, f"{type(exc).__name__}: {exc}", e.t)

    async def _run_generate(self, ident: bytes, e: _Entry, req: P.Request) -> None:
        try:
            if e.cancel_requested:
                return self._finish(ident, e, {"v": P.VERSION, "t": "result", "id": e.id, "text": "",
                                               "token_ids": [], "finish_reason": "abort",
                                               "stats": RequestStats().to_dict()})
            e.started = True
            n = req.params.get("n", 1) if isinstance(req.params, dict) else 1
            if n != 1:  # several completions sharing the prompt (a bad n is refused by SamplingParams)
                res = await self.engine.generate_choices(req.prompt, req.params, request_id=e.name)
            else:
                res = await self.engine.generate(req.prompt, req.params, request_id=e.name)
            self._finish(ident, e, P.result_reply(e.id, res))
        except asyncio.CancelledError:
            self._finish(ident, e, P.error_reply(e.id, P.ENGINE_DEAD, "server shutting down", e.t))
            raise
        except Exception as exc:
            self._finish(ident, e, self._failure(e, exc))

    async def _run_stream(self, ident: bytes, e: _Entry, req: P.Request) -> None:
        try:
            if e.cancel_requested:
                return self._finish(ident, e, P.done_reply(e.id, "abort", None))
            e.started = True
            async with contextlib.aclosing(self.engine.stream(req.prompt, req.params, request_id=e.name)) as it:
                async for d in it:
                    reply = P.delta_reply(e.id, d.text, d.token_ids, d.logprobs)
                    if (d.text or d.token_ids) and not self._send(ident, reply):
                        self._forget(ident, e)
                        return  # client gone: closing the stream aborts the request in the engine
                    if d.finished:
                        return self._finish(ident, e, P.done_reply(e.id, d.finish_reason or "abort", d.stats))
            self._finish(ident, e, P.done_reply(e.id, "abort", None))
        except asyncio.CancelledError:
            self._finish(ident, e, P.error_reply(e.id, P.ENGINE_DEAD, "server shutting down", e.t))
            raise
        except Exception as exc:
            self._finish(ident, e, self._failure(e, exc))
