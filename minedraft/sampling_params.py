"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, replace

from .errors import InvalidRequestError, check_text


GREEDY_BELOW = 1e-5
MAX_N = 64  # completions per request
INT_LIMIT = 2**31  # ints travel to the workers as msgpack; nothing real comes near this
# Stop strings are matched on the caller's event loop: these bound the matcher's size (detokenize.StopMatcher),
# so one request cannot stall every other (README, Limits)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 128
MAX_LOGPROBS = 20   # OpenAI's top_logprobs limit
# output controls (minedraft/controls/logits.py, grammar.py): left out of to_dict at these values, so the wire form
# of a request that uses none of them is what it was before they existed
CONTROL_DEFAULTS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": (),
                    "logprobs": None, "speculate": True, "draft_budget": None, "json_schema": None, "regex": None,
                    "grammar": None}


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples.

    temperature == 0 (or below 1e-5) means greedy. top_k == 0 and top_p == 1.0 disable those filters.
    seed makes a sampled request reproducible on its own, whatever else shares its batch.

    Stop rule: the token that ended the request is the last of `token_ids`, and what triggered the stop is never
    in `text`. A stop token (stop_token_ids, or eos unless ignore_eos) ends token_ids and its text is left out;
    for a stop string, token_ids end with the token that completed it and text ends just before the string.

    Output controls, applied to the draft's and the target's logits alike at every position, from the history up
    to it (drafts included), before temperature / top-k / top-p (controls/logits.py): repetition_penalty (> 0, 1 off;
    prompt and output tokens), frequency_penalty and presence_penalty (in [-2, 2]; output tokens), logit_bias
    ({token id: bias in [-100, 100]}, stored as sorted (id, bias) pairs), then a grammar mask: json_schema (a
    JSON Schema as a dict or JSON text; {"type": "object"} is OpenAI's json_object), regex, or grammar (Lark), at
    most one. logprobs: None (off), or N in [0, 20]: each output token's log-probability under the target's raw
    distribution and the N most likely tokens'. speculate=False or draft_budget=0: this request gets no drafts;
    draft_budget=k caps its drafts per step (None: the engine's).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    speculate: bool = True
    draft_budget: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    grammar: str | None = None
    n: int = 1  # completions of the prompt (Engine.generate_choices); they share its KV blocks

    def __post_init__(self):
        # Accept lists from JSON/msgpack callers but store tuples so params stay hashable.
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise InvalidRequestError(f"invalid SamplingParams: stop_token_ids must be a list of ints, "
                                      f"got {self.stop_token_ids!r}", "stop_token_ids")
        if not isinstance(self.stop, (str, list, tuple)):
            raise InvalidRequestError(f"invalid SamplingParams: stop must be a str or a list of str, got {self.stop!r}",
                                      "stop")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if isinstance(self.json_schema, dict):
            try:
                object.__setattr__(self, "json_schema", json.dumps(self.json_schema, separators=(",", ":")))
            except (TypeError, ValueError) as e:
                raise InvalidRequestError(f"invalid SamplingParams: json_schema is not JSON: {e}",
                                          "json_schema") from None
        self._validate()
        self._validate_controls()

    def _validate(self):
        def bad(param, msg):
            raise InvalidRequestError(f"invalid SamplingParams: {msg}", param)

        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            bad("temperature", f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k < INT_LIMIT:
            bad("top_k", f"top_k must be an int in [0, 2**31) (0 disables), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p <= 1):
            bad("top_p", f"top_p must be in (0, 1], got {p!r}")
        m = self.max_tokens
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m < INT_LIMIT:
            bad("max_tokens", f"max_tokens must be an int in [1, 2**31), got {m!r}")
        for tid in self.stop_token_ids:
            if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < INT_LIMIT:
                bad("stop_token_ids", f"stop_token_ids must be ints in [0, 2**31), got {tid!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"{len(self.stop)} stop strings; the limit is {MAX_STOP_STRINGS} (MAX_STOP_STRINGS)")
        for s in self.stop:
            if isinstance(s, str) and len(s) > MAX_STOP_CHARS:
                bad("stop", f"a stop string of {len(s)} characters; the limit is {MAX_STOP_CHARS} (MAX_STOP_CHARS)")
            if not isinstance(s, str) or not s:
                bad("stop", f"stop strings must be non-empty str, got {s!r}")
            check_text(s, "invalid SamplingParams: a stop string", "stop")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not (0 <= self.seed < 2**63)):
            bad("seed", f"seed must be an int in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            bad("n", f"n must be an int in 1..{MAX_N}, got {self.n!r}")

    def choice(self, i: int) -> "SamplingParams":
        """The params of completion i of n: n = 1, and a seed of its own (choice 0 keeps the seed, so it is the
        n = 1 completion; the others' seeds are hashed from it), so a seeded request gives n distinct,
        reproducible samples."""
        seed = self.seed
        if seed is not None and i:
            h = hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=8).digest()
            seed = int.from_bytes(h, "little") >> 1   # below 2**63
        return replace(self, n=1, seed=seed)

    def _validate_controls(self):
        def bad(param, msg):
            raise InvalidRequestError(f"invalid SamplingParams: {msg}", param)

        def number(name, lo, hi, lo_open=False):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < lo or v > hi or (lo_open and v <= lo):
                bad(name, f"{name} must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}")
        number("presence_penalty", -2, 2)
        number("frequency_penalty", -2, 2)
        number("repetition_penalty", 0, 100, lo_open=True)
        for tid, b in self.logit_bias:
            if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < INT_LIMIT:
                bad("logit_bias", f"logit_bias keys must be token ids in [0, 2**31), got {tid!r}")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                bad("logit_bias", f"logit_bias values must be numbers in [-100, 100], got {b!r}")
        n = self.logprobs
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_LOGPROBS):
            bad("logprobs", f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {n!r}")
        if not isinstance(self.speculate, bool):
            bad("speculate", f"speculate must be a bool, got {self.speculate!r}")
        d = self.draft_budget
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < INT_LIMIT):
            bad("draft_budget", f"draft_budget must be None or an int >= 0, got {d!r}")
        given = [f for f in ("json_schema", "regex", "grammar") if getattr(self, f) is not None]
        if len(given) > 1:
            bad(given[1], f"at most one of json_schema, regex and grammar, got {' and '.join(given)}")
        if given:
            if not isinstance(getattr(self, given[0]), str):
                bad(given[0], f"{given[0]} must be a str, got {type(getattr(self, given[0])).__name__}")
            if self.ignore_eos:
                bad("ignore_eos", "ignore_eos cannot be combined with structured output (the grammar ends on eos)")
            from .grammar_check import check  # imports the grammar engine only for a request that has a grammar
            check(given[0], getattr(self, given[0]))

    @property
    def max_drafts(self) -> int | None:
        """The most drafts this request takes per step: 0 with speculate=False, else draft_budget (None: no cap)."""
        return 0 if not self.speculate else self.draft_budget

    @property
    def has_controls(self) -> bool:
        """Whether its logits need processing beyond temperature / top-k / top-p (controls/logits.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.structured)

    @property
    def structured(self) -> tuple[str, str] | None:
        """(kind, text) of its grammar: ("json_schema" | "regex" | "grammar", ...), or None."""
        for f in ("json_schema", "regex", "grammar"):
            if getattr(self, f) is not None:
                return f, getattr(self, f)
        return None

    @property
    def greedy(self) -> bool:
        # below this, logits / T overflows float32; such a temperature is greedy in all but name
        return self.temperature < GREEDY_BELOW

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["stop"] = list(self.stop)
        for name, default in CONTROL_DEFAULTS.items():
            if d[name] == default:
                del d[name]
        if "logit_bias" in d:  # str keys: a JSON and ZeroMQ-protocol-safe map
            d["logit_bias"] = {str(t): b for t, b in self.logit_bias}
        if self.n == 1:  # left out, so the map stays what servers before n existed accept
            del d["n"]
        return d

    @classmethod
    def from_dict(cls, d: dict | None) -> "SamplingParams":
        if d is not None and not isinstance(d, dict):
            raise InvalidRequestError(f"invalid SamplingParams: expected a map, got {type(d).__name__}")
        d = dict(d or {})
        known = set(cls.__dataclass_fields__)
        unknown = [k for k in d if k not in known]
        if unknown:
            raise InvalidRequestError(f"invalid SamplingParams: unknown field(s) {sorted(map(repr, unknown))}")
        try:
            return cls(**d)
        except TypeError as e:  # e.g. unhashable values inside lists
            raise InvalidRequestError(f"invalid SamplingParams: {e}") from None


def _bias_pairs(bias) -> tuple:
    """logit_bias as sorted (int id, bias) pairs, from a map (keys ints or decimal strings, as JSON sends them)
    or pairs."""
    if isinstance(bias, dict):
        items = list(bias.items())
    elif isinstance(bias, (list, tuple)) and all(isinstance(x, (list, tuple)) and len(x) == 2 for x in bias):
        items = [tuple(x) for x in bias]
    else:
        raise InvalidRequestError(f"invalid SamplingParams: logit_bias must be a map of token id to bias, got "
                                  f"{bias!r}", "logit_bias")
    out = {}
    for k, v in items:
        if isinstance(k, str) and k.isdigit() and len(k) < 12:
            k = int(k)
        if isinstance(k, bool) or not isinstance(k, int):
            raise InvalidRequestError(f"invalid SamplingParams: logit_bias keys must be token ids, got {k!r}",
                                      "logit_bias")
        out[k] = v
    return tuple(sorted(out.items()))


def as_params(params) -> "SamplingParams":
    """A request's params given as None (defaults), a dict or SamplingParams; anything else is refused."""
    if params is None:
        return SamplingParams()
    if isinstance(params, dict):
        return SamplingParams.from_dict(params)
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params must be SamplingParams or a dict, got {type(params).__name__}")
    return params
