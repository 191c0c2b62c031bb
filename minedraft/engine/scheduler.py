"""The asyncio scheduler: request life-cycles, admission, aborts, verdicts in, and the worker sockets.

It runs in the caller's process and never touches a model. Its BlockManager is the one authority on both
workers' KV caches (cache/admission.py): a request goes to the drafter only once its blocks are assigned,
otherwise it waits here. Which batch a request joins, and the two batches' rhythm, are the drafter's
(minedraft/pipeline.py); the scheduler reads each step's timings from its verdict.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from ..cache.admission import Admission
from ..config import EngineConfig
from ..errors import EngineDeadError, InvalidRequestError, OverloadedError
from ..ipc import messages as M
from ..ipc.codec import decode_status, encode
from ..outputs import StreamDelta
from .request_state import KV_LIMIT, RequestState, make_request


@dataclass
class TraceEvent:
    lane: str        # "drafter" | "verifier"
    name: str        # "draft" | "verify"
    batch: int
    t0: float        # time.monotonic(), the same clock in every process on one machine
    t1: float
    step: int = 0


@dataclass
class EngineStats:
    steps: int = 0
    output_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    row_steps: int = 0  # (request, verify step) pairs: each scored its drafts plus one token of its own
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    by_source: dict = field(default_factory=dict)  # suffix/hybrid drafts: source -> [drafted, accepted]
    finished: int = 0
    aborted: int = 0
    failed: int = 0
    prefill_tokens: int = 0  # prompt tokens the verifier computed (the rest came from the prefix cache)
    trace: list[TraceEvent] = field(default_factory=list)


# a worker that finds itself re-running its parent's unguarded script (Engine() while being spawned) exits with it
UNGUARDED_MAIN_EXIT = 87


class AsyncScheduler:
    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, ctx: zmq.asyncio.Context, addr: M.Addresses,
                 trace: bool = False):
        self.config, self.tokenizer, self.vocab_size = config, tokenizer, vocab_size
        self.max_draft = config.max_draft  # KV reservations cover the most drafts a row can carry
        self.block_size = config.block_size
        # the one authority on both workers' block tables, prefix cache included (cache/admission.py)
        self.admission = Admission(config, self.max_draft)
        self.total_blocks = self.admission.blocks.num_blocks
        self.waiting: deque[RequestState] = deque()
        self.running: dict[int, RequestState] = {}
        self.by_name: dict[str, RequestState] = {}
        self.queues: dict[int, asyncio.Queue] = {}
        self.stats = EngineStats()
        self.trace = trace
        self.dead: EngineDeadError | None = None
        self._rids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self.cmd = ctx.socket(zmq.PUSH)
        self.cmd.setsockopt(zmq.LINGER, 0)
        self.cmd.bind(addr.cmd)
        self.status = ctx.socket(zmq.PULL)
        self.status.setsockopt(zmq.LINGER, 0)
        self.status.bind(addr.status)
        self._probes: dict[int, asyncio.Future] = {}
        self._probe_parts: dict[int, dict] = {}
        self._probe_ids = itertools.count()
        self.beats: dict[str, tuple[float, float]] = {}  # worker -> (when its last heartbeat came, its busy_s)
        # callables(M.Verdict), run in order after each verdict is applied: step stats, dynamic speculation,
        # metrics; the one hook API
        self.verdict_listeners: list = []

    # -- start-up ----------------------------------------------------------------------------------
    async def wait_ready(self, procs, timeout: float) -> None:
        ready: set[str] = set()
        deadline = time.monotonic() + timeout
        while ready != {"drafter", "verifier"}:
            for p in procs:
                if p.exitcode == UNGUARDED_MAIN_EXIT:
                    raise EngineDeadError(
                        "the script that starts the Engine has no `if __name__ == \"__main__\":` guard: worker "
                        "processes are spawned and re-run it as they start; put the code that starts the Engine "
                        "under that guard")
                if p.exitcode is not None:
                    raise EngineDeadError(f"worker {p.name} exited during start-up (code {p.exitcode})")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"workers not ready after {timeout:g} s")
            if await self.status.poll(100):
                m = decode_status(await self.status.recv())
                if isinstance(m, M.Error):
                    raise EngineDeadError(f"{m.who} failed during start-up:\n{m.msg}")
                if isinstance(m, M.Ready):
                    ready.add(m.who)

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._pump(self.status, decode_status, self._on_status))]

    # -- requests ----------------------------------------------------------------------------------
    def submit(self, prompt, params, request_id: str | None) -> tuple[RequestState, asyncio.Queue]:
        if self.dead:
            raise self.dead
        if len(self.waiting) >= self.config.max_queue:
            raise OverloadedError(f"{len(self.waiting)} requests already waiting (max_queue="
                                  f"{self.config.max_queue}); retry later")
        rid = next(self._rids)
        name = request_id if request_id is not None else f"req-{rid}"
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("request_id must be a non-empty str")
        if name in self.by_name:
            raise InvalidRequestError(f"request_id {name!r} is already in use")
        req = make_request(rid, prompt, params, self.tokenizer, self.config, self.vocab_size)
        try:  # fail here, not at admission, if it cannot travel to the workers
            encode(req)
        except (OverflowError, TypeError, ValueError) as e:
            raise InvalidRequestError(f"request cannot be encoded: {e}") from None
        if not self.admission.fits_ever(req):
            raise InvalidRequestError(f"request needs {req.cache_tokens(self.max_draft)} KV positions, more than the "
                                      f"whole cache ({self.config.kv_cache_tokens}; {KV_LIMIT})", "max_tokens")
        state = RequestState(name, req, self.tokenizer)
        q: asyncio.Queue = asyncio.Queue()
        self.by_name[name], self.queues[rid] = state, q
        self.waiting.append(state)
        self._admit()
        return state, q

    @property
    def free_blocks(self) -> int:
        """Blocks a new request could take (free, or cached and held by nobody)."""
        return self.admission.free_blocks

    def _admit(self) -> None:
        # the rest wait for a running request to finish, or for their shared prefix to be computed
        for s in self.admission.admit_from(self.waiting, self.config.max_batch_size - len(self.running)):
            self.running[s.req.rid] = s
            self.cmd.send(encode(M.Add(s.req)))

    def abort(self, name: str) -> bool:
        """Cancel a request by id; True if it was still pending."""
        s = self.by_name.get(name)
        if s is None or s.finished:
            return False
        s.finish("abort")
        self.stats.aborted += 1
        rid = s.req.rid
        if rid in self.running:
            self.cmd.send(encode(M.Abort([rid])))
        else:
            self.waiting.remove(s)
        self._release(s)
        self._emit(rid, StreamDelta(name, "", [], True, "abort", s.stats))
        return True

    def _release(self, s: RequestState) -> None:
        rid = s.req.rid
        if self.running.pop(rid, None) is not None:
            self.admission.release(rid)
        self.by_name.pop(s.request_id, None)
        self._admit()

    def _emit(self, rid: int, item) -> None:
        q = self.queues.get(rid)
        if q is not None:
            q.put_nowait(item)
            if isinstance(item, Exception) or item.finished:
                del self.queues[rid]

    # -- worker messages ---------------------------------------------------------------------------
    async def _pump(self, sock, decode, handle) -> None:
        """Feed every message of sock to handle until it returns True, the socket closes, or it raises."""
        try:
            n = 0
            while True:
                m = decode(await sock.recv())
                n += 1
                if n % 8 == 0:  # a ready socket's recv does not yield: let streams and the watchdog run
                    await asyncio.sleep(0)
                if handle(m):
                    return
        except (asyncio.CancelledError, zmq.ZMQError):
            return
        except Exception as e:  # a handler bug must fail the requests, not strand them
            self.fail(EngineDeadError(f"scheduler loop crashed: {type(e).__name__}: {e}\n{traceback.format_exc()}"))

    def _on_status(self, m) -> bool:
        if isinstance(m, M.Verdict):
            self._on_verdict(m)
        elif isinstance(m, M.Heartbeat):
            self.beats[m.who] = (time.monotonic(), m.busy_s)
        elif isinstance(m, M.ProbeReply):
            parts = self._probe_parts.setdefault(m.id, {})
            parts[m.who] = m
            fut = self._probes.get(m.id)
            if len(parts) == 2 and fut is not None and not fut.done():
                fut.set_result(self._probe_parts.pop(m.id))
        elif isinstance(m, M.Error):
            self.fail(EngineDeadError(f"{m.who} failed:\n{m.msg}"))
            return True
        return False

    def _on_verdict(self, m: M.Verdict) -> None:
        st = self.stats
        st.steps += 1
        st.verify_time_s += m.t1 - m.t0
        # drafting time comes with the verdict: a lease's later steps carry an empty span (no drafting)
        st.draft_time_s += m.draft_t1 - m.draft_t0
        if self.trace:
            if m.draft_t1 > m.draft_t0:
                st.trace.append(TraceEvent("drafter", "draft", m.batch, m.draft_t0, m.draft_t1, m.step))
            st.trace.append(TraceEvent("verifier", "verify", m.batch, m.t0, m.t1, m.step))
        src = m.src
        prefilled = False
        for i, r in enumerate(m.results):
            s = self.running.get(r.rid)
            if s is None or s.finished:
                continue  # aborted meanwhile
            st.draft_tokens += r.num_drafted
            st.accepted_tokens += r.num_accepted
            if src and r.num_drafted:
                c = st.by_source.setdefault(src[i], [0, 0])
                c[0] += r.num_drafted
                c[1] += r.num_accepted
            st.row_steps += 1
            st.prefill_tokens += r.prefill_tokens
            prefilled |= self.admission.on_result(r.rid, r.new_tokens)
            before = s.stats.output_tokens
            delta = s.on_result(r)
            st.output_tokens += s.stats.output_tokens - before
            if s.finished:
                st.finished += 1
                if r.finish_reason is None:  # a stop string: the workers still hold it
                    self.cmd.send(encode(M.Abort([r.rid])))
                self._release(s)
            self._emit(r.rid, delta)
        if prefilled and self.waiting:  # requests waiting on those prompts' prefixes can start now
            self._admit()
        for fn in self.verdict_listeners:
            fn(m)

    async def probe(self, timeout: float = 5.0, keep=("seqs", "cache_seqs", "used_blocks", "waiting")) -> dict:
        """Ask both workers what their KV caches hold (or, with keep=("cores", "threads"), where they run)."""
        if self.dead:
            raise self.dead
        pid = next(self._probe_ids)
        fut = self._probes[pid] = asyncio.get_running_loop().create_future()
        self.cmd.send(encode(M.Probe(pid)))
        try:
            parts = await asyncio.wait_for(fut, timeout)
        finally:
            self._probes.pop(pid, None)
        return {who: {f: getattr(m, f) for f in keep if getattr(m, f, None) is not None}
                for who, m in parts.items()}

    def set_k(self, k: int) -> None:
        self.cmd.send(encode(M.SetK(int(k))))

    # -- liveness ----------------------------------------------------------------------------------
    def reset_heartbeats(self) -> None:
        """Start the heartbeat clocks now (the workers are ready)."""
        now = time.monotonic()
        self.beats = {w: (now, 0.0) for w in ("drafter", "verifier")}

    def hung_worker(self, timeout: float) -> tuple[str, str] | None:
        """(worker, why) for a worker that sent no heartbeat for `timeout` s, or whose main loop has been in one
        iteration (e.g. one forward) for longer than that; None when both are live."""
        now = time.monotonic()
        for who, (at, busy) in self.beats.items():
            if now - at > timeout:
                return who, (f"no heartbeat for {now - at:.1f} s (heartbeat_timeout_s={timeout:g}); the process "
                             "is stopped or frozen")
            if busy > timeout:
                return who, (f"stuck in one step for {busy:.1f} s (heartbeat_timeout_s={timeout:g})")
        return None

    # -- failure and shutdown ----------------------------------------------------------------------
    def fail(self, err: EngineDeadError) -> None:
        """Fail every pending request at once; later submissions raise the same error."""
        if self.dead:
            return
        self.dead = err
        for s in list(self.running.values()) + list(self.waiting):
            if not s.finished:
                s.finish("error")
                self.stats.failed += 1
            self._emit(s.req.rid, err)
        self.running.clear()
        self.waiting.clear()
        self.by_name.clear()
        self.queues.clear()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sock in (self.cmd, self.status):
            sock.close(linger=0)

    def send_stop(self) -> None:
        try:
            fut = self.cmd.send(encode(M.Stop()), zmq.NOBLOCK)
        except zmq.ZMQError:
            return
        if asyncio.isfuture(fut):  # zmq.asyncio reports a failed send through the future
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    @property
    def num_pending(self) -> int:
        return len(self.running) + len(self.waiting)
