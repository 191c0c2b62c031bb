"""The embedded async API: start the two workers, submit requests, stream or await their output.

    async with Engine(EngineConfig(mode="minedraft")) as engine:
        result = await engine.generate("Hello", SamplingParams(max_tokens=32))
        async for delta in engine.stream("Hello"):
            print(delta.text, end="")
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from typing import AsyncIterator

import zmq
import zmq.asyncio
from msgspec.structs import replace

from .scheduler import UNGUARDED_MAIN_EXIT, AsyncScheduler
from ..config import EngineConfig
from ..cores import resolve as resolve_cores, worker_environment
from ..errors import EngineDeadError, InvalidRequestError
from ..ipc.messages import Addresses, WorkerConfig, WorkerSpec
from ..ipc.shm import create_shm, destroy_shm, feature_slot_nbytes, slot_nbytes
from ..outputs import GenerationResult, StreamDelta
from ..sampling_params import SamplingParams, as_params
from .step_stats import StepStats
from .worker_exit import describe_exit
from ..cache.admission import prefix_stats
from ..workers.spawn import role_processes

log = logging.getLogger("minedraft.engine")

WATCH_S = 0.1
STOP_GRACE_S = 5.0   # how long a stopped worker may take to exit before it is killed


def _torch_has_cuda() -> bool:
    """Whether the installed torch is a CUDA build and a GPU driver is present, told without importing torch
    (seconds of the caller's start-up): its version module names the CUDA version it was built for."""
    import importlib.util
    import re
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin or not os.path.exists("/proc/driver/nvidia/version"):
        return False
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version" + os.extsep + "py")) as f:
            m = re.search(r"^cuda(?::[^=]*)?=\s*(.+)$", f.read(), re.M)
    except OSError:
        return True  # cannot tell: ask torch itself
    return m is None or m.group(1).strip() != "None"


def _resolve_devices(cfg: EngineConfig) -> tuple[str, str]:
    cuda, n = False, 0
    if "auto" in (cfg.target_device, cfg.draft_device) and _torch_has_cuda():
        import torch
        cuda = torch.cuda.is_available()
        n = torch.cuda.device_count() if cuda else 0
    target = cfg.target_device if cfg.target_device != "auto" else ("cuda:0" if cuda else "cpu")
    # the drafter gets the first GPU past the target's ranks, if there is one; else it shares cuda:0
    draft = cfg.draft_device if cfg.draft_device != "auto" else (
        f"cuda:{cfg.target_tp if n >= cfg.target_tp + cfg.draft_tp else 0}" if cuda else "cpu")
    if target.startswith("cuda") != draft.startswith("cuda"):
        raise ValueError("draft and target must both be on CUDA or both on CPU")
    return draft, target


def _hidden_size(target: str) -> int:
    from ..runner.gguf import model_dir
    with open(os.path.join(model_dir(target), "config.json")) as f:
        return int(json.load(f)["hidden_size"])


# transformers imports its classes lazily, and two threads resolving the same lazy name at once make one of them
# fail ("cannot import name 'AutoConfig'"): engines started concurrently in one process (each runs this in an
# executor thread) take turns here (a tokenizer may still come from AutoTokenizer, and chat templates are
# rendered by transformers' renderer)
_IMPORT_LOCK = threading.Lock()


def _load_tokenizer_and_meta(cfg: EngineConfig):
    """Check both model directories here, before spawning (shapes that do not split over the tensor-parallel ranks
    included), and load the target's tokenizer."""
    from ..models.check import check_pair
    with _IMPORT_LOCK:
        return check_pair(cfg.target, cfg.draft_model or cfg.target,
                          need_draft=cfg.speculative and cfg.draft_model is not None, target_tp=cfg.target_tp,
                          draft_tp=cfg.draft_tp)


def _last_line(err: Exception) -> str:
    """A worker's reported traceback ends with the exception itself: that line, after the first."""
    lines = [x.strip() for x in str(err).strip().splitlines()]
    return f" ({lines[-1]})" if len(lines) > 1 else ""


def _start_without_sigint(procs) -> None:
    """Start the worker processes with SIGINT blocked, so they inherit it blocked: a Ctrl-C, which the terminal
    sends to the whole process group, reaches only the parent, which then stops them in order. The parent's own
    SIGINT is delivered when it is unblocked."""
    block = hasattr(signal, "pthread_sigmask")
    if block:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        with worker_environment():  # OpenMP threads that sleep, not spin, while they wait (cores.py)
            for p in procs:
                p.start()
    finally:
        if block:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, trace: bool = False, fault=None, **overrides):
        if getattr(mp.current_process(), "_inheriting", False):
            # a worker being spawned is re-running its parent's script, which builds an Engine at import time
            # (no __main__ guard): leave quietly with a code the parent turns into one sentence, instead of
            # multiprocessing's page of tracebacks from every worker
            os._exit(UNGUARDED_MAIN_EXIT)
        self.config = config or EngineConfig(**overrides)
        self._trace, self._fault = trace, fault
        self.scheduler: AsyncScheduler | None = None
        self.procs: list = []
        self._shm, self._feat_shm = [], []
        self._tmp = None
        self._ctx = None
        self._watch = None
        self._closed = False
        self._choices: dict[str, int] = {}  # generate_choices in flight: base request id -> n
        self._ready = False
        self.tokenizer = None
        self.adaptive = None
        self.step_stats: StepStats | None = None
        # set when a worker dies or hangs while the engine runs (not on shutdown): servers wait on it to exit
        self.died = asyncio.Event()

    @classmethod
    async def start(cls, config: EngineConfig | None = None, **kw) -> "Engine":
        engine = cls(config, **kw)
        await engine._start()
        return engine

    async def __aenter__(self) -> "Engine":
        await self._start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    # -- life-cycle --------------------------------------------------------------------------------
    async def _start(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        self.tokenizer, vocab, eos = await loop.run_in_executor(None, _load_tokenizer_and_meta, cfg)
        self.eos_token_ids = list(eos)  # the ids that end a request unless ignore_eos (HTTP logprobs leave them out)
        draft_dev, target_dev = _resolve_devices(cfg)
        draft_cores, target_cores = resolve_cores(cfg.draft_cores, cfg.target_cores, cfg.core_mode)  # may raise: first
        self._tmp = tempfile.mkdtemp(prefix="minedraft-")
        addr = Addresses(*(f"ipc://{self._tmp}/{n}" for n in ("cmd", "status", "drafts", "verdict_drafter")))
        k = cfg.draft_k
        # suffix drafts alone never send probabilities (q None): no room for them
        nbytes = slot_nbytes(cfg.max_batch_size, max(cfg.max_draft, 1), vocab if cfg.draft_model else 0)
        # a feature-conditioned draft gets the target's features back with each verdict (ipc/tensors.py)
        from ..runner.model_files import FEATURE_FILE
        feat_nbytes = feature_slot_nbytes(cfg, _hidden_size(cfg.target)) if (
            k and cfg.draft_model and os.path.exists(os.path.join(cfg.draft_model, FEATURE_FILE))) else 0
        if not draft_dev.startswith("cuda"):
            self._shm = create_shm(2, nbytes)
            if feat_nbytes:
                self._feat_shm = create_shm(2, feat_nbytes)
        common = WorkerSpec(
            cfg=WorkerConfig.of(cfg), addr=addr, eos=list(eos), shm=[s.name for s in self._shm], slot_nbytes=nbytes,
            features=bool(feat_nbytes), feat_nbytes=feat_nbytes, feat_shm=[s.name for s in self._feat_shm],
            fault=list(self._fault) if self._fault else None)
        # at k = 0 (one merged batch) the verifier borrows the idle drafter's cores (CPU, one rank)
        lend = (common.cfg.merge_on_zero and not target_dev.startswith("cuda") and cfg.target_tp == 1
                and not set(draft_cores) & set(target_cores))
        try:
            self._ctx = zmq.asyncio.Context()
            self.scheduler = AsyncScheduler(cfg, self.tokenizer, vocab, self._ctx, addr, self._trace)
            self.step_stats = StepStats(k)
            self.scheduler.verdict_listeners.append(self.step_stats)
            mpc = mp.get_context("spawn")
            # each role's cores are split among its ranks (shared when there are fewer cores than ranks)
            draft_procs = role_processes(mpc, "drafter",
                                         replace(common, device=draft_dev, share_cores=target_cores if lend else None),
                                         cfg.draft_tp if k else 1, draft_cores, f"file://{self._tmp}/tp_drafter",
                                         cfg.tp_timeout_s)
            verify_procs = role_processes(mpc, "verifier",
                                          replace(common, device=target_dev, lend_cores=draft_cores if lend else None),
                                          cfg.target_tp, target_cores, f"file://{self._tmp}/tp_verifier",
                                          cfg.tp_timeout_s)
            # drafter and verifier (rank 0) first: health() reads them by position
            self.procs = [draft_procs[0], verify_procs[0], *draft_procs[1:], *verify_procs[1:]]
            _start_without_sigint(self.procs)
            await self.scheduler.wait_ready(self.procs, cfg.worker_start_timeout_s)
        except BaseException:
            await self.shutdown()  # also when spawning itself failed: the shared memory must not leak
            raise
        self._ready = True
        if cfg.sizing is not None:
            log.info(cfg.sizing.summary(cfg.kv_cache_memory_fraction))
        if cfg.adaptive_k and k:
            from .dynamic import DynamicSpeculation
            dyn = DynamicSpeculation(cfg, self.scheduler)
            self.adaptive = dyn.controller
            self.scheduler.verdict_listeners.append(dyn)
        self.scheduler.start()
        self._watch = asyncio.ensure_future(self._watchdog())

    async def _watchdog(self) -> None:
        """A worker that dies, or falls silent past heartbeat_timeout_s, fails every pending request (within
        WATCH_S of noticing) and takes the other one down."""
        sched = self.scheduler
        sched.reset_heartbeats()
        last = time.monotonic()
        while True:
            await asyncio.sleep(WATCH_S)
            now = time.monotonic()
            stalled = now - last > 1.0  # our own loop was blocked: the beats may be waiting unread, so
            last = now                  # judge liveness on the next round, after the pump has run
            dead = [p for p in self.procs if p.exitcode is not None]
            if not sched.dead and dead:
                p = dead[0]
                sched.fail(EngineDeadError(describe_exit(p.name, p.pid, p.exitcode)))
            elif not sched.dead and not stalled:
                hung = sched.hung_worker(self.config.heartbeat_timeout_s)
                if hung:
                    who, why = hung
                    p = next((q for q in self.procs if q.name == f"minedraft-{who}"), self.procs[0])
                    sched.fail(EngineDeadError(f"worker {p.name} (pid {p.pid}) is hung: {why}"))
            if sched.dead:
                # one line for the operator's log (the requests' own errors go to their clients only)
                log.error("engine dead: %s", " ".join(str(sched.dead).split("\n")[:1]) + _last_line(sched.dead))
                self.died.set()
                await asyncio.get_running_loop().run_in_executor(None, self._stop_workers, 0.0)
                self._cleanup_shm()
                return

    def _stop_workers(self, grace_s: float) -> None:
        """Wait up to grace_s for the workers to exit on their own, then kill what is left."""
        procs = [p for p in self.procs if p.pid is not None]  # spawning may have failed part-way
        deadline = time.monotonic() + grace_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.exitcode is None:
                p.kill()  # SIGKILL also ends a SIGSTOPped process
            p.join(5)

    def _cleanup_shm(self) -> None:
        destroy_shm(self._shm + self._feat_shm)
        self._shm, self._feat_shm = [], []

    async def shutdown(self, reason: str = "engine shut down") -> None:
        """Fail every pending request with EngineDeadError(reason), at once, then stop the workers."""
        if self._closed:
            return
        self._closed = True
        if self._watch:
            self._watch.cancel()
        if self.scheduler:
            self.scheduler.fail(EngineDeadError(reason))
            self.scheduler.send_stop()
        # workers still loading models do not read the stop command yet: no point waiting for them
        grace = STOP_GRACE_S if self._ready and all(p.exitcode is None for p in self.procs) else 0.0
        await asyncio.get_running_loop().run_in_executor(None, self._stop_workers, grace)
        if self.scheduler:
            await self.scheduler.close()
        self._cleanup_shm()
        if self._ctx:
            self._ctx.destroy(linger=0)  # also closes sockets a failed start left open
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    # -- requests ----------------------------------------------------------------------------------
    def _submit(self, prompt, params, request_id):
        if self.scheduler is None:
            raise EngineDeadError("engine not started")
        return self.scheduler.submit(prompt, params, request_id)

    async def _follow(self, state, q) -> AsyncIterator[StreamDelta]:
        """A request's deltas until it finishes; leaving early (break, cancel, error) aborts it."""
        try:
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not state.finished and self.scheduler:
                self.scheduler.abort(state.request_id)

    async def stream(self, prompt, params: SamplingParams | dict | None = None,
                     request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        """Yield deltas as tokens are accepted; the last one has finished=True. Breaking out (or cancelling
        the consuming task) aborts the request and frees its cache."""
        state, q = self._submit(prompt, params, request_id)
        follow = self._follow(state, q)
        try:
            async for delta in follow:
                yield delta
        finally:
            await follow.aclose()

    async def generate(self, prompt, params: SamplingParams | dict | None = None,
                       request_id: str | None = None) -> GenerationResult:
        state, q = self._submit(prompt, params, request_id)
        follow = self._follow(state, q)
        try:
            async for _ in follow:
                pass
        finally:
            await follow.aclose()
        return state.result()

    async def generate_choices(self, prompt, params: SamplingParams | dict | None = None,
                               request_id: str | None = None) -> list[GenerationResult]:
        """params.n completions of one prompt, as n requests "<request_id>.<i>" that share the prompt's KV blocks
        (the first computes the prompt, the others find it cached); each has its own seed (SamplingParams.choice).
        One failing or being cancelled cancels the others."""
        params = as_params(params)
        if params.n == 1:
            return [await self.generate(prompt, params, request_id)]
        base = request_id if request_id is not None else f"choices-{uuid.uuid4().hex[:12]}"
        if base in self._choices:
            raise InvalidRequestError(f"request_id {base!r} is already in use")
        self._choices[base] = params.n  # abort(base) aborts them all
        tasks = [asyncio.ensure_future(self.generate(prompt, params.choice(i), f"{base}.{i}"))
                 for i in range(params.n)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            del self._choices[base]
            for t in tasks:
                t.cancel()

    async def chat_choices(self, messages, params: SamplingParams | dict | None = None,
                           request_id: str | None = None) -> list[GenerationResult]:
        """generate_choices() for chat messages."""
        ids, params = self._chat_request(messages, params)
        return await self.generate_choices(ids, params, request_id)

    def _chat_request(self, messages, params) -> tuple[list[int], SamplingParams]:
        from .chat import chat_params, chat_prompt_ids, end_of_turn_id
        if self.tokenizer is None:
            raise EngineDeadError("engine not started")
        if not hasattr(self, "_eot"):  # read from the template once, on the first chat
            self._eot = end_of_turn_id(self.tokenizer)
        ids = chat_prompt_ids(self.tokenizer, messages, max_prompt_tokens=self.config.max_prompt_tokens)
        return ids, chat_params(params, self._eot)

    async def chat(self, messages, params: SamplingParams | dict | None = None,
                   request_id: str | None = None) -> GenerationResult:
        """Answer OpenAI-style messages ([{"role", "content"}]) through the target's chat template; stops at the
        template's end-of-turn token too (chat.end_of_turn_id)."""
        ids, params = self._chat_request(messages, params)
        return await self.generate(ids, params, request_id)

    async def stream_chat(self, messages, params: SamplingParams | dict | None = None,
                          request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        """stream() for chat messages; leaving early aborts the request like stream()."""
        ids, params = self._chat_request(messages, params)
        inner = self.stream(ids, params, request_id)
        try:
            async for delta in inner:
                yield delta
        finally:
            await inner.aclose()

    async def abort(self, request_id: str) -> bool:
        if not self.scheduler:
            return False
        n = self._choices.get(request_id)
        if n is not None:  # the completions of generate_choices
            return any([self.scheduler.abort(f"{request_id}.{i}") for i in range(n)])
        return self.scheduler.abort(request_id)

    async def kv_usage(self) -> dict:
        """What the drafter's and verifier's KV caches hold now (sequences, used blocks)."""
        return await self.scheduler.probe()

    async def placement(self) -> dict:
        """Where each worker runs and what its model takes: {"drafter": {"cores": [...], "threads": n, "model":
        {"weight_bytes": n, ...}}, "verifier": {...}} (a self-draft's model also names its scheme and load_s)."""
        return await self.scheduler.probe(keep=("cores", "threads", "model"))

    def stats(self) -> dict:
        s = self.scheduler
        st = s.stats
        cfg = self.config
        return {"mode": cfg.mode, "k": cfg.draft_k, "steps": st.steps,
                "output_tokens": st.output_tokens, "draft_tokens": st.draft_tokens,
                "accepted_tokens": st.accepted_tokens, "verified_tokens": st.draft_tokens + st.row_steps,
                "acceptance_rate": st.accepted_tokens / st.draft_tokens if st.draft_tokens else 0.0,
                "draft_time_s": st.draft_time_s, "verify_time_s": st.verify_time_s,
                "running": len(s.running), "waiting": len(s.waiting), "finished": st.finished,
                "aborted": st.aborted, "failed": st.failed,
                "kv_blocks_free": s.free_blocks, "kv_blocks_total": s.total_blocks,
                # prefix caching (cache/blocks.py): prompt tokens looked up / found, in tokens; cached blocks
                "prefill_tokens": st.prefill_tokens, **prefix_stats(s.admission.blocks),
                # per draft position i: drafts proposed there, and how many were accepted (step_stats.py)
                "drafted_by_position": list(self.step_stats.drafted_by_pos),
                "accepted_by_position": list(self.step_stats.accepted_by_pos),
                # suffix / hybrid drafts: tokens drafted and accepted by draft source ("suffix", "model")
                "drafted_by_source": {k: v[0] for k, v in st.by_source.items()},
                "accepted_by_source": {k: v[1] for k, v in st.by_source.items()}}

    def health(self) -> dict:
        alive = [p.exitcode is None and not (self.scheduler and self.scheduler.dead) for p in self.procs]
        ok = bool(self.scheduler) and not self.scheduler.dead and all(alive) and not self._closed
        return {"ok": ok, "drafter_alive": alive[0] if alive else False,
                "verifier_alive": alive[1] if len(alive) > 1 else False,
                "error": str(self.scheduler.dead) if self.scheduler and self.scheduler.dead else None}
