"""Engine configuration, validated at start so a bad setting fails with a clear message, not mid-run."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

PROMPT_CHARS_PER_TOKEN = 16  # a prompt string over this many characters per allowed token is refused before
#                               tokenizing (a cheap bound the engine and both servers share)

MODELS_DIR = Path(__file__).resolve().parent / "models"
DEFAULT_TARGET = str(MODELS_DIR / "tiny-target")
DEFAULT_DRAFT = str(MODELS_DIR / "tiny-draft")
MODES = ("minedraft", "sequential", "autoregressive")
# the share of available memory the two workers' KV caches take by default: on a 24 GB host with ~20 GB free, the
# real pair's two workers then start within 2 GB together (docs/BENCHMARKS.md "Worker memory")
KV_MEMORY_FRACTION = 0.02
# sizes used when the target's config.json cannot be read (the model check then reports the directory)
FALLBACK_SIZES = {"kv_cache_tokens": 65536, "max_prompt_tokens": 768, "max_tokens_limit": 512}
SELF_PREFIX = "self:"
SELF_SCHEMES = ("int4", "bf16")  # self-drafts: the target's own weights, converted (drafting/self_draft.py)
SUFFIX = "suffix"
_DRAFT_FORMS = ("a model directory, " + ", ".join(SELF_PREFIX + s for s in SELF_SCHEMES) + ", 'suffix' or "
                "'suffix+<model directory or self-draft>'")


INSTALL_HINT = ('a .gguf model runs through llama.cpp: install its Python bindings with pip install -e ".[gguf]" '
                '(or pip install llama-cpp-python; it compiles llama.cpp, ~25 minutes on two cores)')


def is_gguf(path) -> bool:
    """A GGUF model file (run by llama.cpp, minedraft/runner/llama_cpp.py) rather than a model folder."""
    return isinstance(path, (str, os.PathLike)) and str(path).lower().endswith(".gguf")


def llama_cpp_installed() -> bool:
    """Whether llama-cpp-python is installed (found, not imported: its import loads llama.cpp)."""
    import importlib.util
    return importlib.util.find_spec("llama_cpp") is not None


def check_gguf(path: str, name: str = "target") -> str | None:
    """Why a GGUF path cannot be used (one sentence), or None."""
    if not os.path.isfile(path):
        return f"{name} {path!r} is not a file"
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            return f"{name} {path!r} is not a GGUF file (no GGUF magic)"
    if not llama_cpp_installed():
        return f"{name} {path!r}: {INSTALL_HINT}"
    return None


def parse_draft(draft: str) -> tuple[bool, str | None]:
    """The draft option, read in one place -> (suffix drafting on, the draft model or None). "suffix": the suffix
    index alone (no draft model); "suffix+<model>": hybrid, per row the suffix proposal when its score clears
    hybrid_threshold, else the model's draft; anything else: the draft model, a directory or a self-draft
    ("self:int4"). A ValueError names the option and the valid forms."""
    if not isinstance(draft, str):
        raise ValueError(f"draft must be {_DRAFT_FORMS}, got {draft!r}")
    if draft == SUFFIX:
        return True, None
    suffix = draft.startswith(SUFFIX + "+")
    model = draft[len(SUFFIX) + 1:] if suffix else draft
    self_scheme(model)  # an unknown self-draft scheme fails here, before any worker starts
    return suffix, model


def default_mode(draft: str) -> str:
    """The mode "auto" resolves to: sequential SD for suffix drafts alone (they cost no forward, so the two-batch
    overlap has nothing to hide and would pay two weight passes per step: measured 0.70-0.76x sequential on the
    real pair, docs/BENCHMARKS.md "Suffix drafts"), the two-batch overlap when a draft model runs."""
    return "sequential" if parse_draft(draft)[1] is None else "minedraft"


def default_k(draft: str) -> int:
    """k when none is given: 6 for suffix drafts alone (a copied span comes whole and costs no forward to draft; the
    index still stops each row's draft where its continuation gets unlikely; docs/BENCHMARKS.md "Suffix drafts"
    measured k = 6), 4 with a draft model, where every drafted token is a forward."""
    return 6 if parse_draft(draft)[1] is None else 4


def self_scheme(model: str) -> str | None:
    """"self:int4" -> "int4"; a model directory -> None; an unknown scheme -> ValueError."""
    if not model.startswith(SELF_PREFIX):
        return None
    scheme = model[len(SELF_PREFIX):]
    if scheme not in SELF_SCHEMES:
        raise ValueError(f"draft must be {_DRAFT_FORMS}; {model!r} names an unknown self-draft scheme")
    return scheme


@dataclass(frozen=True)
class DraftBudget:
    """A step's draft budget, one rule for the drafter process and the in-process baselines: the configured
    per-row k (the cap dynamic speculation moves under; 0: no drafting) and Tetris' extra drafts and capacity."""
    k: int
    tetris: bool = False
    extra: int = 0                  # Tetris: drafts per row beyond k to choose from
    capacity: int | None = None     # Tetris: drafts verified per step at the configured k (None: k x rows)

    @property
    def max_draft(self) -> int:
        """The most drafts a row carries in one step: what KV reservations and draft slots are sized for."""
        return self.k + self.extra if self.tetris else self.k

    def at(self, k: int, rows: int) -> tuple[int, int | None]:
        """(drafts per row, Tetris capacity or None) for a step of `rows` rows at per-row budget k (<= self.k):
        Tetris drafts k + extra per row and keeps the capacity best, by default k x rows; a configured capacity
        scales with k / the configured k. k = 0 drafts nothing."""
        if k == 0 or not self.tetris:
            return k, None
        return k + self.extra, (k * rows if self.capacity is None else max(1, round(self.capacity * k / self.k)))


@dataclass(frozen=True)
class SuffixConfig:
    """The suffix index's knobs (drafting/suffix_index.py), checked with the engine's settings."""
    max_depth: int = 32
    spec_factor: float = 2.0
    spec_offset: float = 0.0
    min_prob: float = 0.3
    max_candidates: int = 64
    match_prior: float = 1.5        # a token that makes the match m long counts as right with m / (m + this)
    global_tokens: int = 65536      # budget of the global index (tokens held; oldest texts evicted first)
    global_prompts: bool = False    # also put finished requests' prompts in the global index

    def __post_init__(self):
        if not (isinstance(self.max_depth, int) and self.max_depth >= 1):
            raise ValueError(f"max_depth must be an int >= 1, got {self.max_depth!r}")
        if not (self.spec_factor > 0 and self.spec_offset >= 0):
            raise ValueError("spec_factor must be > 0 and spec_offset >= 0")
        if not 0 <= self.min_prob <= 1:
            raise ValueError(f"min_prob must be in [0, 1], got {self.min_prob!r}")
        if not self.match_prior >= 0:
            raise ValueError(f"match_prior must be >= 0, got {self.match_prior!r}")
        if not (isinstance(self.max_candidates, int) and self.max_candidates >= 1):
            raise ValueError(f"max_candidates must be an int >= 1, got {self.max_candidates!r}")
        if not (isinstance(self.global_tokens, int) and self.global_tokens >= 0):
            raise ValueError(f"global_tokens must be an int >= 0, got {self.global_tokens!r}")


@dataclass
class EngineConfig:
    target: str = DEFAULT_TARGET     # a Hugging Face model folder, or a .gguf file (llama.cpp runs it: [gguf] extra)
    draft: str = DEFAULT_DRAFT       # a draft folder or .gguf, or "self:int4" / "self:bf16" (the target's own weights)
    # "minedraft" (two-batch overlap) | "sequential" (standard SD) | "autoregressive" (target alone) | "auto":
    # sequential for suffix drafts alone (no draft model: nothing for the overlap to hide), else minedraft
    mode: str = "auto"
    k: int | None = None             # draft tokens per step (the cap when adaptive_k); None: default_k(draft), 6 or 4
    # dynamic speculation: pick k per step (0..k) from measured cost and acceptance. On by default: it starts at
    # k = 0 (every mode) and drafts only once drafting measurably pays, so a draft that does not pay on this
    # host costs next to nothing (README "Defaults"; docs/BENCHMARKS.md "Defaults")
    adaptive_k: bool = True
    tetris: bool = False             # draft k + tetris_extra per row, keep the batch's tetris_capacity best drafts
    tetris_capacity: int | None = None  # draft tokens verified per step in Tetris mode (default: k x rows)
    tetris_extra: int = 2            # extra drafts per row Tetris may choose from
    max_batch_size: int = 32         # running requests in all (split over the two batches)
    # KV positions per model; admission waits when a request's reservation does not fit. None: sized from the
    # memory available and the model (kv_budget.py): kv_cache_memory_fraction of it, for both workers' caches
    kv_cache_tokens: int | None = None
    kv_cache_memory_fraction: float = KV_MEMORY_FRACTION
    block_size: int = 16
    prefix_caching: bool = True      # share the KV blocks of a prompt prefix already computed (docs/ARCHITECTURE.md)
    max_prompt_tokens: int | None = None  # None: the model's context (or what the KV cache holds) less the output
    max_tokens_limit: int | None = None   # upper bound a request's max_tokens may ask for; None: half of that, <= 1024
    max_queue: int = 1024            # waiting requests; past it, generate() raises OverloadedError
    draft_device: str = "auto"       # "auto" | "cpu" | "cuda:N"
    target_device: str = "auto"
    dtype: str = "float32"           # greedy identity with target-alone is exact in float32 only (see README)
    worker_start_timeout_s: float = 120.0
    # A worker whose heartbeats stop (stopped, frozen) or that stays inside one step (a forward) longer than this
    # is declared hung: every pending request fails with EngineDeadError. Generous, because a big model's
    # forward on a loaded CPU can take seconds.
    heartbeat_timeout_s: float = 60.0
    draft_cores: list[int] | str | None = None   # CPU cores of the drafter, e.g. [0] or "0-1"; None = default split
    target_cores: list[int] | str | None = None  # of the verifier; see minedraft/cores.py for the default rule
    target_tp: int = 1               # tensor-parallel ranks of the verifier (one GPU or share of target_cores each)
    draft_tp: int = 1                # same for the drafter
    tp_timeout_s: float = 30.0       # a collective that waits longer than this fails the engine
    # draft="suffix" / "suffix+<model>": the suffix index's knobs (SuffixConfig's fields) and, for the
    # hybrid, the proposal score (expected accepted tokens) from which a row takes the suffix draft
    suffix_options: dict | None = None
    hybrid_threshold: float = 1.0

    sizing = None  # kv_budget.Sizing when validate() derived the sizes (not a field: how, not what)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        def bad(msg):
            raise ValueError(f"invalid EngineConfig: {msg}")

        if self.mode not in MODES + ("auto",):
            bad(f"mode must be one of {MODES + ('auto',)}, got {self.mode!r}")
        if self.mode == "auto" or self.k is None:  # resolved once, here: everything downstream sees concrete values
            try:
                if self.mode == "auto":
                    self.mode = default_mode(self.draft)
                if self.k is None:
                    self.k = default_k(self.draft)
            except ValueError as e:
                bad(str(e))
        sized = ("kv_cache_tokens", "max_prompt_tokens", "max_tokens_limit")  # None: derived, below
        for name in ("k", "max_batch_size", "block_size", "max_queue") + sized:
            v = getattr(self, name)
            if (isinstance(v, bool) or not isinstance(v, int)) and not (name in sized and v is None):
                bad(f"{name} must be an int, got {v!r}")
        f = self.kv_cache_memory_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            bad(f"kv_cache_memory_fraction must be a number in (0, 1], got {f!r}")
        if not 1 <= self.k <= 16:
            bad(f"k must be in 1..16, got {self.k}")
        if isinstance(self.tetris_extra, bool) or not isinstance(self.tetris_extra, int) \
                or not 0 <= self.tetris_extra <= 16:
            bad(f"tetris_extra must be an int in 0..16, got {self.tetris_extra!r}")
        c = self.tetris_capacity
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            bad(f"tetris_capacity must be None or an int >= 1, got {c!r}")
        for name in ("max_batch_size", "block_size", "max_queue") + sized:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                bad(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("target_tp", "draft_tp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 64:
                bad(f"{name} must be an int in 1..64, got {v!r}")
        if not self.tp_timeout_s > 0:
            bad(f"tp_timeout_s must be > 0, got {self.tp_timeout_s!r}")
        for name in ("worker_start_timeout_s", "heartbeat_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                bad(f"{name} must be a positive number of seconds, got {v!r}")
        if not isinstance(self.prefix_caching, bool):
            bad(f"prefix_caching must be a bool, got {self.prefix_caching!r}")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            bad(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        for name in ("draft_device", "target_device"):
            d = getattr(self, name)
            if not (d in ("auto", "cpu") or (d.startswith("cuda") and d[4:] in ("", *(f":{i}" for i in range(64))))):
                bad(f"{name} must be 'auto', 'cpu' or 'cuda:N', got {d!r}")
        from .cores import parse_cores, resolve
        try:
            for name in ("draft_cores", "target_cores"):  # normalise "0-2" to [0, 1, 2]
                if isinstance(getattr(self, name), str):
                    setattr(self, name, parse_cores(getattr(self, name)))
            resolve(self.draft_cores, self.target_cores, self.core_mode)
        except ValueError as e:
            bad(str(e))
        try:
            model = parse_draft(self.draft)[1]
        except ValueError as e:
            bad(str(e))
        scheme = self_scheme(model) if model is not None else None
        if scheme is not None and self.draft_tp > 1:
            bad(f"draft={self.draft!r} runs on one drafter rank; set draft_tp=1 (the target may still use target_tp)")
        if self.suffix_drafts:
            try:
                SuffixConfig(**(self.suffix_options or {}))
            except (TypeError, ValueError) as e:
                bad(f"suffix_options: {e}")
            if self.tetris:
                bad("tetris ranks a draft model's confidences; it does not take suffix drafts")
            if self.draft_tp > 1 and model is None:
                bad("draft_tp > 1 needs a draft model; draft='suffix' has none")
        elif self.suffix_options:
            bad("suffix_options needs draft='suffix' or 'suffix+<model>'")
        if not 0 <= self.hybrid_threshold < float("inf"):
            bad(f"hybrid_threshold must be a number >= 0, got {self.hybrid_threshold!r}")
        for name, p in (("target", self.target), ("draft", None if scheme else model)):
            if is_gguf(p):  # a GGUF file runs through llama.cpp (runner/llama_cpp.py): CPU, one rank
                problem = check_gguf(p, name)
                if problem:
                    bad(problem)
                if getattr(self, f"{name}_tp") > 1 or getattr(self, f"{name}_device").startswith("cuda"):
                    bad(f"{name} {p!r} is a GGUF file: it runs through llama.cpp on the CPU, one rank "
                        f"({name}_tp=1, {name}_device 'auto' or 'cpu')")
            elif p is not None and not os.path.isdir(p):
                bad(f"{name} model path {p!r} is not a directory (models load from local paths only; draft may "
                    f"also be {_DRAFT_FORMS[len('a model directory, '):]})")

        if None in (self.kv_cache_tokens, self.max_prompt_tokens, self.max_tokens_limit):
            self._size()
        need = self.max_prompt_tokens + self.max_tokens_limit + self.max_draft + 1
        need_blocks = -(-need // self.block_size)
        if self.kv_cache_tokens // self.block_size < need_blocks:
            bad(f"kv_cache_tokens={self.kv_cache_tokens} ({self.kv_cache_tokens // self.block_size} blocks of "
                f"{self.block_size}) cannot hold even one request of max_prompt_tokens + max_tokens_limit + k + 1 "
                f"(+ tetris_extra) = {need} positions ({need_blocks} blocks); raise it or lower those limits")

    def _size(self) -> None:
        """Fill the unset sizes from the model and the memory available (kv_budget.py); `sizing` keeps how."""
        from . import kv_budget
        try:
            draft = self.draft_model if self.speculative else None
            if draft is None:
                dcfg, ddtype = None, None
            elif self_scheme(draft):  # the target's own shapes; self:int4 keeps its KV cache float32
                dcfg = kv_budget.read_config(self.target)
                ddtype = "bfloat16" if self_scheme(draft) == "bf16" else "float32"
            else:
                dcfg, ddtype = kv_budget.read_config(draft), self.dtype
        except (OSError, ValueError, KeyError, TypeError):
            dcfg = False
        try:
            if dcfg is False:
                raise OSError
            kv_budget.read_config(self.target)
        except (OSError, ValueError, KeyError, TypeError):  # an unreadable model: the model check names it later
            for name, v in FALLBACK_SIZES.items():
                if getattr(self, name) is None:
                    setattr(self, name, v)
            return
        try:
            self.sizing = kv_budget.size(self, dcfg, ddtype, kv_budget.available_memory())
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"invalid EngineConfig: {e}") from None
        for name in ("kv_cache_tokens", "max_prompt_tokens", "max_tokens_limit"):
            setattr(self, name, getattr(self.sizing, name))

    @property
    def suffix_drafts(self) -> bool:
        return parse_draft(self.draft)[0]

    @property
    def draft_model(self) -> str | None:
        """The draft model: a directory or a self-draft ("self:int4"); None when drafts come from the suffix
        index alone."""
        return parse_draft(self.draft)[1]

    @property
    def speculative(self) -> bool:
        """Whether the engine drafts at all (autoregressive mode runs the target alone and ignores k)."""
        return self.mode != "autoregressive"

    @property
    def core_mode(self) -> str:
        """The mode whose core rule applies (cores.py): a drafter with suffix drafts alone runs no model, only a
        few milliseconds of Python per step, so in minedraft mode it shares the verifier's cores, as in
        autoregressive mode, instead of taking half of them."""
        return "autoregressive" if self.mode == "minedraft" and self.draft_model is None else self.mode

    @property
    def draft_k(self) -> int:
        """The configured draft budget per row: k, or 0 in autoregressive mode (the target alone ignores k)."""
        return self.k if self.speculative else 0

    @property
    def budget(self) -> DraftBudget:
        return DraftBudget(self.draft_k, bool(self.tetris and self.draft_k), self.tetris_extra, self.tetris_capacity)

    @property
    def max_draft(self) -> int:
        """The most drafts one row can carry in a step (k, plus tetris_extra in Tetris mode; 0 without a draft):
        what KV reservations and draft slots are sized for."""
        return self.budget.max_draft

    def to_dict(self) -> dict:
        return asdict(self)
