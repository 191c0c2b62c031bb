"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, replace

from .errors import InvalidRequestError, check_text


GREEDY_BELOW = 1e-5
MAX_N = 64  # completions per request
INT_LIMIT = 2**31  # ints travel to the workers as msgpack; nothing real comes near this


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples.

    temperature == 0 (or below 1e-5) means greedy. top_k == 0 and top_p == 1.0 disable those filters.
    seed makes a sampled request reproducible on its own, whatever else shares its batch.

    Stop rule: the token that ended the request is the last of `token_ids`, and what triggered the stop is never
    in `text`. A stop token (stop_token_ids, or eos unless ignore_eos) ends token_ids and its text is left out;
    for a stop string, token_ids end with the token that completed it and text ends just before the string.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
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
        self._validate()

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
        for s in self.stop:
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

    @property
    def greedy(self) -> bool:
        # below this, logits / T overflows float32; such a temperature is greedy in all but name
        return self.temperature < GREEDY_BELOW

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["stop"] = list(self.stop)
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


def as_params(params) -> "SamplingParams":
    """A request's params given as None (defaults), a dict or SamplingParams; anything else is refused."""
    if params is None:
        return SamplingParams()
    if isinstance(params, dict):
        return SamplingParams.from_dict(params)
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params must be SamplingParams or a dict, got {type(params).__name__}")
    return params
