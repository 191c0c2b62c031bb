"""A real minedraft HTTP server for tests: an Engine and uvicorn on a uvloop loop in a background thread, bound
to 127.0.0.1 on a free port, so blocking clients (openai, curl, a browser) can talk to it from the test.
`call(coro)` runs a coroutine on the server's loop (the engine is not thread-safe)."""

from __future__ import annotations

import asyncio
import threading

from minedraft.config import EngineConfig


class ServerThread:
    def __init__(self, config: EngineConfig | None = None, start_engine: bool = True, **app_kw):
        self.config = config or EngineConfig()
        self.start_engine = start_engine
        self.app_kw = app_kw
        self.engine = None
        self.servers = []
        self.url: str | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.loop = None
        self.thread = threading.Thread(target=self._run, name="http-test-server", daemon=True)

    def _run(self) -> None:
        import uvloop
        self.loop = uvloop.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._setup())
        except BaseException as e:  # reported to the test thread by start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self._teardown())
        self.loop.close()

    async def _setup(self) -> None:
        from minedraft.engine.engine import Engine
        self.engine = Engine(self.config)
        if self.start_engine:
            await self.engine._start()
        self.url = await self._add_server(**self.app_kw)

    async def _add_server(self, **app_kw) -> str:
        from minedraft.serving.http.app import create_app
        from minedraft.serving.http.serve import HTTPServer, bind_socket
        srv = HTTPServer(create_app(self.engine, **app_kw), bind_socket("127.0.0.1:0", False))
        await srv.start()
        self.servers.append(srv)
        return srv.url

    def add_server(self, **app_kw) -> str:
        """Another HTTP app (e.g. with an API key) on the same engine; returns its URL."""
        return self.call(self._add_server(**app_kw))

    async def _teardown(self) -> None:
        for s in self.servers:
            await s.stop()
        if self.start_engine:
            await self.engine.shutdown()

    def start(self, timeout: float = 120) -> "ServerThread":
        self.thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("test server did not start")
        if self._error is not None:
            raise self._error
        return self

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def sync(self, fn, *args):
        """fn(*args) on the server's loop (e.g. engine.stats), so it never races the scheduler."""
        async def run():
            return fn(*args)
        return self.call(run())

    def stop(self) -> None:
        if self.loop is not None and self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
