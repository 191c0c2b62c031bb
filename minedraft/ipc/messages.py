"""Every message between the caller's process and the workers, declared once (no torch here: the scheduler
imports this without loading the models' stack).

Each message is a msgspec Struct with array_like=True: on the wire it is a msgpack array of its fields in
order, with no key names; a control message's first element is its tag (tag=...), so one decoder per socket
takes the union of what that socket carries (ipc/codec.py). docs/ARCHITECTURE.md "Messages between processes"
lists them, who sends and who reads each; tests/ipc/test_messages.py keeps that table equal to this module.

Names: `k` is a step's draft budget per row (set by dynamic speculation, at most the configured k);
`max_draft` is the most drafts one row can carry in a step (k, plus tetris_extra in Tetris mode), what KV
reservations and draft slots are sized for.
"""

from __future__ import annotations

from typing import Union

import msgspec

from ..config import DraftBudget, EngineConfig
from ..sampling_params import SamplingParams


class _Msg(msgspec.Struct, array_like=True, omit_defaults=False):
    """Base of the messages: compact positional encoding, named fields in Python."""


# -- the worker spec: built by the Engine, handed to each worker process at spawn (pickled, not on a socket) -----
class Addresses(_Msg):
    cmd: str              # scheduler PUSH -> drafter PULL
    status: str           # workers PUSH -> scheduler PULL
    drafts: str           # drafter XPUB -> verifier SUB
    verdict_drafter: str  # verifier PUSH -> drafter PULL


class TPRank(_Msg):
    """One tensor-parallel rank of a role (workers/tp_ranks.py)."""
    role: str        # "drafter" | "verifier"
    model: str       # "draft" | "target": the spec field holding its model directory
    rank: int
    world: int
    init: str        # torch.distributed init_method
    timeout_s: float


class WorkerConfig(_Msg):
    """What both workers take from EngineConfig, derived in one place (of); WorkerSpec adds the wiring."""
    mode: str
    budget: DraftBudget      # the configured k (0: no drafting, autoregressive mode), Tetris' extra and capacity
    merge_on_zero: bool      # with k = 0 the two batches merge into one (minedraft/pipeline.py)
    kv_cache_tokens: int
    block_size: int
    dtype: str
    target: str
    draft: str | None        # the draft model (a folder or "self:<scheme>"); None: suffix drafts alone
    suffix: dict | None      # draft="suffix" / "suffix+<model>": the SuffixConfig fields; None: a model draft
    hybrid_threshold: float
    heartbeat_s: float

    @classmethod
    def of(cls, cfg: EngineConfig) -> "WorkerConfig":
        return cls(mode=cfg.mode, budget=cfg.budget,
                   # dynamic speculation in minedraft mode: at k = 0 one merged batch, the drafter's cores lent
                   merge_on_zero=bool(cfg.adaptive_k and cfg.draft_k and cfg.mode == "minedraft"),
                   kv_cache_tokens=cfg.kv_cache_tokens, block_size=cfg.block_size, dtype=cfg.dtype,
                   target=cfg.target, draft=cfg.draft_model,
                   suffix=(cfg.suffix_options or {}) if cfg.suffix_drafts else None,
                   hybrid_threshold=cfg.hybrid_threshold, heartbeat_s=min(1.0, cfg.heartbeat_timeout_s / 4))

    @property
    def k(self) -> int:
        return self.budget.k

    @property
    def max_draft(self) -> int:
        return self.budget.max_draft


class WorkerSpec(_Msg):
    """One worker process's start-up: the shared configuration view and this process's wiring."""
    cfg: WorkerConfig
    addr: Addresses
    eos: list[int]
    shm: list[str]           # draft slots' shared-memory names (CPU); empty on CUDA
    slot_nbytes: int
    features: bool           # a feature-conditioned draft: the verifier sends the target's features back
    feat_nbytes: int
    feat_shm: list[str]
    fault: list | None       # fault injection (tests): [who, point, n, "raise" | "exit" | "sleep", seconds?]
    # per process, filled in by the Engine / role_processes
    device: str = "cpu"
    cores: list[int] | None = None
    share_cores: list[int] | None = None  # drafter: the verifier's cores, usable while it drafts nothing
    lend_cores: list[int] | None = None   # verifier: the drafter's cores, borrowed for steps without drafts
    tp: TPRank | None = None


# -- payloads ----------------------------------------------------------------------------------------------------
class NewRequest(_Msg):
    """What both workers know about a request: the scheduler sends this once, on admission."""
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # always set: the scheduler draws one when the caller gave none
    blocks: list[int] | None = None  # its KV block table (the scheduler's BlockManager), the same in both workers
    cached: int = 0  # leading prompt positions those blocks already hold (shared with other requests)

    def cache_tokens(self, max_draft: int) -> int:
        """Positions to reserve: prompt, every output token, and the drafts in flight past them."""
        return len(self.prompt_ids) + self.params.max_tokens + max_draft + 1


class StepResult(_Msg):
    """One row of a verdict."""
    rid: int
    new_tokens: list[int]        # accepted drafts + the verifier's token, cut at a stop / max_tokens
    num_drafted: int
    num_accepted: int
    finish_reason: str | None    # "stop" | "length" | None (still running)
    prefill_tokens: int = 0      # on a request's first result: prompt positions the verifier computed
    # with SamplingParams.logprobs: per new token [logprob, [[id, logprob], ...]] under the target's raw law
    # (sampling/logprobs.py); None unless the request asked
    logprobs: list | None = None


class DraftsDesc(_Msg):
    """Where a batch's drafts lie in its slot (ipc/tensors.py): counts [rows], tokens [rows, width],
    q [rows, width, vocab]; width = the longest row (0: no drafts stored), vocab = 0: no q (all greedy)."""
    slot: int
    rows: int
    width: int
    vocab: int


class FeatureDesc(_Msg):
    """A verdict's target features in its feature slot: counts[i] positions of row i, `hidden` wide."""
    slot: int
    counts: list[int]
    hidden: int
    dtype: str


# -- control messages: the tag is the first array element --------------------------------------------------------
class Add(_Msg, tag="add"):
    req: NewRequest          # the drafter's Pipeline picks its batch


class Abort(_Msg, tag="abort"):
    rids: list[int]


class SetK(_Msg, tag="set_k"):
    k: int


class Probe(_Msg, tag="probe"):
    id: int


class Stop(_Msg, tag="stop"):
    pass


class Slots(_Msg, tag="slots"):
    cuda_handles: bytes


class FeatureSlots(_Msg, tag="feature_slots"):
    cuda_handles: bytes


class Yield(_Msg, tag="yield"):
    batch: int


class Drafts(_Msg, tag="drafts"):
    batch: int
    step: int
    rids: list[int]
    adds: list[NewRequest]
    removes: list[int]
    desc: DraftsDesc | None  # None: no rows, only removals
    t0: float                # drafting began / ended (time.monotonic())
    t1: float
    k: int = 0               # this step's budget per row
    lease: bool = False      # plain decoding with nothing pending: the verifier keeps stepping this batch
    src: list[str] | None = None  # suffix drafts: each row's draft source ("suffix", "model", "")


class Verdict(_Msg, tag="verdict"):
    batch: int
    step: int
    results: list[StepResult]
    t0: float                # verifying began / ended
    t1: float
    prefill: bool            # the step also took new requests' prompts
    draft_t0: float
    draft_t1: float
    k: int
    more: bool               # a lease goes on: the drafter hears of these rows with the lease's last verdict
    feat: FeatureDesc | None = None  # to the drafter only, with a feature-conditioned draft
    src: list[str] | None = None     # suffix drafts: each row's draft source, as the drafts message gave it


class Ready(_Msg, tag="ready"):
    who: str


class Heartbeat(_Msg, tag="hb"):
    who: str
    busy_s: float            # how long the main loop has been in its current iteration


class Error(_Msg, tag="error"):
    who: str
    msg: str                 # the traceback


class ProbeReply(_Msg, tag="probe_reply"):
    who: str
    id: int
    seqs: int                # rows in its batches
    cache_seqs: int
    used_blocks: int
    cores: list[int]
    threads: int
    waiting: int | None = None  # the drafter's requests still waiting for cache room
    model: dict | None = None   # what its model takes: weight_bytes (+ a self-draft's scheme and load_s)


# what each socket carries (one decoder per socket, ipc/codec.py)
CmdMsg = Union[Add, Abort, SetK, Probe, Stop]                      # scheduler -> drafter
DraftsMsg = Union[Slots, Drafts, Yield, Probe, Stop]               # drafter -> verifier
ToDrafterMsg = Union[FeatureSlots, Verdict]                        # verifier -> drafter
StatusMsg = Union[Ready, Heartbeat, Error, ProbeReply, Verdict]    # workers -> scheduler

CONTROL = (Add, Abort, SetK, Probe, Stop, Slots, FeatureSlots, Yield, Drafts, Verdict, Ready, Heartbeat, Error,
           ProbeReply)
