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
# what launch() returns when a worker died (or hung) and the server stopped for a supervisor to restart it; the
# command line exits with EXIT_ENGINE_DIED then
ENGINE_DIED = "engine died"
EXIT_ENGINE_DIED = 3


def is_loopback(host: str) -> bool:
    """Whether a host (name or address, no brackets) is this machine only: localhost, 127.0.0.0/8, ::1."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name, an interface or a wildcard: possibly reachable from elsewhere


async def launch(engine_config, front_ends: list, *, ready=None,
                 stay_up_when_dead: bool = False) -> int | str | None:
    """Start an Engine, then each front end on it, and serve until SIGINT/SIGTERM (or cancellation); a signal
    while the engine starts stops the start at once. `ready(lines)` gets one 'listening on ...' line per front end
    once all serve. A worker that dies (or hangs) fails the requests in flight (the engine does, each front end
    answers engine_dead) and then stops the server too, returning ENGINE_DIED, so a supervisor restarts it;
    with stay_up_when_dead it keeps answering engine_dead (HTTP 503) until a signal instead. Returns the signal
    that stopped it (None when cancelled), or ENGINE_DIED."""
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
        if await _stop_or_death(stop, engine, stay_up_when_dead):
            log.warning("exiting with status %d so that a supervisor restarts the server (the engine is dead; "
                        "--stay-up-on-worker-death keeps it up answering engine_dead instead)", EXIT_ENGINE_DIED)
            await engine.shutdown("engine dead")
            return ENGINE_DIED
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


async def _stop_or_death(stop: asyncio.Event, engine, stay_up: bool) -> bool:
    """Wait for a signal or, unless stay_up, for the engine to die; True when it died (and no signal came)."""
    waits = {asyncio.ensure_future(stop.wait())}
    if not stay_up:
        waits.add(asyncio.ensure_future(engine.died.wait()))
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    return not stop.is_set()
