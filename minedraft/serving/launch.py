"""The one launcher of the front ends (`minedraft serve`: ZeroMQ, HTTP, or both on one engine): signals, the
engine's life-cycle, readiness and a clean stop, a signal during start-up included. Each front end keeps only its
protocol: it is bound before the launcher starts the engine (so a bad or busy address fails before the models
load), and it has `start_with(engine) -> its 'listening on ...' line` and `close()` (safe before start and twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import signal

log = logging.getLogger("minedraft.serve")
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def is_loopback(host: str) -> bool:
    """Whether a host (name or address, no brackets) is this machine only: localhost, 127.0.0.0/8, ::1."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name, an interface or a wildcard: possibly reachable from elsewhere


async def launch(engine_config, front_ends: list, *, ready=None) -> int | None:
    """Start an Engine, then each front end on it, and serve until SIGINT/SIGTERM (or cancellation); a signal
    while the engine starts stops the start at once. `ready(lines)` gets one 'listening on ...' line per front end
    once all serve. Returns the signal that stopped it (None when cancelled)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    got: list[int] = []

    def on_signal(sig: int) -> None:
        got.append(sig)
        stop.set()
    for sig in SIGNALS:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal, sig)
    engine = stopping = None
    try:
        from ..engine.engine import Engine
        starting = asyncio.ensure_future(Engine.start(engine_config))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # stopped during start-up: Engine.start cleans up after itself when cancelled
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            return got[0] if got else None
        engine = starting.result()
        lines = [await fe.start_with(engine) for fe in front_ends]
        if ready is not None:
            ready(lines)
        await stop.wait()
        log.info("shutting down")
        # The engine first: it fails every pending request at once, so each handler still running writes its
        # ending (an HTTP stream: an error event and [DONE]; a plain request or a ZeroMQ one: engine_dead) while
        # the workers stop, and new requests get the same answer. Then the front ends close.
        await engine.shutdown("server shutting down")
        return got[0] if got else None
    finally:
        if stopping is not None:
            stopping.cancel()
        for fe in front_ends:
            await fe.close()
        if engine is not None:
            await engine.shutdown()
        for sig in SIGNALS:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
