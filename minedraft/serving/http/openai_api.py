"""OpenAI request bodies -> (prompt, SamplingParams), and engine output -> OpenAI response and chunk objects.

Only what minedraft can honour is accepted: a field that asks for something it does not do (n > 1 streamed, tools,
echo, ...) is refused with a 400 naming it, rather than silently ignored, and so is a field this
module does not know (as OpenAI does: a misspelt or newer option must not pass as honoured). Fields that never
change the output (user, metadata, store, ...) are accepted and ignored.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from dataclasses import dataclass

from ... import errors
from ...errors import InvalidRequestError
from ...outputs import GenerationResult, RequestStats
from ...sampling_params import MAX_STOP_STRINGS, SamplingParams
from . import output_fields as ctl

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class APIError(Exception):
    """An error with an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, code="invalid_value" if param else None, param=param)


# fields that would change the output in ways minedraft does not implement, with the value that is harmless
_UNSUPPORTED = {"best_of": (None, 1), "echo": (None, False), "suffix": (None, ""), "tools": (None, []),
                "functions": (None, []), "tool_choice": (None, "none"), "function_call": (None, "none"),
                "modalities": (None, ["text"]),
                # vLLM-style extensions, accepted at the values that change nothing
                "min_p": (None, 0, 0.0), "min_tokens": (None, 0),
                "skip_special_tokens": (None, True), "include_stop_str_in_output": (None, False)}


# accepted and honoured, on both endpoints, and each endpoint's own
_HONOURED = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
             "n", "stream", "stream_options"}
_ENDPOINT_FIELDS = {"completion": {"prompt"}, "chat": {"messages", "max_completion_tokens"}}
# accepted and ignored: they never change the output (parallel_tool_calls only matters with tools, refused)
_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
            "prompt_cache_retention", "prompt_cache_options", "safety_identifier"}
_KNOWN = _HONOURED | _IGNORED | set(_UNSUPPORTED) | ctl.FIELDS  # ctl: output controls (serving/http/output_fields.py)
_STREAM_OPTIONS = {"include_usage", "include_obfuscation"}  # obfuscation pads chunks; it never changes the text


@dataclass
class ParsedRequest:
    prompt: object              # str or token ids (completions) / messages (chat); None until the endpoint sets it
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str
    max_name: str = "max_tokens"   # the field the client gave its limit in (max_completion_tokens in newer chat)


def _get(body: dict, name: str, types, default=None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise invalid(f"'{name}' must be {getattr(types, '__name__', types)}, got {v!r}", name)
    if not isinstance(v, types):
        raise invalid(f"'{name}' has the wrong type: {type(v).__name__}", name)
    return v


def _common(body: dict, served: str, default_max_tokens: int, endpoint: str) -> ParsedRequest:
    """Everything but the prompt / messages (left None), checked."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    model = body.get("model", served)
    if not isinstance(model, str):
        raise invalid("'model' must be a string", "model")
    if model != served:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{served}' (GET /v1/models)",
                       code="model_not_found", param="model")
    for name, ok in _UNSUPPORTED.items():
        if name in body and body[name] not in ok:
            raise invalid(f"'{name}' is not supported by minedraft", name)
    for name in body:
        if name not in _KNOWN and name not in _ENDPOINT_FIELDS[endpoint]:
            raise invalid(f"unrecognized request argument '{name}': minedraft does not support it", name)
    n = _get(body, "n", int, 1)
    if n != 1 and body.get("stream"):
        raise invalid(f"n > 1 is supported without 'stream' only, got n={n}", "n")
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _get(body, max_name, int, default_max_tokens)  # max_completion_tokens: the newer name (chat)
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:  # before any per-element work
        raise invalid(f"{len(stop)} stop strings; the limit is {MAX_STOP_STRINGS} (MAX_STOP_STRINGS)", "stop")
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise invalid("'stop' must be a string or a list of strings", "stop")
    top_k = _get(body, "top_k", int, 0)
    if top_k < -1:
        raise invalid(f"'top_k' must be -1 or 0 (off) or a positive int, got {top_k}", "top_k")
    stream = _get(body, "stream", bool, False)
    opts = _get(body, "stream_options", dict, None)
    if opts is not None and not stream:
        raise invalid("'stream_options' is only allowed with 'stream': true", "stream_options")
    opts = opts or {}
    for name in opts:
        if name not in _STREAM_OPTIONS:
            raise invalid(f"unrecognized stream option '{name}'", "stream_options")
    include_usage = _get(opts, "include_usage", bool, False)
    stop_ids = _get(body, "stop_token_ids", list, [])
    try:
        extra = ctl.control_kwargs(body, endpoint == "chat")
    except ctl.BadField as e:
        raise invalid(str(e), e.param) from None
    try:
        params = SamplingParams(
            temperature=_get(body, "temperature", (int, float), 1.0),  # OpenAI's default
            top_p=_get(body, "top_p", (int, float), 1.0),
            top_k=0 if top_k == -1 else top_k,  # -1 also means "off" in vLLM's extension
            max_tokens=max_tokens, stop=tuple(s for s in stop if s), stop_token_ids=stop_ids,
            seed=_get(body, "seed", int), ignore_eos=_get(body, "ignore_eos", bool, False), n=n, **extra)
    except InvalidRequestError as e:
        param = max_name if e.param == "max_tokens" else ctl.PARAM_NAMES.get(e.param, e.param)
        raise invalid(str(e).replace("invalid SamplingParams: ", ""), param) from None
    return ParsedRequest(None, params, stream, include_usage, model, max_name)


def parse_completion(body: dict, served: str) -> ParsedRequest:
    req = _common(body, served, COMPLETION_DEFAULT_MAX_TOKENS, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raise invalid("only one prompt per request is supported (n=1, no batched prompts)", "prompt")
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))):
        raise invalid("'prompt' must be a string or a list of token ids", "prompt")
    return dataclasses.replace(req, prompt=prompt)


def parse_chat(body: dict, served: str, default_max_tokens: int) -> ParsedRequest:
    req = _common(body, served, default_max_tokens, "chat")
    if "messages" not in body:
        raise invalid("'messages' is required", "messages")
    return dataclasses.replace(req, prompt=body["messages"])


def engine_refusal(e: InvalidRequestError, req: ParsedRequest, chat: bool) -> APIError:
    """The engine's InvalidRequestError as a 400 naming the field in the client's terms (a chat's prompt is its
    messages; max_tokens is whichever name the client used)."""
    param = {"prompt": "messages" if chat else "prompt", "max_tokens": req.max_name,
             **ctl.PARAM_NAMES}.get(e.param, e.param)
    return invalid(str(e), param)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def too_many_messages(raw, limit: int) -> int | None:
    """The number of chat messages in a raw body when it is over limit, else None: counted by skimming the body
    (msgspec slices each message without building it, ~8x cheaper than parsing them), so a refused
    12,000-message body costs a fraction of a millisecond of event loop. None too when the body cannot be skimmed
    (no msgspec, not a JSON object, messages not a list): the full parse then says what is wrong."""
    try:
        import msgspec
    except ImportError:
        return None
    global _SKIM
    if _SKIM is None:
        _SKIM = msgspec.json.Decoder(msgspec.defstruct("_Messages", [("messages", list[msgspec.Raw], [])]))
    try:
        n = len(_SKIM.decode(raw).messages)
    except (msgspec.MsgspecError, RecursionError):
        return None
    return n if n > limit else None


_SKIM = None


def decode_json(raw) -> object:
    """The request body, parsed by msgspec's decoder (2-30x json's on bodies of many small objects, the most
    event-loop time a refused request costs); json's where the body escapes a surrogate (msgspec refuses a lone
    one with a misleading message; check_body_text then names it) or where msgspec is missing. Both raise ValueError
    (or RecursionError) on bad input."""
    try:
        import msgspec
    except ImportError:
        return json.loads(raw)
    if _SURROGATE_ESCAPE.search(raw):
        return json.loads(raw)
    return msgspec.json.decode(raw)


def check_body_text(raw: bytes, body) -> None:
    """Refuse a body holding a string that is not valid Unicode (a lone UTF-16 surrogate such as "\\ud800",
    which JSON can carry and Python accepts, but no tokenizer or UTF-8 reply can). Only a body whose raw bytes
    hold a surrogate escape (a pair is fine: it decodes to one character) is walked."""
    if not _SURROGATE_ESCAPE.search(raw):
        return
    stack = [body]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, str):
            try:
                errors.check_text(x, "the request")
            except InvalidRequestError as e:
                raise invalid(str(e)) from None


# -- responses -------------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(st: RequestStats | None) -> dict:
    p = st.prompt_tokens if st else 0
    c = st.output_tokens if st else 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": st.cached_tokens if st else 0},
            "completion_tokens_details": drafts(st.draft_tokens if st else 0, st.accepted_tokens if st else 0)}


def drafts(drafted: int, accepted: int) -> dict:
    """This request's speculation in OpenAI's names for predicted tokens (accepted / rejected), plus the tokens
    drafted for it (an extension): a client sees that speculate=false took effect (0 drafted) without /metrics."""
    return {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": drafted - accepted,
            "draft_tokens": drafted}


def finish(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length"}.get(reason, reason)


def usage_of(results: list[GenerationResult]) -> dict:
    """n completions of one prompt: the prompt counted once, their completions summed."""
    u = usage(results[0].stats)
    u["completion_tokens"] = sum(r.stats.output_tokens for r in results)
    u["completion_tokens_details"] = drafts(sum(r.stats.draft_tokens for r in results),
                                            sum(r.stats.accepted_tokens for r in results))
    u["total_tokens"] = u["prompt_tokens"] + u["completion_tokens"]
    return u


def completion(rid: str, model: str, r: GenerationResult | list[GenerationResult], logprobs: list | None = None
               ) -> dict:
    """r: one result, or the n choices of one prompt; logprobs: one entry (a dict or None) per choice."""
    rs = r if isinstance(r, list) else [r]
    lps = logprobs or [None] * len(rs)
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "text": x.text, "logprobs": lp, "finish_reason": finish(x.finish_reason)}
                        for i, (x, lp) in enumerate(zip(rs, lps))],
            "usage": usage_of(rs)}


def chat_completion(rid: str, model: str, r: GenerationResult | list[GenerationResult], logprobs: list | None = None
                    ) -> dict:
    rs = r if isinstance(r, list) else [r]
    lps = logprobs or [None] * len(rs)
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": x.text}, "logprobs": lp,
                         "finish_reason": finish(x.finish_reason)} for i, (x, lp) in enumerate(zip(rs, lps))],
            "usage": usage_of(rs)}


def completion_chunk(rid: str, model: str, created: int, text: str, reason: str | None,
                     logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish(reason)}]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, reason: str | None,
               logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish(reason)}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, st: RequestStats | None) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(st)}
