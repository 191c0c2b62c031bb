"""The minedraft wire protocol, version 1: msgpack maps over ZeroMQ (server ROUTER, client DEALER).

docs/PROTOCOL.md is the reference; this module is its executable half, shared by the server and the Python
client: constants, encoding, request validation, reply builders, and the error classes behind each code.

Framing: a client's DEALER socket sends ONE frame per message, the msgpack map itself (no empty delimiter
frame). The server's ROUTER sees [identity, payload] and replies [identity, payload]; the client's DEALER
receives just [payload].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack

from ...config import PROMPT_CHARS_PER_TOKEN
from ...errors import EngineDeadError, InvalidRequestError, MinedraftError, OverloadedError
from ...outputs import GenerationResult, RequestStats, StreamDelta

VERSION = 1

# Sizes --------------------------------------------------------------------------------------------------------
DEFAULT_MAX_MESSAGE_BYTES = 1 << 20    # a request over this gets a `too_large` error reply (when no prompt
                                       # limit is known to size it from; see message_limit_for)
HARD_LIMIT_FACTOR = 4                  # ...and one over factor x that is dropped by libzmq (zmq.MAXMSGSIZE),
                                       # which also closes that client's connection
MAX_ID_CHARS = 256
DEFAULT_MAX_QUEUED_REPLIES = 1000      # unread replies one client may have waiting in the server (zmq SNDHWM)


def message_limit_for(max_prompt_tokens: int) -> int:
    """The default message size limit: room for the longest prompt the engine accepts (a string of 16 characters
    per token at 4 UTF-8 bytes each, which also covers a list of token ids at <= 9 bytes each) plus 64 KiB for
    the rest (params, stop strings). Anything bigger could only be refused after decoding, so it is refused
    before, as too_large."""
    return 4 * PROMPT_CHARS_PER_TOKEN * max_prompt_tokens + (64 << 10)

# Message types ------------------------------------------------------------------------------------------------
REQUEST_TYPES = ("generate", "stream", "cancel", "health", "stats")
REPLY_TYPES = ("result", "delta", "done", "cancelled", "health", "stats", "error")

# Error codes --------------------------------------------------------------------------------------------------
BAD_MESSAGE = "bad_message"                  # not msgpack, not a map, more than one frame, no string `t`
UNSUPPORTED_VERSION = "unsupported_version"  # `v` missing or not 1
UNKNOWN_TYPE = "unknown_type"                # `t` is a string but not a request type
INVALID_REQUEST = "invalid_request"          # wrong field types, bad params, prompt too long, max_tokens > limit
UNKNOWN_REQUEST = "unknown_request"          # cancel of an id that is not running for this client
DUPLICATE_ID = "duplicate_id"                # generate/stream with an id this client already has running
TOO_LARGE = "too_large"                      # message over the server's size limit
OVERLOADED = "overloaded"                    # engine queue or per-client in-flight limit full; retry later
ENGINE_DEAD = "engine_dead"                  # a worker died / the server is shutting down
INTERNAL = "internal"                        # a bug; the message says what
ERROR_CODES = (BAD_MESSAGE, UNSUPPORTED_VERSION, UNKNOWN_TYPE, INVALID_REQUEST, UNKNOWN_REQUEST, DUPLICATE_ID,
               TOO_LARGE, OVERLOADED, ENGINE_DEAD, INTERNAL)


# Error classes (codes errors.py does not define yet) ----------------------------------------------------------
class ProtocolError(MinedraftError):
    """A message the server could not accept as a request at all."""

    code = BAD_MESSAGE


class BadMessageError(ProtocolError):
    code = BAD_MESSAGE


class UnsupportedVersionError(ProtocolError):
    code = UNSUPPORTED_VERSION


class UnknownTypeError(ProtocolError):
    code = UNKNOWN_TYPE


class TooLargeError(ProtocolError):
    code = TOO_LARGE


class DuplicateIdError(InvalidRequestError):
    code = DUPLICATE_ID


class UnknownRequestError(MinedraftError, KeyError):
    code = UNKNOWN_REQUEST

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class InternalServerError(MinedraftError):
    code = INTERNAL


ERROR_CLASSES: dict[str, type[MinedraftError]] = {
    BAD_MESSAGE: BadMessageError, UNSUPPORTED_VERSION: UnsupportedVersionError, UNKNOWN_TYPE: UnknownTypeError,
    INVALID_REQUEST: InvalidRequestError, UNKNOWN_REQUEST: UnknownRequestError, DUPLICATE_ID: DuplicateIdError,
    TOO_LARGE: TooLargeError, OVERLOADED: OverloadedError, ENGINE_DEAD: EngineDeadError,
    INTERNAL: InternalServerError,
}


def error_from_reply(msg: dict) -> MinedraftError:
    """The exception a client raises for an `error` reply; unknown codes keep their code on a MinedraftError."""
    code = msg.get("code")
    text = msg.get("message") if isinstance(msg.get("message"), str) else ""
    cls = ERROR_CLASSES.get(code) if isinstance(code, str) else None
    if cls is not None:
        return cls(text)
    err = MinedraftError(f"[{code}] {text}")
    err.code = code if isinstance(code, str) else INTERNAL
    return err


# Encoding -----------------------------------------------------------------------------------------------------
def encode(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def _str_keys(pairs) -> dict:
    for k, _ in pairs:
        if not isinstance(k, str):
            raise ValueError(f"map keys must be strings, got a {type(k).__name__} key")
    return dict(pairs)


def decode(data: bytes, str_keys: bool = False) -> Any:
    """Decode one frame. Raises BadMessageError for anything that is not exactly one well-formed msgpack object.

    Map keys must be str or bin (strict_map_key); with str_keys (the server, on requests) str only, at a cost
    per map that replies, decoded by clients on every delta, need not pay. Strings must be valid UTF-8; nesting
    is bounded by msgpack's own stack limit; container lengths are bounded by the frame size.
    """
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True,
                               object_pairs_hook=_str_keys if str_keys else None)
    except Exception as e:  # ExtraData, FormatError, StackError, UnicodeDecodeError, ValueError, ...
        raise BadMessageError(f"not a single well-formed msgpack object: {type(e).__name__}: {e}"[:300]) from None


def peek_fields(data: bytes, names=("id", "t")) -> dict:
    """Cheaply pull top-level scalar fields out of a frame without decoding the rest (used for `too_large`
    and `bad_message` replies, so they can still carry the id). Returns what it found; never raises."""
    found: dict = {}
    try:
        up = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=max(len(data), 1))
        up.feed(data)
        n = up.read_map_header()
        for _ in range(n):
            key = up.unpack()
            if key in names and key not in found:
                value = up.unpack()
                if isinstance(value, (str, int)) and not isinstance(value, bool):
                    found[key] = value
                if len(found) == len(names):
                    break
            else:
                up.skip()
    except Exception:
        pass
    return found


def echo_id(value) -> str | int | None:
    """What a reply's `id` is when the request's id is unusable: the value if a str/int scalar, else nil.
    (error_reply cuts a string longer than MAX_ID_CHARS and marks the reply `id_truncated: true`.)"""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


# Requests -----------------------------------------------------------------------------------------------------
@dataclass
class Request:
    t: str
    id: str
    prompt: Any = None           # str | list[int] (generate/stream)
    params: dict | None = None   # raw params map; SamplingParams.from_dict validates it


class RequestError(Exception):
    """Raised by parse_request: the error reply to send (code, message) and the id to echo."""

    def __init__(self, code: str, message: str, id=None, t=None):
        super().__init__(message)
        self.code, self.message, self.id, self.t = code, message, id, t


def parse_request(obj: Any, max_prompt_tokens: int | None = None) -> Request:
    """Validate the envelope of one decoded message. Field *values* (params ranges, token ids in vocabulary) are
    checked by the engine, which raises InvalidRequestError. With max_prompt_tokens, a prompt's length is checked
    here, before any per-element work, so an over-long prompt costs one len()."""
    if not isinstance(obj, dict):
        raise RequestError(BAD_MESSAGE, f"a message must be a msgpack map, got {_kind(obj)}")
    rid = echo_id(obj.get("id"))
    t = obj.get("t")
    if not isinstance(t, str):
        raise RequestError(BAD_MESSAGE, "field 't' (message type) must be a string", rid)
    re_t = t if t in REQUEST_TYPES else None
    v = obj.get("v")
    if isinstance(v, bool) or not isinstance(v, int) or v != VERSION:  # 1.0 is not 1: a float is a client bug
        raise RequestError(UNSUPPORTED_VERSION, f"field 'v' must be {VERSION}, got {_short(v)}", rid, re_t)
    if t not in REQUEST_TYPES:
        raise RequestError(UNKNOWN_TYPE, f"unknown message type {t[:64]!r}; expected one of "
                           f"{', '.join(REQUEST_TYPES)}", rid)
    raw_id = obj.get("id")
    if not isinstance(raw_id, str) or not raw_id or len(raw_id) > MAX_ID_CHARS:
        raise RequestError(INVALID_REQUEST, f"field 'id' must be a non-empty string of at most {MAX_ID_CHARS} "
                           f"characters, got {_short(raw_id)}", rid, t)
    if t in ("generate", "stream"):
        prompt = obj.get("prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError(INVALID_REQUEST, "field 'prompt' is empty", raw_id, t)
            if max_prompt_tokens and len(prompt) > PROMPT_CHARS_PER_TOKEN * max_prompt_tokens:
                raise RequestError(INVALID_REQUEST, f"field 'prompt' is {len(prompt)} characters; the limit is "
                                   f"{PROMPT_CHARS_PER_TOKEN * max_prompt_tokens} ({PROMPT_CHARS_PER_TOKEN} per "
                                   f"token of max_prompt_tokens={max_prompt_tokens}, `serve --max-prompt-tokens`)",
                                   raw_id, t)
        elif isinstance(prompt, list):
            if not prompt:
                raise RequestError(INVALID_REQUEST, "field 'prompt' is an empty token list", raw_id, t)
            if max_prompt_tokens and len(prompt) > max_prompt_tokens:
                raise RequestError(INVALID_REQUEST, f"field 'prompt' has {len(prompt)} token ids; "
                                   f"max_prompt_tokens is {max_prompt_tokens} (`serve --max-prompt-tokens`)", raw_id, t)
            if any(isinstance(x, bool) or not isinstance(x, int) for x in prompt):
                raise RequestError(INVALID_REQUEST, "field 'prompt' as a list must hold only integer token ids",
                                   raw_id, t)
        else:
            raise RequestError(INVALID_REQUEST, "field 'prompt' must be a string or a list of token ids, got "
                               f"{_kind(prompt)}", raw_id, t)
        params = obj.get("params")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise RequestError(INVALID_REQUEST, f"field 'params' must be a map, got {_kind(params)}", raw_id, t)
        for key, value in params.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise RequestError(INVALID_REQUEST, f"params.{key} must be finite", raw_id, t)
        return Request(t, raw_id, prompt, params)
    return Request(t, raw_id)


def _kind(x) -> str:
    return {dict: "map", list: "array", str: "string", bytes: "binary", bool: "boolean", int: "integer",
            float: "float", type(None): "nil"}.get(type(x), type(x).__name__)


def _short(x) -> str:
    r = repr(x)
    return r if len(r) <= 64 else r[:61] + "..."


def request(t: str, id: str, **fields) -> dict:
    return {"v": VERSION, "t": t, "id": id, **fields}


# Replies ------------------------------------------------------------------------------------------------------
def error_reply(id, code: str, message: str, re: str | None = None) -> dict:
    """An error reply. Only an invalid id can be over MAX_ID_CHARS: it is echoed cut to that length, with
    `id_truncated: true`, so the reply stays small and the client can still see which request it answers."""
    cut = isinstance(id, str) and len(id) > MAX_ID_CHARS
    msg = {"v": VERSION, "t": "error", "id": id[:MAX_ID_CHARS] if cut else id, "code": code, "message": message}
    if cut:
        msg["id_truncated"] = True
    if re is not None:
        msg["re"] = re
    return msg


def result_reply(id: str, res: GenerationResult | list[GenerationResult]) -> dict:
    """A generate's result; with params.n > 1 (a list), the first completion's fields as for n = 1, plus
    `choices` holding all of them (index, text, token_ids, finish_reason, stats; logprobs when asked for)."""
    rs = res if isinstance(res, list) else [res]
    msg = {"v": VERSION, "t": "result", "id": id, "text": rs[0].text, "token_ids": list(rs[0].token_ids),
           "finish_reason": rs[0].finish_reason, "stats": rs[0].stats.to_dict()}
    if rs[0].logprobs is not None:  # only when asked for (params.logprobs): older clients never see the key
        msg["logprobs"] = rs[0].logprobs
    if isinstance(res, list):
        msg["choices"] = [{"index": i, "text": r.text, "token_ids": list(r.token_ids),
                           "finish_reason": r.finish_reason, "stats": r.stats.to_dict(),
                           **({"logprobs": r.logprobs} if r.logprobs is not None else {})} for i, r in enumerate(rs)]
    return msg


def delta_reply(id: str, text: str, token_ids, logprobs: list | None = None) -> dict:
    msg = {"v": VERSION, "t": "delta", "id": id, "text": text, "token_ids": list(token_ids)}
    if logprobs is not None:
        msg["logprobs"] = logprobs
    return msg


def done_reply(id: str, finish_reason: str, stats: RequestStats | None) -> dict:
    return {"v": VERSION, "t": "done", "id": id, "finish_reason": finish_reason,
            "stats": (stats or RequestStats()).to_dict()}


def stats_from_dict(d: dict | None) -> RequestStats:
    d = d if isinstance(d, dict) else {}
    keep = RequestStats.__dataclass_fields__
    return RequestStats(**{k: v for k, v in d.items() if k in keep})


def result_from_reply(msg: dict) -> GenerationResult:
    return GenerationResult(msg["id"], msg.get("text", ""), list(msg.get("token_ids", [])),
                            msg.get("finish_reason", "abort"), stats_from_dict(msg.get("stats")), msg.get("logprobs"))


def delta_from_reply(msg: dict) -> StreamDelta:
    if msg["t"] == "done":
        return StreamDelta(msg["id"], "", [], True, msg.get("finish_reason"), stats_from_dict(msg.get("stats")))
    return StreamDelta(msg["id"], msg.get("text", ""), list(msg.get("token_ids", [])), logprobs=msg.get("logprobs"))
